"""Gloo ranks shared by the distributed cases of one test file.

Starting gloo processes costs more than most cases (about 2 s for 2 ranks, 4 s for 4): each
test registers its case with ``ranks.on_ranks(...)``, and the module-scoped ``case_runs``
fixture runs the selected cases of one world size in turn on the same processes, each in a
folder of its own and with the state a fresh process would give it (environment, warning
filters, RNG state, thread count and DTensor's sharding caches are put back; a global hook, an
open writer or a claimed tensor-stats file left behind fails the case). A failing or hanging
case fails its own test alone: the other cases run again on fresh ranks.

Use, in a test module::

    from tests.helpers.shared_ranks import CASE_DIR, SharedRanks

    ranks = SharedRanks(__name__)
    case_runs, ran = ranks.fixtures()

    @ranks.on_ranks(2, _body, CASE_DIR)
    def test_something(ran):
        run_dir, results = ran   # the case's folder, body(rank, world_size, run_dir) by rank

A parametrized test registers one case per parameter set, each under its test id::

    @ranks.on_ranks(2, _body, "dp", param="dp")
    @ranks.on_ranks(4, _body, "pp", param="pp")
    @pytest.mark.parametrize("where", ["dp", "pp"])
    def test_where(where, ran): ...
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed

CASE_DIR = object()  # stands, in a case's args, for the case's own folder


@dataclass(frozen=True)
class Case:
    world_size: int
    body: Callable[..., dict]
    args: tuple
    needs: str | None = None  # a package the case cannot run without (its test is skipped)


class SharedRanks:
    """The registered cases of one test module (``module``: its ``__name__``, by which the
    spawned ranks import it to find them)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.cases: dict[str, Case] = {}  # test function name -> its case, in file order

    def on_ranks(
        self,
        world_size: int,
        body: Callable[..., dict],
        *args: Any,
        needs: str | None = None,
        param: str | None = None,
    ) -> Callable[[Callable], Callable]:
        """Register the decorated test's case: ``body(rank, world_size, *args)``, with
        ``CASE_DIR`` in ``args`` replaced by the case's folder, on the shared ranks of
        ``world_size``; with ``param``, the case of the parametrized test whose id is
        ``param`` (``test_name[param]``)."""

        def register(test: Callable) -> Callable:
            name = test.__name__ if param is None else f"{test.__name__}[{param}]"
            self.cases[name] = Case(world_size, body, args, needs)
            return test

        return register

    def fixtures(self) -> tuple[Any, Any]:
        """The module-scoped ``case_runs`` fixture and the per-test ``ran`` fixture, to be
        bound to those names in the test module."""

        @pytest.fixture(scope="module")
        def case_runs(request, tmp_path_factory) -> dict[str, tuple[Path, list[dict]] | str]:
            """Each selected test's case: its folder and its results by rank, or why it failed.
            One ``run_distributed`` per world size runs its cases in turn; when a case fails,
            the ranks stop there and the other cases run again without it."""
            selected = {
                name
                for item in request.session.items
                if getattr(item, "module", None) is request.module
                for name in (item.name, item.originalname)
            }
            groups: dict[int, list[str]] = {}
            for name, case in self.cases.items():
                if name in selected and (
                    case.needs is None or importlib.util.find_spec(case.needs)
                ):
                    groups.setdefault(case.world_size, []).append(name)
            out: dict[str, tuple[Path, list[dict]] | str] = {}
            for world, todo in groups.items():
                while todo:
                    root = tmp_path_factory.mktemp(f"ranks{world}_")
                    for name in todo:
                        (root / name).mkdir()
                    try:
                        ranks = run_distributed(
                            _run_cases, world, args=(self.module, str(root), todo), timeout=240
                        )
                    except (AssertionError, TimeoutError) as e:
                        # the failing rank's error names its case; a hang, the case a rank is in
                        named = re.search(r"case '([^']+)' failed", str(e))
                        running = {p.read_text() for p in root.glob("running.rank*")}
                        hung = [n for n in todo if n in running]
                        failed = [named[1]] if named and named[1] in todo else hung[:1] or todo
                        out |= {n: f"case {n!r} failed on its ranks: {e}" for n in failed}
                        todo = [n for n in todo if n not in failed]
                    else:
                        out |= {name: (root / name, [r[name] for r in ranks]) for name in todo}
                        todo = []
            return out

        @pytest.fixture
        def ran(request, case_runs) -> tuple[Path, list[dict]]:
            """This test's case: its folder and its results by rank."""
            key = request.node.name
            if key not in self.cases:
                key = request.node.originalname
            case = self.cases[key]
            if case.needs is not None:
                pytest.importorskip(case.needs)
            result = case_runs[key]
            if isinstance(result, str):
                pytest.fail(result, pytrace=False)
            return result

        return case_runs, ran


def _left_behind() -> list[str]:
    """What a finished case left in its process that a later case could run into."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    from trainvitals.adapters import fanout_writer
    from trainvitals.callbacks import tensor_stats_monitor

    gc.collect()
    hooks = {
        "module forward pre-hook": module._global_forward_pre_hooks,
        "module forward hook": module._global_forward_hooks,
        "module backward pre-hook": module._global_backward_pre_hooks,
        "module backward hook": module._global_backward_hooks,
        "optimizer pre-hook": optimizer._global_optimizer_pre_hooks,
        "optimizer post-hook": optimizer._global_optimizer_post_hooks,
    }
    left = [f"a global {what}" for what, registered in hooks.items() if registered]
    if len(fanout_writer._live_writers):
        left.append("an open writer")
    if any(ref() is not None for ref in tensor_stats_monitor._CLAIMS.values()):
        left.append("a claimed tensor-stats file")
    return left


def _run_cases(
    rank: int, world_size: int, module: str, root: str, names: list[str]
) -> dict[str, dict]:
    """Each case of ``names`` (registered in test module ``module``) in turn on this rank, in
    its folder ``root/<name>``."""
    shared = next(
        v for v in vars(importlib.import_module(module)).values() if isinstance(v, SharedRanks)
    )
    rng, threads, env = torch.get_rng_state(), torch.get_num_threads(), dict(os.environ)
    out = {}
    for name in names:
        (Path(root) / f"running.rank{rank}").write_text(name)  # names the case of a hang
        case = shared.cases[name]
        args = tuple(str(Path(root) / name) if a is CASE_DIR else a for a in case.args)
        torch.set_rng_state(rng)
        try:
            with warnings.catch_warnings():
                out[name] = case.body(rank, world_size, *args)
            if left := _left_behind():
                raise RuntimeError(f"the case left {', '.join(left)} behind")
        except Exception as e:
            raise RuntimeError(f"case {name!r} failed") from e
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
            # DTensor's sharding propagation caches key on meshes compared by value: a later
            # case's equal mesh would get DTensors on this case's mesh and groups (other group
            # objects for the same ranks, one more collective where the monitor merges). No
            # DTensor ran unless its module was imported (importing it costs ~1 s per rank).
            if "torch.distributed.tensor" in sys.modules:
                from torch.distributed.tensor.debug import _clear_sharding_prop_cache

                _clear_sharding_prop_cache()
    return out
