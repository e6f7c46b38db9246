"""MemoryMonitor: host RSS on CPU, CUDA allocator path (against the real torch API names, with
the device faked), reductions over ranks in one collective, snapshots, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import NullWriter, fake_loop
from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.distributed import collective_counter
from trainvitals.stats import memory as memory_stats


def test_cpu_rss_on_logging_steps_only():
    before = psutil.Process().memory_info().rss / 1e9
    writer, _ = fake_loop([MemoryMonitor()], None, steps=range(5), log_every=2)
    after = psutil.Process().memory_info().rss / 1e9
    assert sorted(writer.rows) == [0, 2, 4]
    for row in writer.rows.values():
        assert set(row) == {"memory/rss_gb", "memory/peak_rss_gb"}
        # The RSS read during the run lies between what we read around it (allowing for the
        # allocator returning a little memory to the OS meanwhile).
        assert 0.9 * min(before, after) <= row["memory/rss_gb"] <= 1.1 * max(before, after)
        assert row["memory/peak_rss_gb"] >= row["memory/rss_gb"]


def test_host_readings_against_os():
    import resource

    readings = memory_stats.host_memory_readings()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    assert readings["peak_rss_gb"] == pytest.approx(max(peak, readings["rss_gb"]), rel=0.05)


_FAKE_STATS = {
    "allocated_bytes.all.current": 3_000_000_000,
    "active_bytes.all.current": 3_500_000_000,
    "inactive_split_bytes.all.current": 250_000_000,
    "reserved_bytes.all.current": 8_000_000_000,
    "allocated_bytes.all.peak": 6_000_000_000,
    "active_bytes.all.peak": 6_500_000_000,
    "inactive_split_bytes.all.peak": 750_000_000,
    "reserved_bytes.all.peak": 9_000_000_000,
    "num_alloc_retries": 7,
    "num_ooms": 1,
}


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """Pretend the model is on cuda:0; record calls into the real torch API names (raising=True
    makes the test fail if one of them does not exist in this torch)."""
    import inspect

    # The calls MemoryMonitor makes bind to the real signatures of this torch.
    inspect.signature(torch.cuda.memory._record_memory_history).bind(enabled="all", max_entries=1)
    inspect.signature(torch.cuda.memory._record_memory_history).bind(enabled=None)
    inspect.signature(torch.cuda.memory._dump_snapshot).bind("file.pickle")
    inspect.signature(torch.cuda.memory_stats).bind(torch.device("cuda", 0))
    calls: dict[str, list] = {"record": [], "dump": [], "reset": []}
    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(_FAKE_STATS))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: calls["reset"].append(device)
    )
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda enabled="all", **kw: calls["record"].append((enabled, kw)),
    )
    monkeypatch.setattr(
        torch.cuda.memory, "_dump_snapshot", lambda filename="x": calls["dump"].append(filename)
    )
    return calls


def test_cuda_allocator_statistics_in_gb(fake_cuda):
    writer, _ = fake_loop([MemoryMonitor(host=False)], None, steps=range(3), log_every=2)
    row = writer.rows[2]
    for key, (stat, is_bytes) in memory_stats.CUDA_STATS.items():
        expected = _FAKE_STATS[stat] / 1e9 if is_bytes else _FAKE_STATS[stat]
        assert row[f"memory/{key}"] == pytest.approx(expected, rel=1e-15)
    assert row["memory/reserved_gb"] == 8.0
    assert row["memory/alloc_retries"] == 7
    assert fake_cuda["reset"] == []  # peaks since start by default


def test_cuda_history_and_snapshots(fake_cuda, tmp_path):
    monitor = MemoryMonitor(
        record_history=True, max_history_entries=1234, snapshot_steps=[1, 3], snapshot_dir=tmp_path
    )
    fake_loop([monitor], None, steps=range(5))
    assert fake_cuda["record"][0] == ("all", {"max_entries": 1234})
    assert fake_cuda["record"][-1][0] is None  # stopped at run end
    assert fake_cuda["dump"] == [
        str(tmp_path / "rank0_step1.pickle"),
        str(tmp_path / "rank0_step3.pickle"),
    ]


def test_peak_since_last_log_resets_peaks(fake_cuda):
    fake_loop([MemoryMonitor(peak_since_last_log=True)], None, steps=range(4), log_every=2)
    assert len(fake_cuda["reset"]) == 2  # steps 0 and 2


def test_history_on_cpu_warns_and_does_nothing(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("must not be called on CPU")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", boom)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", boom)
    with pytest.warns(RuntimeWarning, match="need a CUDA device"):
        writer, _ = fake_loop(
            [MemoryMonitor(record_history=True, snapshot_steps=[0])], None, steps=range(2)
        )
    assert "memory/rss_gb" in writer.rows[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reduce": ("median",)},
        {"reduce": ()},
        {"reduce": "avg"},
        {"snapshot_steps": [-1]},
        {"max_history_entries": 0},
        {"log_every_n_steps": 0},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    # the error names the bad argument (not a ValueError from elsewhere in the constructor)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MemoryMonitor(**kwargs)


# ---------------------------------------------------------------------------- multi-rank


def _ranks_body(rank: int, world_size: int, reduce: tuple[str, ...]) -> dict:
    # Rank-dependent readings, so the reductions can be checked exactly.
    memory_stats.host_memory_readings = lambda process=None: {
        "rss_gb": 1.0 + rank,
        "peak_rss_gb": 10.0 - 2 * rank,
    }
    counts: list[tuple[int, int]] = []
    base = (collective_counter["all_reduce"], collective_counter["all_gather"])
    writer, _ = fake_loop(
        [MemoryMonitor(reduce=reduce)],
        None,
        steps=range(4),
        log_every=2,
        on_step=lambda s: counts.append(
            (collective_counter["all_reduce"] - base[0], collective_counter["all_gather"] - base[1])
        ),
    )
    return {"rows": writer.rows, "counts": counts}


@pytest.mark.timeout(180)
def test_three_ranks_max_min_mean_in_one_collective():
    world = 3
    results = run_distributed(_ranks_body, world_size=world, args=(("max", "min", "mean"),))
    rss = [1.0 + r for r in range(world)]
    peak = [10.0 - 2 * r for r in range(world)]
    for result in results:
        row = result["rows"][2]
        assert row["memory/rss_gb"] == max(rss)
        assert row["memory/rss_gb/min"] == min(rss)
        assert row["memory/rss_gb/mean"] == pytest.approx(sum(rss) / world)
        assert row["memory/peak_rss_gb"] == max(peak)
        assert row["memory/peak_rss_gb/min"] == min(peak)
        assert row["memory/peak_rss_gb/mean"] == pytest.approx(sum(peak) / world)
        # one all-gather per logging step (0 and 2), nothing else
        assert result["counts"] == [(0, 1), (0, 1), (0, 2), (0, 2)]


@pytest.mark.timeout(180)
def test_two_ranks_max_only_is_one_all_reduce():
    results = run_distributed(_ranks_body, world_size=2, args=(("max",),))
    for result in results:
        row = result["rows"][0]
        assert row == {"memory/rss_gb": 2.0, "memory/peak_rss_gb": 10.0}
        assert result["counts"] == [(1, 0), (1, 0), (2, 0), (2, 0)]


def test_exception_dumps_a_snapshot_when_recording(fake_cuda, tmp_path):
    from trainvitals.adapters.loop import Vitals

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = MemoryMonitor(record_history=True, snapshot_dir=tmp_path)
    with (
        pytest.raises(RuntimeError, match="CUDA out of memory"),
        Vitals([monitor], writer=NullWriter()) as vitals,
    ):
        vitals.attach(model, opt)
        vitals.batch(torch.randn(2, 3))
        raise RuntimeError("CUDA out of memory (simulated)")
    assert fake_cuda["dump"] == [str(tmp_path / "rank0_exception.pickle")]
    assert fake_cuda["record"][-1][0] is None  # recording stopped


def test_cpu_without_host_readings_warns_that_nothing_is_written():
    with pytest.warns(RuntimeWarning, match="nothing to measure"):
        writer, _ = fake_loop([MemoryMonitor(host=False)], None, steps=range(2))
    assert all(not row for row in writer.rows.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux exec semantics")
def test_peak_rss_of_a_launched_worker_is_its_own_not_its_launchers():
    # A launcher peaks at >= 1 GB, frees it, then starts a worker by fork+exec (as subprocess,
    # torch.multiprocessing "spawn" and Lightning's launcher do). Linux carries ru_maxrss over
    # exec, so reading it gave the worker the launcher's peak.
    worker = (
        "import json; from trainvitals.stats.memory import host_memory_readings as h; "
        "print(json.dumps(h()))"
    )
    launcher = (
        "import resource, subprocess, sys\n"
        "big = bytearray(1 << 30)\n"
        "for i in range(0, len(big), 4096): big[i] = 1\n"
        "del big\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)\n"
        f"subprocess.run([sys.executable, '-c', {worker!r}], check=True)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", launcher], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    launcher_peak = float(out[0])
    readings = json.loads(out[1])
    # The worker never held more than its imports (torch: ~0.25 GB) beyond its final RSS.
    assert launcher_peak >= readings["rss_gb"] + 0.75  # the test can tell them apart
    assert readings["rss_gb"] <= readings["peak_rss_gb"] <= readings["rss_gb"] + 0.5


def test_snapshot_steps_under_manual_optimization_with_two_optimizers(fake_cuda, tmp_path):
    # A GAN-style training_step steps two optimizers: every batch advances trainer.global_step
    # by 2, and step_end comes once per batch. An odd snapshot step ends with its batch too.
    pl = pytest.importorskip("lightning.pytorch")

    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a = torch.nn.Linear(3, 1)
            self.b = torch.nn.Linear(3, 1)
            self.dumped_at: dict[int, int] = {}  # global_step -> dumps before that step

        def training_step(self, batch, batch_idx):
            for opt, layer in zip(self.optimizers(), (self.a, self.b), strict=True):
                self.dumped_at[self.trainer.global_step] = len(fake_cuda["dump"])
                opt.zero_grad()
                self.manual_backward(layer(batch[0]).pow(2).mean())
                opt.step()

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.a.parameters(), lr=0.1),
                torch.optim.SGD(self.b.parameters(), lr=0.1),
            )

    module = TwoOptimizers()
    data = torch.utils.data.TensorDataset(torch.randn(12, 3))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[
            MemoryMonitor(snapshot_steps=[1, 2], snapshot_dir=tmp_path, writer=NullWriter())
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(RuntimeWarning, match="without record_history"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 6
    assert fake_cuda["dump"] == [
        str(tmp_path / "rank0_step1.pickle"),
        str(tmp_path / "rank0_step2.pickle"),
    ]
    # each after the end of its step: step 1 ends with batch 0, step 2 with batch 1
    assert module.dumped_at[2] == 1 and module.dumped_at[4] == 2


# ------------------------------------------------------------------ psutil missing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_without_psutil_the_host_keys_come_from_proc(monkeypatch):
    # psutil is a dependency, but an install with --no-deps lacks it: `import psutil` fails.
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(ImportError):
        import psutil as _
    writer, _ = fake_loop([MemoryMonitor()], None, steps=range(3), log_every=2)
    monkeypatch.undo()
    rss = psutil.Process().memory_info().rss / 1e9  # psutil's own reading, after the run
    assert sorted(writer.rows) == [0, 2]
    for row in writer.rows.values():
        assert set(row) == {"memory/rss_gb", "memory/peak_rss_gb"}
        assert row["memory/rss_gb"] == pytest.approx(rss, rel=0.1)
        assert row["memory/rss_gb"] <= row["memory/peak_rss_gb"]
    # the /proc reading itself against psutil's taken right after it: the 10 % above (RSS
    # moves during a run) would let a unit slip such as GiB for GB (7 %) through
    monkeypatch.setitem(sys.modules, "psutil", None)
    got = memory_stats.host_memory_readings()
    monkeypatch.undo()
    assert got["rss_gb"] == pytest.approx(psutil.Process().memory_info().rss / 1e9, rel=1e-3)


def test_without_psutil_nor_proc_the_cuda_keys_are_still_written(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(memory_stats, "_proc_status_bytes", lambda pid, field: None)
    with pytest.warns(RuntimeWarning, match="cannot read the host memory.*psutil"):
        writer, _ = fake_loop([MemoryMonitor()], None, steps=range(3), log_every=2)
    assert sorted(writer.rows) == [0, 2]
    expected = {f"memory/{key}" for key in memory_stats.CUDA_STATS}
    for row in writer.rows.values():
        assert set(row) == expected
        assert row["memory/reserved_gb"] == _FAKE_STATS["reserved_bytes.all.current"] / 1e9
