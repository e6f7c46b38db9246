"""MemoryMonitor: device allocator statistics and host memory, worst rank first."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.distributed import all_gather_coalesced, all_reduce_coalesced, world_group
from trainvitals.stats import memory as memory_stats

__all__ = ["MemoryMonitor"]


class MemoryMonitor(VitalsCallback):
    """Memory of every rank at the end of logging steps, reduced so the worst rank shows.

    At ``step_end`` of a logging step (after the optimizer step, so optimizer state is in;
    the peaks cover the forward and backward passes, and any validation run in between) the
    monitor reads the CUDA caching
    allocator's counters (``torch.cuda.memory_stats``: host-side counters, no sync) when the
    run computes on a CUDA device, and this process's resident set (psutil; without it
    ``/proc`` on Linux, elsewhere no host keys, with a warning) in every case.
    That device is chosen once, at run start (``_run_cuda_device``), the first that
    applies: the run's declared device when it is CUDA (under Lightning the strategy's
    ``root_device``; under the driver with an ``accelerator`` its ``accelerator.device``); the
    first parameter's device when it is CUDA; any parameter or buffer on CUDA (a model whose first parameter is an embedding
    table kept on the CPU); any parameter sharded over a CUDA device mesh (FSDP2 with
    ``CPUOffloadPolicy``, whose shards live on the CPU: the current CUDA device); else, when
    CUDA is initialised in the process, its current CUDA device (a plain loop that moves the
    model to CUDA layer by layer), except when the run declares a device that is not CUDA
    (Lightning's ``accelerator="cpu"``, ``Accelerator(cpu=True)`` or an Accelerator on a
    machine without CUDA): the run computes there, and CUDA initialised by other code of the
    process is not the run's memory. Without CUDA, or when none applies, no CUDA key is
    written. Every other CUDA device that holds a parameter
    or buffer of the model at run start is read too: a model spread over several GPUs of one
    process (Hugging Face's ``device_map="auto"``, a hand-made pipeline) reports its worst
    device, not only its first (one more host-side ``memory_stats`` call per device on
    logging steps, no sync). A CUDA key is reduced over every device read on every rank (its
    ``/mean`` is the mean over devices), a host key over the ranks. A rank that reads no CUDA
    device (CUDA not available or not initialised there, a CPU-only rank of a mixed job, a
    model left on the CPU) still takes part, with no device: the CUDA keys are then those of
    the devices the other ranks read (one warning on every rank), and no CUDA key is written
    when no rank reads one. The readings of all ranks
    are reduced in ONE collective: an all-reduce MAX when only ``"max"`` is asked for, else
    one all-gather from which max, min and mean are taken. Non-logging steps read nothing.
    When the host memory cannot be read (at run start, or on one rank at one logging step: a
    passing ``EMFILE``), the host keys of that step are left out on every rank, with one
    warning, and the next logging step tries again; the CUDA keys are written regardless.
    A statistic that ``torch.cuda.memory_stats`` lacks on some device of some rank (an older
    torch, another allocator; under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` the
    inactive-split bytes, their peak, the retries and the OOMs, which that backend leaves at 0)
    is left out on every rank with one warning, never written as 0;
    when ``memory_stats`` raises (a ``CUDAPluggableAllocator`` such as RMM's has no
    statistics) the CUDA keys are left out the same way and the host keys are still written.

    Peaks are since the process started (as Composer's and Megatron-Bridge's reports), or since
    the previous logging step with ``peak_since_last_log=True`` (the first logging step's since
    the process started, or since the last reading of an earlier run in the same process; the
    allocator's peak counters are reset after each reading: do not
    combine with other code that relies on them). ``memory/peak_rss_gb`` is always since the
    process started: the OS's peak (``VmHWM`` on Linux, ``ru_maxrss`` elsewhere) cannot be
    reset. ``memory/alloc_retries`` and ``memory/ooms`` are totals since the process started
    in either case (``reset_peak_memory_stats`` leaves them). Nothing here is checkpoint
    state: a resumed process starts its own peaks and counts.

    Allocator history (CUDA only): ``record_history=True`` starts
    ``torch.cuda.memory._record_memory_history`` at run start (allocations made earlier, such
    as the model's weights, appear without a stack), and ``snapshot_steps`` dumps
    ``torch.cuda.memory._dump_snapshot`` at the end of those optimizer steps to
    ``<run_dir>/memory_snapshots/rank<r>_step<s>.pickle`` (open them at
    https://pytorch.org/memory_viz); under Lightning's manual optimization with several
    optimizers stepped per batch (each ``optimizer.step()`` is a step) a step's snapshot is
    taken at the end of its batch. Recording stops at the end of the run, also when the run
    raises and when a failing hook disables the monitor. Snapshots and history cover every
    CUDA device of the process. On a device without CUDA both are a no-op with one warning.

    Args:
        reduce: which reductions over ranks to write: a non-empty subset of ``("max", "min",
            "mean")``, or one of them as a string. ``"max"`` writes the plain keys, the others
            add ``/min`` and ``/mean`` (without ``"max"`` no plain key is written).
        host: also write the process's resident set (``memory/rss_gb``, ``memory/peak_rss_gb``).
        peak_since_last_log: CUDA peaks since the previous logging step instead of since start.
        record_history: record the CUDA allocator's history (for snapshots).
        max_history_entries: events the history keeps (``max_entries`` of the torch API).
        snapshot_steps: optimizer steps after which to dump an allocator snapshot.
        snapshot_dir: folder for snapshots (default ``<run_dir>/memory_snapshots``).
        log_every_n_steps: interval in optimizer steps (default: the run's).
        writer: where values go (default: the run's writer).

    Keys written on logging steps (each also as ``<key>/min`` and ``<key>/mean`` when asked):

    ============================  =========================================================  =====
    key                           meaning (max over ranks and their CUDA devices)            unit
    ============================  =========================================================  =====
    ``memory/allocated_gb``       memory held by live tensors (CUDA)                         GB
    ``memory/active_gb``          allocated plus blocks awaiting stream sync (CUDA)          GB
    ``memory/inactive_gb``        inactive, non-releasable split blocks: fragmentation       GB
    ``memory/reserved_gb``        memory the caching allocator holds from the driver (CUDA)  GB
    ``memory/peak_allocated_gb``  peak of ``allocated`` (CUDA)                               GB
    ``memory/peak_active_gb``     peak of ``active`` (CUDA)                                  GB
    ``memory/peak_inactive_gb``   peak of ``inactive`` (CUDA)                                GB
    ``memory/peak_reserved_gb``   peak of ``reserved`` (CUDA)                                GB
    ``memory/alloc_retries``      cudaMalloc failures that flushed the cache and retried     count
    ``memory/ooms``               out-of-memory errors the allocator raised                  count
    ``memory/rss_gb``             resident set size of the process (``host=True``)           GB
    ``memory/peak_rss_gb``        peak resident set size of the process (``host=True``)      GB
    ============================  =========================================================  =====

    GB are 1e9 bytes. Megatron-Bridge names these ``memory/mem-allocated-gigabytes``,
    ``memory/mem-max-allocated-gigabytes``, ... and ``memory/mem-alloc-retires`` (sic), Composer
    ``memory/current_allocated_mem``, ``memory/peak_allocated_mem``, ...; we use the shorter
    ``memory/<what>_gb`` / ``memory/peak_<what>_gb`` of the design's conventions and reduce
    over every rank (Megatron-Bridge reduces over the pipeline group only, and reported only
    the last stage's memory before, Megatron-Bridge issue #3167).

    Example::

        import lightning.pytorch as pl
        from trainvitals import MemoryMonitor

        trainer = pl.Trainer(callbacks=[MemoryMonitor(reduce=("max", "min"))])

        # plain loop, with an allocator snapshot after step 3
        from trainvitals.adapters.loop import Vitals

        monitor = MemoryMonitor(record_history=True, snapshot_steps=[3])
        vitals = Vitals([monitor], run_dir="runs/exp1").attach(model, optimizer)
    """

    def __init__(
        self,
        *,
        reduce: str | Sequence[str] = ("max",),
        host: bool = True,
        peak_since_last_log: bool = False,
        record_history: bool = False,
        max_history_entries: int = 100_000,
        snapshot_steps: Iterable[int] = (),
        snapshot_dir: str | Path | None = None,
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        names = (reduce,) if isinstance(reduce, str) else tuple(reduce)
        unknown = [r for r in names if r not in memory_stats.REDUCTIONS]
        if not names or unknown:
            raise ValueError(
                f"reduce must be a non-empty subset of {memory_stats.REDUCTIONS}, got {reduce!r}"
            )
        if (
            isinstance(max_history_entries, bool)
            or not isinstance(max_history_entries, int)
            or (max_history_entries <= 0)
        ):
            raise ValueError(
                f"max_history_entries must be a positive int, got {max_history_entries!r}"
            )
        steps = list(snapshot_steps)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"snapshot_steps must be non-negative ints, got {steps!r}")
        self.reduce = tuple(dict.fromkeys(names))
        self.host = bool(host)
        self.peak_since_last_log = bool(peak_since_last_log)
        self.record_history = bool(record_history)
        self.max_history_entries = max_history_entries
        self.snapshot_steps = frozenset(steps)
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self._cuda: tuple[torch.device, ...] = ()  # the CUDA devices read (run start)
        self._recording = False
        self._process: Any = None  # psutil.Process of this process, made at run start
        self._read_host = self.host  # the host could be read at run start
        self.snapshots: list[Path] = []  # files written by this process

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        self._process, self._read_host = None, self.host
        if self.host:
            try:
                import psutil

                self._process = psutil.Process()
            except ImportError:
                pass  # (host_memory_readings reads /proc instead, where there is one)
            try:
                memory_stats.host_memory_readings(self._process)
            except Exception as exc:
                # Without the host keys the CUDA keys are still worth writing: not a reason
                # to lose the whole monitor. The logging steps still try (NaN slots in the
                # collective while it fails: a failure on one rank, even a passing one, must
                # not change which collective this rank issues).
                self._read_host = False
                self.warn_once(
                    "host",
                    f"cannot read the host memory ({type(exc).__name__}: {exc}); "
                    "memory/rss_gb and memory/peak_rss_gb are not written while it fails",
                )
        self._cuda = _run_cuda_devices(ctx)
        if not self._cuda and not self._read_host:
            # Otherwise the monitor would sit in the run writing nothing, silently.
            self.warn_once(
                "nothing",
                f"no host readings and the run uses no CUDA device (model on {ctx.device}): "
                + (
                    "there is nothing to measure on this rank (keys are written only from what "
                    "other ranks read)"
                    if ctx.world_size > 1
                    else "there is nothing to measure and no key is written"
                )
                + (" while the host memory cannot be read" if self.host else ""),
            )
        if not self._cuda and (self.record_history or self.snapshot_steps):
            self.warn_once(
                "nocuda",
                "allocator history and snapshots need a CUDA device; the run uses none "
                f"(model on {ctx.device}): no history is recorded and no snapshot written",
            )
        if self._cuda and self.record_history:
            torch.cuda.memory._record_memory_history(
                enabled="all", max_entries=self.max_history_entries
            )
            self._recording = True

    def step_end(self, ctx: RunContext) -> None:
        if self._cuda and self.snapshot_steps:
            # Under Lightning's manual optimization with several optimizers one step_end ends
            # the steps ctx.step .. ctx.step + step_increment - 1 (one per optimizer.step()).
            for step in range(ctx.step, ctx.step + ctx.step_increment):
                if step in self.snapshot_steps:
                    self._dump_snapshot(ctx, f"step{step}")
        if self.should_log(ctx):
            self.write(ctx, self._read_and_reduce())

    def run_end(self, ctx: RunContext) -> None:
        self._stop_recording()

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        try:
            if self._cuda and self._recording:
                # The state at the failure (often an OOM) is the most useful snapshot there is.
                self._dump_snapshot(ctx, "exception")
        finally:  # a dump that fails (disk full, after an OOM) must not leave history on
            self._stop_recording()

    def release(self, ctx: RunContext) -> None:
        # Disabled by the guard (a hook raised): run_end will not come, and the allocator
        # would go on recording every allocation's stack for the rest of the process.
        self._stop_recording()

    # ------------------------------------------------------------------ what it measures

    def _readings(self) -> tuple[list[str], torch.Tensor, list[str], torch.Tensor]:
        """CUDA key names and their readings ``[devices, keys]`` (one row per device read),
        host key names and their readings ``[keys]``; float64 on the CPU."""
        rows = []
        for device in self._cuda:
            try:
                row = memory_stats.cuda_memory_readings(device)
            except Exception as exc:
                # A CUDAPluggableAllocator (RMM's, for one) has no statistics: memory_stats and
                # reset_peak_memory_stats raise "does not yet support getDeviceStats". Not a
                # reason to lose the host keys, nor (several ranks) to skip the collective:
                # "not measured" slots, retried at the next logging step.
                self.warn_once(
                    "cuda_stats",
                    f"torch.cuda.memory_stats({device}) raised {type(exc).__name__}: {exc}; "
                    "the CUDA keys are left out while it fails",
                )
                rows.append(dict.fromkeys(memory_stats.CUDA_STATS, math.nan))
                continue
            rows.append(row)
            missing = [f"memory/{k}" for k, v in row.items() if math.isnan(v)]
            if missing:
                # NaN, so the key is left out on every rank: a 0 would be a wrong number.
                self.warn_once(
                    "cuda_missing",
                    f"torch.cuda.memory_stats({device}) has no {', '.join(missing)} (an older "
                    "torch, the cudaMallocAsync backend, which counts allocated, active and "
                    "reserved bytes only, another allocator, or an allocator not initialised "
                    "yet): left out",
                )
            if self.peak_since_last_log:
                torch.cuda.reset_peak_memory_stats(device)
        host_names = list(memory_stats.HOST_KEYS) if self.host else []
        host = [math.nan] * len(host_names)  # not measured: left out on every rank
        if host_names:
            try:
                reading = memory_stats.host_memory_readings(self._process)
                host = [reading[n] for n in host_names]
            except Exception as exc:
                if self._read_host:  # (else warned at run start)
                    self.tolerate_failure(
                        "host_step",
                        "reading the host memory",
                        exc,
                        "memory/rss_gb and memory/peak_rss_gb are left out while it fails",
                    )
        # The CUDA slots are sent even by a rank that reads no CUDA device (zero rows): every
        # rank must send the same layout into the collective, or gloo aborts on the size
        # mismatch (NCCL hangs), and a rank without keys must not skip it.
        cuda_names = list(memory_stats.CUDA_STATS)
        cuda = torch.tensor(
            [[row[n] for n in cuda_names] for row in rows], dtype=torch.float64
        ).reshape(len(rows), len(cuda_names))
        return cuda_names, cuda, host_names, torch.tensor(host, dtype=torch.float64)

    def _read_and_reduce(self) -> dict[str, Any]:
        cuda_names, cuda, host_names, host = self._readings()
        names = cuda_names + host_names
        group = world_group()
        k, devices = len(cuda_names), cuda.shape[0]
        # A rank that reads no CUDA device contributes no device: -inf to the max, +inf to the
        # min, 0 to the sums and the count (NaN would mean "could not read it": left out on
        # every rank). A device's NaN makes the rank's max NaN: "not measured here".
        top = cuda.amax(0) if devices else cuda.new_full((k,), -math.inf)
        bottom = cuda.amin(0) if devices else cuda.new_full((k,), math.inf)
        reduced: dict[str, torch.Tensor] = {}
        # A CUDA key is reduced over every device of every rank (a process may compute on
        # several: device_map="auto"), a host key over the ranks.
        if self.reduce == ("max",):
            # (the last slot: 1 where a rank reads no CUDA device)
            local = torch.cat([top, host, host.new_full((1,), float(devices == 0))])
            out = all_reduce_coalesced([local], "max", group)[0]
            reduced["max"] = out[:-1]
            some_none = bool(out[-1] > 0)
            readers = not bool(torch.isneginf(out[:k]).all())
        else:
            # Per rank: the devices' max, min, sum and count, then the host readings; the
            # mean over devices is the sum of the sums over the sum of the counts (ranks may
            # read different numbers of devices, none included).
            count = cuda.new_full((1,), devices)
            local = torch.cat([top, bottom, cuda.sum(0), count, host])
            rows = all_gather_coalesced([local], group)[0]  # [ranks, 3k + 1 + h]
            hosts = rows[:, 3 * k + 1 :]
            counts = rows[:, 3 * k]
            some_none, readers = bool((counts == 0).any()), bool(counts.sum() > 0)
            mean = rows[:, 2 * k : 3 * k].sum(0) / counts.sum().clamp(min=1)
            reduced["max"] = torch.cat([rows[:, :k].amax(0), hosts.amax(0)])
            reduced["min"] = torch.cat([rows[:, k : 2 * k].amin(0), hosts.amin(0)])
            reduced["mean"] = torch.cat([mean, hosts.mean(0)])
        mine = torch.cat([top, host])
        if not readers:  # no rank reads a CUDA device: no CUDA key
            names, mine = host_names, mine[k:]
            reduced = {kind: values[k:] for kind, values in reduced.items()}
        elif some_none:
            self.warn_once(
                "cuda_some_ranks",
                "a rank reads no CUDA device (CUDA not available or not initialised there, or "
                "its model on the CPU): the CUDA keys cover the devices of the ranks that do",
            )
        # host values: the readings and the collective's result are on the CPU
        values = {kind: reduced[kind].tolist() for kind in self.reduce}
        # A key some other rank could not read is left out here too; only that rank warned,
        # so say it in this rank's log (rank 0's is the one read) rather than drop it silently.
        others = [
            n
            for n, m, r in zip(names, mine.tolist(), values[self.reduce[0]], strict=True)
            if math.isnan(r) and not math.isnan(m)
        ]
        if others:
            self.warn_once(
                "peer_missing",
                f"{', '.join(f'memory/{n}' for n in others)} left out: another rank could not "
                "read it (that rank's log says why)",
            )
        out: dict[str, Any] = {}
        for kind in self.reduce:
            suffix = "" if kind == "max" else f"/{kind}"
            for name, value in zip(names, values[kind], strict=True):
                if not math.isnan(value):  # NaN: some rank could not read it this step
                    out[f"memory/{name}{suffix}"] = value
        return out

    def _dump_snapshot(self, ctx: RunContext, suffix: str) -> None:
        if not self._recording:
            self.warn_once(
                "nohistory",
                "snapshot without record_history=True: it holds the live blocks only, no "
                "history and no stacks",
            )
        folder = self.snapshot_dir or Path(ctx.run_dir) / "memory_snapshots"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{ctx.global_rank}_{suffix}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.snapshots.append(path)

    def _stop_recording(self) -> None:
        if self._recording:
            self._recording = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:  # never let telemetry end a run at its end
                warnings.warn(f"MemoryMonitor: could not stop memory history: {exc}", stacklevel=2)


def _run_cuda_devices(ctx: RunContext) -> tuple[torch.device, ...]:
    """The CUDA devices this process computes on, in index order: the one
    :func:`_run_cuda_device` chooses and every other CUDA device holding a parameter or
    buffer of the model (a model spread over several GPUs of one process, as Hugging Face's
    ``device_map="auto"`` does); ``()`` without CUDA. Decided once, at run start."""
    first = _run_cuda_device(ctx)
    if first is None:
        return ()
    indices = {_index(first)}
    if ctx.model is not None:
        for tensor in itertools.chain(ctx.model.parameters(), ctx.model.buffers()):
            if tensor.device.type == "cuda":
                indices.add(_index(tensor.device))
    return tuple(torch.device("cuda", i) for i in sorted(indices))


def _index(device: torch.device) -> int:
    """A CUDA device's index (``cuda`` alone is the current device)."""
    return torch.cuda.current_device() if device.index is None else device.index


def _run_cuda_device(ctx: RunContext) -> torch.device | None:
    """The CUDA device this process computes on, or ``None`` (see :class:`MemoryMonitor`).

    Not only the first parameter's device: under FSDP2 with ``CPUOffloadPolicy`` every
    parameter lives on the CPU between steps while the forward and backward run on CUDA, and a
    model may keep an embedding table (its first parameter) on the CPU."""
    if not torch.cuda.is_available():
        return None
    root = _declared_device(ctx)
    for device in (root, ctx.device):
        if isinstance(device, torch.device) and device.type == "cuda":
            return device
    if ctx.model is not None:
        for tensor in itertools.chain(ctx.model.parameters(), ctx.model.buffers()):
            if tensor.device.type == "cuda":
                return tensor.device
            # A DTensor sharded over a CUDA mesh whose local shard is offloaded to the CPU
            # (FSDP2's CPUOffloadPolicy): it computes on the process's current CUDA device.
            mesh = getattr(tensor, "device_mesh", None)
            if getattr(mesh, "device_type", None) == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
    if root is not None:
        # The framework says where the run computes, and it is not CUDA (Lightning's
        # accelerator="cpu", Accelerator(cpu=True)), nor does the model hold a tensor there:
        # CUDA initialised by other code of the process (another model, a library) is not
        # this run's memory.
        return None
    if torch.cuda.is_initialized():
        # No tensor of the model on CUDA at run start, but the process uses CUDA (a model
        # moved there per layer by the loop, an offloading wrapper): its current device.
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _declared_device(ctx: RunContext) -> torch.device | None:
    """The device the run's framework says it computes on: under Lightning the strategy's
    ``root_device``; under the driver with an ``accelerator`` that Accelerator's ``device``;
    ``None`` for a plain loop, or when it cannot be told."""
    if ctx.trainer is not None:
        try:
            root = ctx.trainer.strategy.root_device
        except Exception:  # a strategy not set up yet, or not Lightning's
            return None
        return root if isinstance(root, torch.device) else None
    device = getattr(ctx.accelerator, "device", None)  # (the driver's Accelerator)
    return device if isinstance(device, torch.device) else None
