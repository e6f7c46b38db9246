"""Run a function on N real CPU processes over gloo, with a timeout so a hang fails the test.

Usage::

    def body(rank: int, world_size: int, tmp: str) -> dict:
        ...  # torch.distributed is initialised here (gloo)
        return {"value": 1.0}     # picklable; collected per rank

    results = run_distributed(body, world_size=4, args=(str(tmp_path),), timeout=120)
    assert results[0]["value"] == ...

``body`` must be a module-level function (it is pickled into spawned processes). Tensors in
its result are returned as NumPy arrays (a tensor's shared memory would die with the worker).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def torchrun(
    script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run ``script args...`` under ``torch.distributed.run`` on ``nproc`` CPU ranks from the
    repository root (the package importable, one thread per rank, strict callbacks); fails the
    test with the tails of its output unless every rank exits 0."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", TRAINVITALS_STRICT="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()), str(script), *map(str, args),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} {args}:\n" + proc.stdout[-3000:] + proc.stderr[-8000:]
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    store: str,
    fn: Callable,
    args: tuple,
    queue: Any,
    env: dict[str, str],
    cwd: str,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        TRAINVITALS_STRICT="1",
    )
    torch.set_num_threads(1)
    try:
        # Rendezvous through a file, not a TCP port: a port found free by the parent can be
        # taken by another process before rank 0 binds it (a rare, timing-dependent failure).
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        result = _to_numpy(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_numpy(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


# Imported once by the fork server, so that a rank starts as a fork of a process that has them
# (about 0.1 s) instead of a fresh interpreter importing torch and lightning (2-4 s a rank on 2
# cores); a module that is not installed is skipped by the server.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "trainvitals",
    "trainvitals.callbacks",
    "lightning.pytorch",
]


def _context() -> Any:
    """A ``forkserver`` context: ranks forked from one server process that preloaded the heavy
    imports. Forked ranks inherit the server's state of when it started, so :func:`_worker`
    sets the caller's current environment and working directory itself (as ``spawn`` gives)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, __name__])
    return ctx


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results
    by rank. Raises ``AssertionError`` with the traceback of a failing rank, or ``TimeoutError``
    naming the ranks that did not finish within ``timeout`` seconds."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()  # only exported as MASTER_PORT, for code that reads it
    store_dir = tempfile.mkdtemp(prefix="trainvitals_pg_")
    store = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, store, fn, args, queue, dict(os.environ), os.getcwd()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (hang?)")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if errors:
                    break  # a rank failed; the others may wait forever on it
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
