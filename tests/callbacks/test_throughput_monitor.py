"""ThroughputMonitor: exact rates from a fake clock, measured global sums, flops/MFU, resume."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import (
    FakeClock,
    RecordingWriter,
    batch_size,
    dt,
    fake_loop,
    manual_optimization_module,
    quiet_trainer,
)
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor
from trainvitals.distributed import collective_counter

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

SEQ = 5


_dt = dt  # seconds the fake clock moves during a micro-batch of fake_loop
_bs = batch_size  # samples of a micro-batch of fake_loop


def _loop(
    monitor: ThroughputMonitor,
    clock: FakeClock,
    *,
    counts_per_step: list | None = None,
    **loop_args: Any,
) -> tuple[RecordingWriter, Vitals]:
    """:func:`fake_loop` with the monitor alone (sequences of ``SEQ`` tokens), optionally
    recording the all-reduce count after every optimizer step."""
    on_step = None
    if counts_per_step is not None:

        def on_step(step: int) -> None:
            counts_per_step.append(collective_counter["all_reduce"])

    return fake_loop([monitor], clock, seq=SEQ, on_step=on_step, **loop_args)


def _plain_steps(vitals: Vitals, forward: Any, opt: Any, clock: FakeClock, sizes, features):
    """One optimizer step per float batch of ``sizes`` samples (tokens unknown), 1 s each."""
    for b in sizes:
        x = torch.randn(b, features)
        vitals.batch(x)
        clock.t += 1.0
        forward(x).sum().backward()
        opt.step()
        opt.zero_grad()


def _expected(step: int, *, window: int, warmup: int, acc: int = 2, ranks=(0,)) -> dict:
    """Independent computation of the window's rates at logging step ``step``."""
    first = max(warmup, step - window + 1)
    in_window = list(range(first, step + 1))
    seconds = sum(_dt(s, mb) for s in in_window for mb in range(acc))
    samples = {r: sum(_bs(s, mb, r) for s in in_window for mb in range(acc)) for r in ranks}
    return {
        "seconds": seconds,
        "steps": len(in_window),
        "device_samples_per_sec": samples[ranks[0]] / seconds,
        "samples_per_sec": sum(samples.values()) / seconds,
        "tokens_per_sec": SEQ * sum(samples.values()) / seconds,
        "batches_per_sec": acc * len(in_window) * len(ranks) / seconds,
    }


def test_rates_exact_with_accumulation_and_validation_excluded():
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=3, warmup_steps=1, clock=clock)
    writer, _ = _loop(monitor, clock, steps=range(9))
    assert 0 not in writer.rows  # step 0 is warm-up: nothing to report yet
    assert sorted(writer.rows) == [2, 4, 6, 8]  # logging steps only
    for step in (2, 4, 6, 8):
        exp = _expected(step, window=3, warmup=1)
        row = writer.rows[step]
        assert row["throughput/samples_per_sec"] == pytest.approx(exp["samples_per_sec"], rel=1e-12)
        assert row["throughput/device/samples_per_sec"] == pytest.approx(
            exp["device_samples_per_sec"], rel=1e-12
        )
        assert row["throughput/tokens_per_sec"] == pytest.approx(exp["tokens_per_sec"], rel=1e-12)
        assert row["throughput/batches_per_sec"] == pytest.approx(exp["batches_per_sec"], rel=1e-12)
        assert row["throughput/seconds_per_step"] == pytest.approx(
            exp["seconds"] / exp["steps"], rel=1e-12
        )
        assert "throughput/mfu" not in row  # CPU, no peak given
        assert "throughput/flops_per_sec" not in row  # no flops given


def test_warmup_zero_reports_step_zero():
    clock = FakeClock()
    writer, _ = _loop(
        ThroughputMonitor(window_size=4, warmup_steps=0, clock=clock), clock, steps=range(3)
    )
    exp = _expected(0, window=4, warmup=0)
    assert writer.rows[0]["throughput/samples_per_sec"] == pytest.approx(exp["samples_per_sec"])


def test_flops_given_mfu_and_device_mfu():
    clock = FakeClock()
    fpt, peak = 1234.0, 1e6
    monitor = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=fpt, peak_flops=peak)
    writer, _ = _loop(monitor, clock, steps=range(5))
    exp = _expected(4, window=2, warmup=1)
    row = writer.rows[4]
    assert row["throughput/flops_per_sec"] == pytest.approx(fpt * exp["tokens_per_sec"])
    assert row["throughput/device/flops_per_sec"] == pytest.approx(fpt * exp["tokens_per_sec"])
    assert row["throughput/mfu"] == pytest.approx(fpt * exp["tokens_per_sec"] / peak)
    assert row["throughput/device/mfu"] == pytest.approx(fpt * exp["tokens_per_sec"] / peak)


def test_measured_flops_match_analytic_count():
    # Linear(8,16) -> ReLU -> Linear(16,4), batch B, input without grad:
    # forward 2B(8*16 + 16*4); backward: layer 2 grad input and grad weight 2 * 2B*16*4,
    # layer 1 grad weight only 2B*8*16. Per sample: 2*(128 + 64 + 128 + 128) = 896.
    per_sample = 2 * (8 * 16 + 16 * 4) + 2 * 2 * 16 * 4 + 2 * 8 * 16
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True, log_every_n_steps=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer).attach(model, opt)
    batch_sizes = [6, 3, 5, 4]
    _plain_steps(vitals, model, opt, clock, batch_sizes, 8)  # samples known, tokens unknown
    vitals.close()
    assert monitor.state_dict()["measured"] == ["samples", pytest.approx(per_sample)]
    row = writer.rows[3]
    assert row["throughput/device/flops_per_sec"] == pytest.approx(per_sample * (5 + 4) / 2.0)
    assert "throughput/tokens_per_sec" not in row  # tokens unknown: no rate, no wrong number
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None  # the counting mode was left


def test_measured_zero_flops_write_no_flops_or_mfu():
    """A model whose work FlopCounterMode does not see (element-wise only here; custom kernels
    in practice) measures 0 flops: no FLOP/s or MFU is written rather than 0."""
    from trainvitals.stats.flops import measure_flops

    scale = torch.nn.Parameter(torch.ones(3))

    def forward(x):
        return (x * scale).tanh()

    assert measure_flops(lambda: forward(torch.randn(4, 3)).sum().backward()) == 0
    clock = FakeClock()
    monitor = ThroughputMonitor(
        window_size=2, clock=clock, measure_flops=True, peak_flops=1e12, log_every_n_steps=1
    )
    model = torch.nn.Module()
    model.scale = scale
    opt = torch.optim.SGD([scale], lr=0.01)
    writer = RecordingWriter()
    with pytest.warns(RuntimeWarning, match="no flops"):
        vitals = Vitals([monitor], writer=writer).attach(model, opt)
        _plain_steps(vitals, forward, opt, clock, [4, 4, 4], 3)
        vitals.close()
    row = writer.rows[2]
    assert row["throughput/samples_per_sec"] == pytest.approx(4.0)
    assert not any("flops" in key or "mfu" in key for key in row)


@pytest.mark.parametrize("kind", ["throughput", "runtime"])
def test_cuda_sync_only_on_logging_steps(monkeypatch, kind):
    from trainvitals.callbacks.runtime_monitor import RuntimeMonitor

    syncs: list[int] = []
    clock = FakeClock()
    if kind == "throughput":
        monitor = ThroughputMonitor(window_size=4, clock=clock, log_every_n_steps=3)
    else:
        monitor = RuntimeMonitor(clock=clock, log_every_n_steps=3, max_steps=10)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals([monitor], writer=RecordingWriter()).attach(model, opt)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(vitals.step))
    for step in range(7):
        vitals.batch(torch.randn(2, 3))
        if step == 0:  # pretend the model is on a GPU: what run_start sets on CUDA
            monitor._clock.sync_fn = lambda: torch.cuda.synchronize(torch.device("cuda", 0))
        clock.t += 1.0
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        if step == 4:
            with vitals.validating():  # validation boundaries sync (outside training steps)
                syncs.append("val")
    assert syncs == [0, 3, 5, "val", 5, 6]


def test_resume_continues_window_exactly():
    def make():
        return ThroughputMonitor(window_size=5, warmup_steps=0, clock=clock)

    clock = FakeClock()
    full, _ = _loop(make(), clock, steps=range(16))
    clock = FakeClock()
    _, first = _loop(make(), clock, steps=range(10))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # plain data only
    clock = FakeClock()
    resumed, vitals = _loop(make(), clock, steps=range(10, 16), state=state)
    assert vitals.step == 16
    for step in (10, 12, 14):
        for key, value in full.rows[step].items():
            assert resumed.rows[step][key] == pytest.approx(value, rel=1e-12), (step, key)
    totals = vitals.callbacks[0].state_dict()["totals"]
    assert totals["steps"] == 16
    assert totals["samples"] == sum(_bs(s, mb) for s in range(16) for mb in range(2))


def test_restore_into_a_used_instance_restarts_clock_and_warmup():
    """A rollback (load_state_dict on the instance that kept training) times the next steps on
    their own: the time before the restore is not charged to the first step after it."""
    window = 5
    clock = FakeClock()
    _, saved = _loop(ThroughputMonitor(window_size=window, clock=clock), clock, steps=range(10))
    state = saved.state_dict()
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=window, clock=clock)
    _loop(monitor, clock, steps=range(13))  # trained past the checkpoint ...
    clock.t += 500.0  # ... then spent time reloading
    writer, _ = _loop(monitor, clock, steps=range(10, 16), state=state)
    for step in (10, 12, 14):
        # restored steps 1..9 of the first run, then 11..step (10 is the restart's warm-up)
        in_window = [*range(1, 10), *range(11, step + 1)][-window:]
        seconds = sum(_dt(s, mb) for s in in_window for mb in range(2))
        samples = sum(_bs(s, mb) for s in in_window for mb in range(2))
        row = writer.rows[step]
        assert row["throughput/seconds_per_step"] == pytest.approx(seconds / window, rel=1e-12)
        assert row["throughput/samples_per_sec"] == pytest.approx(samples / seconds, rel=1e-12)


def test_restore_mid_step_drops_the_abandoned_micro_batches():
    # a rollback while a step is in progress replays that step: the micro-batches counted
    # for it before the restore must not be added to the replayed one
    clock = FakeClock()
    writer = RecordingWriter()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = ThroughputMonitor(window_size=1, warmup_steps=0, clock=clock)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)

    def micro_batch(n: int) -> None:
        x = torch.randn(n, 3)
        vitals.batch(x)
        clock.t += 1.0
        model(x).sum().backward()

    for n in (4, 3):
        micro_batch(n)
    opt.step()
    opt.zero_grad()
    state = vitals.state_dict()
    micro_batch(5)  # abandoned
    vitals.load_state_dict(state)
    for n in (2, 6):
        micro_batch(n)
    opt.step()
    vitals.close()
    row = writer.rows[1]
    assert row["throughput/samples_per_sec"] == pytest.approx((2 + 6) / 2.0, rel=1e-12)
    assert row["throughput/batches_per_sec"] == pytest.approx(2 / 2.0, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_size": 0},
        {"window_size": -3},
        {"warmup_steps": -1},
        {"log_every_n_steps": 0},
        {"precision": "bf17"},
        {"flops_per_token": -1.0},
        {"peak_flops": 0},
        {"flops_per_token": 1.0, "flops_per_sample": 2.0},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    # the error names the bad argument (not a ValueError from elsewhere in the constructor)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ThroughputMonitor(**kwargs)


def test_bad_callable_raises_type_error():
    with pytest.raises(TypeError, match="num_tokens_fn"):
        ThroughputMonitor(num_tokens_fn=3)


# ---------------------------------------------------------------------------- multi-rank


def _two_rank_body(rank: int, world_size: int) -> dict:
    clock = FakeClock()
    counts: list[int] = []
    monitor = ThroughputMonitor(window_size=3, clock=clock, flops_per_token=10.0, peak_flops=1e3)
    before = collective_counter["all_reduce"]
    writer, _ = _loop(monitor, clock, steps=range(7), rank=rank, counts_per_step=counts)
    return {"rows": writer.rows, "collectives": [c - before for c in counts]}


@pytest.mark.timeout(180)
@shared.on_ranks(2, _two_rank_body)
def test_two_ranks_global_sums_count_the_bigger_rank(ran):
    _, results = ran
    for rank, result in enumerate(results):
        rows = result["rows"]
        for step in (2, 4, 6):
            exp = _expected(step, window=3, warmup=1, ranks=(rank, 1 - rank))
            row = rows[step]
            # rank 1 has 3 more samples per micro-batch: the global figure is the true sum,
            # not this rank's rate times two.
            assert row["throughput/samples_per_sec"] == pytest.approx(exp["samples_per_sec"])
            assert row["throughput/tokens_per_sec"] == pytest.approx(exp["tokens_per_sec"])
            assert row["throughput/device/samples_per_sec"] == pytest.approx(
                exp["device_samples_per_sec"]
            )
            assert row["throughput/mfu"] == pytest.approx(10.0 * exp["tokens_per_sec"] / (2 * 1e3))
            assert not math.isclose(
                row["throughput/samples_per_sec"], 2 * row["throughput/device/samples_per_sec"]
            )
        # One all-reduce per logging step (0, 2, 4, 6; step 0's window is still empty), none
        # on other steps.
        assert result["collectives"] == [1, 1, 2, 2, 3, 3, 4]


def _peer_failure_body(rank: int, world_size: int) -> dict:
    import os

    os.environ["TRAINVITALS_STRICT"] = "0"
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=100, clock=clock)
    split_sums = monitor._window.split_sums
    now = {"step": 0}

    def failing_split_sums():
        if rank == 1 and now["step"] == 2:  # the first logging step with a window
            raise RuntimeError("boom before the window's sum")
        return split_sums()

    monitor._window.split_sums = failing_split_sums
    writer = RecordingWriter()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning), Vitals([monitor], writer=writer, log_every_n_steps=2) as v:
        v.attach(model, opt)
        for step in range(9):
            now["step"] = step
            x = torch.randn(_bs(step, 0, rank), 3)
            v.batch(x)
            clock.t += _dt(step, 0)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return writer.key("throughput/samples_per_sec")


@pytest.mark.timeout(180)
@shared.on_ranks(2, _peer_failure_body)
def test_a_rank_failing_at_the_first_windowed_logging_step_leaves_later_sums_paired(ran):
    """The failed rank's step_end is completed with the collectives of the last logging
    step_end (step 0's, in warm-up): they must be the same, or every later sum pairs this
    rank's window with the other rank's window of the next logging step."""
    _, results = ran
    for rates in results:
        assert 2 not in rates  # the failed step is left out on every rank
        for step in (4, 6, 8):
            window = range(1, step + 1)
            samples = sum(_bs(s, 0, r) for r in (0, 1) for s in window)
            seconds = sum(_dt(s, 0) for s in window)
            assert rates[step] == pytest.approx(samples / seconds, rel=1e-12), step


def test_token_counts_given_as_tensors():
    """A num_tokens given as a 0-d tensor (e.g. attention_mask.sum() on the device) is summed as
    a tensor and only read on logging steps."""
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(window_size=2, warmup_steps=0, clock=clock, log_every_n_steps=2)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals([monitor], writer=writer).attach(model, opt)
    tokens = [torch.tensor(7), torch.tensor(9), torch.tensor(4)]
    for step, n in enumerate(tokens):
        vitals.batch(torch.randn(2, 3), num_tokens=n)
        clock.t += 0.5 * (step + 1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    vitals.close()
    assert writer.rows[2]["throughput/tokens_per_sec"] == pytest.approx((9 + 4) / (1.0 + 1.5))
    assert monitor.state_dict()["totals"]["tokens"] == 20.0


@pytest.mark.parametrize(
    ("device_name", "chip", "bf16"),
    [
        ("NVIDIA H100 80GB HBM3", "h100 sxm", 989.4e12),
        ("NVIDIA H100 PCIe", "h100 pcie", 756.5e12),
        ("NVIDIA H100 NVL", "h100 nvl", 835.5e12),
        ("NVIDIA H200", "h200 sxm", 989.4e12),
        ("NVIDIA H200 NVL", "h200 nvl", 835.5e12),
        ("NVIDIA GH200 480GB", "h100 sxm", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "a100", 312e12),
        ("NVIDIA L4", "l4", 121e12),
        ("NVIDIA L40S", "l40s", 362.05e12),
        ("NVIDIA B200", "b200", 2.25e15),
        ("NVIDIA L40", None, None),
        ("NVIDIA A10G", None, None),
        # not in the table: no peak rather than a neighbour's (far from theirs)
        ("NVIDIA RTX A1000 6GB Laptop GPU", None, None),
        ("NVIDIA GB200", None, None),
        ("Tesla V100S-PCIE-32GB", None, None),
        ("NVIDIA A100 80GB PCIe", "a100", 312e12),
    ],
)
def test_peak_flops_table_dense_per_gpu(device_name, chip, bf16):
    from trainvitals.stats.flops import chip_name, peak_flops

    assert chip_name(device_name) == chip
    assert peak_flops(device_name, "bf16") == bf16
    # dense figures: half the datasheets' "with sparsity" numbers (H100 SXM: 1979 TFLOPS)
    if chip == "h100 sxm":
        assert peak_flops(device_name, "bf16") == pytest.approx(1979e12 / 2, rel=1e-3)
    with pytest.raises(ValueError, match="precision"):
        peak_flops(device_name, "int3")


def test_mfu_uses_the_table_peak_of_the_cuda_device(monkeypatch):
    import trainvitals.callbacks.throughput_monitor as tm
    from trainvitals.adapters.context import RunContext

    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(tm, "device_name_of", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock = FakeClock()
    writer, _ = _loop(
        ThroughputMonitor(window_size=2, clock=clock, flops_per_token=1e9), clock, steps=range(3)
    )
    exp = _expected(2, window=2, warmup=1)
    assert writer.rows[2]["throughput/mfu"] == pytest.approx(1e9 * exp["tokens_per_sec"] / 989.4e12)


@pytest.mark.parametrize(
    ("name", "precision", "names_precision"),
    [("Tesla V100-SXM2-32GB", "bf16", True), ("NVIDIA RTX A1000", "bf16", False)],
)
def test_missing_peak_warning_names_the_precision_when_the_device_is_known(
    monkeypatch, name, precision, names_precision
):
    import trainvitals.callbacks.throughput_monitor as tm
    from trainvitals.adapters.context import RunContext
    from trainvitals.stats.flops import peak_flops

    assert peak_flops(name, precision) is None  # the case: no peak for this device/precision
    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(tm, "device_name_of", lambda device: name)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock = FakeClock()
    monitor = ThroughputMonitor(
        window_size=2, clock=clock, flops_per_token=1e9, precision=precision
    )
    with pytest.warns(RuntimeWarning, match="no peak FLOP/s") as record:
        writer, _ = _loop(monitor, clock, steps=range(3))
    text = " ".join(str(w.message) for w in record)
    assert (f"precision={precision!r}" in text) is names_precision
    assert "throughput/mfu" not in writer.rows[2]


def _dp_tp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    dp_rank = mesh.get_local_rank("dp")  # tensor-parallel peers share the data of their dp rank
    clock = FakeClock()
    throughput = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=10.0, peak_flops=1e3)
    runtime = RuntimeMonitor(clock=clock, max_steps=10)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    vitals = Vitals([throughput, runtime], writer=writer, groups=groups, log_every_n_steps=2)
    vitals.attach(model, opt)
    before = dict(collective_counter)
    for step in range(3):
        for mb in range(2):
            bs = _bs(step, mb, dp_rank)
            vitals.batch({"input_ids": torch.zeros(bs, SEQ, dtype=torch.long)})
            clock.t += _dt(step, mb)
            model(torch.randn(bs, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    return {
        "rows": writer.rows,
        "all_reduce": collective_counter["all_reduce"] - before.get("all_reduce", 0),
    }


@pytest.mark.timeout(240)
@shared.on_ranks(4, _dp_tp_body)
def test_dp_tp_mesh_counts_tensor_parallel_peers_once(ran):
    _, results = ran
    for result in results:
        row = result["rows"][2]
        exp = _expected(2, window=2, warmup=1, ranks=(0, 1))  # the two dp ranks, not four
        assert row["throughput/samples_per_sec"] == pytest.approx(exp["samples_per_sec"])
        assert row["throughput/tokens_per_sec"] == pytest.approx(exp["tokens_per_sec"])
        # model flops 10/token, split over the 2 tensor-parallel devices of each replica
        assert row["throughput/flops_per_sec"] == pytest.approx(10.0 * exp["tokens_per_sec"])
        assert row["throughput/mfu"] == pytest.approx(10.0 * exp["tokens_per_sec"] / (4 * 1e3))
        true = sum(_bs(s, mb, d) for d in (0, 1) for s in range(3) for mb in range(2))
        assert row["time/samples"] == true
        # logging steps 0 and 2: runtime and throughput 2 x (dp + world) each
        assert result["all_reduce"] == 8


def _tensor_parallel_measured_flops_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = FakeClock()
    monitor = ThroughputMonitor(
        window_size=2, clock=clock, measure_flops=True, peak_flops=1e3, log_every_n_steps=1
    )
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer, groups=ProcessGroups.from_device_mesh(mesh))
    vitals.attach(model, opt)
    torch.manual_seed(1)  # the same batches on both tensor-parallel peers
    _plain_steps(vitals, model, opt, clock, [6, 3, 5], 8)
    vitals.close()
    return {"measured": monitor.state_dict()["measured"], "row": writer.rows[2]}


@pytest.mark.timeout(180)
@shared.on_ranks(2, _tensor_parallel_measured_flops_body)
def test_measured_flops_under_tensor_parallelism_count_each_rank_its_shard(ran):
    """FlopCounterMode counts an op on DTensors at their global shape, so each tensor-parallel
    rank counted the whole model and the global FLOP/s and MFU were tp times too high. Each
    rank's count must be its shard's: here half the model (both layers split in two)."""
    _, results = ran
    # per sample, whole model (as in test_measured_flops_match_analytic_count)
    whole = 2 * (8 * 16 + 16 * 4) + 2 * 2 * 16 * 4 + 2 * 8 * 16
    for result in results:
        assert result["measured"] == ["samples", pytest.approx(whole / 2)]
        row = result["row"]
        # one data stream (steps 1 and 2: 3 + 5 samples in 2 s) through one whole model
        assert row["throughput/flops_per_sec"] == pytest.approx(whole * (3 + 5) / 2.0)
        assert row["throughput/device/flops_per_sec"] == pytest.approx(whole / 2 * (3 + 5) / 2.0)
        assert row["throughput/mfu"] == pytest.approx(whole * (3 + 5) / 2.0 / (2 * 1e3))


@pytest.mark.parametrize(
    ("trainer_precision", "matmul_precision", "peak"),
    [
        ("32-true", "highest", 67e12),  # H100 SXM FP32 (no tensor cores)
        ("32-true", "high", 494.7e12),  # TF32 tensor cores
        ("bf16-mixed", "highest", 989.4e12),
    ],
)
def test_mfu_peak_follows_the_lightning_precision(
    monkeypatch, tmp_path, trainer_precision, matmul_precision, peak
):
    """Without ``precision=``, the peak is the one of the run's precision, as in Lightning's
    ThroughputMonitor: a 32-true run divided by the bf16 peak reported an MFU 15x too low."""
    import lightning.pytorch as pl

    import trainvitals.callbacks.throughput_monitor as tm
    from trainvitals.adapters.context import RunContext

    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(tm, "device_name_of", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    clock = FakeClock()
    writer = RecordingWriter()
    seq, bs, fpt = 4, 2, 1e9

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)

        def training_step(self, batch, batch_idx):
            clock.t += 0.5
            return self.emb(batch["input_ids"]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            data = [{"input_ids": torch.randint(0, 8, (seq,))} for _ in range(4 * bs)]
            return torch.utils.data.DataLoader(data, batch_size=bs)

    monitor = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=fpt, writer=writer)
    trainer = quiet_trainer(
        callbacks=[monitor],
        max_steps=3,
        precision=trainer_precision,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
    )
    try:
        trainer.fit(Tiny())
    finally:
        torch.set_float32_matmul_precision(before)
    tokens_per_sec = bs * seq / 0.5
    assert writer.rows[2]["throughput/mfu"] == pytest.approx(fpt * tokens_per_sec / peak)


def test_measured_flops_count_every_optimizer_of_a_manual_optimization_step(tmp_path):
    """Lightning's manual optimization stepping two optimizers per batch (a GAN): the measured
    step must hold both forward/backward passes, not stop at the first optimizer's step.
    Per sample, layer a Linear(3, 4) counts forward 2*3*4 and weight gradient 2*3*4 (its input
    needs no gradient), layer b Linear(3, 2) 2*3*2 twice."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    clock = FakeClock()
    writer = RecordingWriter()

    def tick(batch_idx: int) -> None:
        clock.t += 1.0

    module = manual_optimization_module(
        [torch.nn.Linear(3, 4), torch.nn.Linear(3, 2)], 12, on_batch=tick
    )
    monitor = ThroughputMonitor(
        window_size=2, clock=clock, measure_flops=True, peak_flops=1e3, writer=writer
    )
    trainer = quiet_trainer(
        callbacks=[monitor],
        max_steps=6,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
    )
    trainer.fit(module)
    per_sample = 2 * (2 * 3 * 4) + 2 * (2 * 3 * 2)
    assert monitor.state_dict()["measured"] == ["samples", pytest.approx(per_sample)]
    assert _get_current_dispatch_mode() is None
    # global step 4 (the third batch): batches 1 and 2 in the window, 2 samples per second
    assert writer.rows[4]["throughput/flops_per_sec"] == pytest.approx(per_sample * 2.0)


def test_measured_flops_leave_out_validation_inside_the_first_step(tmp_path):
    """Validation every 2 batches under accumulation of 3 runs inside the first optimizer step,
    the one measured: its forward passes are not the step's training flops. Per sample, the
    Linear(3, 1) counts forward 2*3*1 and weight gradient 2*3*1 (its input needs no gradient);
    validation's forwards (20 samples, several times the step's 6) were counted into it."""
    import lightning.pytorch as pl

    clock = FakeClock()

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            clock.t += 1.0
            return self.layer(batch).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.layer(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(18, 3), batch_size=2)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(20, 3), batch_size=2)

    monitor = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True)
    trainer = quiet_trainer(
        callbacks=[monitor],
        max_steps=2,
        accumulate_grad_batches=3,
        val_check_interval=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Tiny())
    assert monitor.state_dict()["measured"] == ["samples", pytest.approx(2 * 3 + 2 * 3)]


@pytest.mark.parametrize(
    ("mixed_precision", "matmul", "column"),
    [("no", "highest", "fp32"), ("no", "high", "tf32"), ("bf16", "highest", "bf16")],
)
def test_mfu_under_accelerate_uses_the_accelerators_precision(
    monkeypatch, mixed_precision, matmul, column
):
    """An Accelerate run in fp32 was measured against the bf16 peak (MFU 2x too low against
    tf32, ~15x against fp32); the column comes from the Accelerator's mixed_precision, as
    Lightning's from its precision plugin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import trainvitals.callbacks.throughput_monitor as tm
    from trainvitals.adapters.context import RunContext
    from trainvitals.stats.flops import peak_flops

    AcceleratorState._reset_state(True)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(tm, "device_name_of", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock, writer = FakeClock(), RecordingWriter()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=1e9)
    try:
        with Vitals(
            [monitor], writer=writer, accelerator=accelerator, log_every_n_steps=1
        ) as vitals:
            vitals.attach(model, opt)
            for _ in range(3):
                ids = torch.ones(2, 5, dtype=torch.long)
                vitals.batch({"input_ids": ids})
                clock.t += 1.0
                model(torch.randn(2, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
    peak = peak_flops("NVIDIA H100 80GB HBM3", column)
    assert {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12}[column] == pytest.approx(
        peak, rel=1e-3
    )
    # window of steps 1..2: 10 tokens per 1 s step
    assert writer.rows[2]["throughput/mfu"] == pytest.approx(1e9 * 10.0 / peak, rel=1e-12)
