"""ThroughputMonitor audit: peaks of MIG slices and Volta at tf32, measured flops per token on
batches of another sequence length."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor
from trainvitals.stats.flops import chip_name, measure_flops, peak_flops


def _on_cuda_device(monkeypatch, name: str) -> None:
    import trainvitals.callbacks.throughput_monitor as tm
    from trainvitals.adapters.context import RunContext

    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(tm, "device_name_of", lambda device: name)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _steps(monitor: ThroughputMonitor, clock: FakeClock, model, forward, batches):
    """One optimizer step per batch of token ids, 1 s of ``clock`` (the monitor's) each,
    logging every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    for ids in batches:
        vitals.batch({"input_ids": ids})
        clock.t += 1.0
        forward(ids).sum().backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    return writer


@pytest.mark.parametrize(
    "name", ["NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"]
)
def test_a_mig_slice_gets_no_whole_gpu_peak(monkeypatch, name):
    """A MIG slice has a fraction of the GPU's multiprocessors: the whole H100's 989.4 TFLOP/s
    as its peak put the MFU of a 1g slice about 7x too low. No peak, no MFU, a warning."""
    assert chip_name(name) is None
    assert peak_flops(name, "bf16") is None
    _on_cuda_device(monkeypatch, name)
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=10.0)
    model = torch.nn.Linear(3, 1)
    with pytest.warns(RuntimeWarning, match="no peak FLOP/s"):
        writer = _steps(
            monitor, clock, model, lambda ids: model(ids.float()), [torch.ones(2, 3)] * 3
        )
    assert writer.rows[2]["throughput/flops_per_sec"] == pytest.approx(10.0 * 6 / 1.0)
    assert not any("mfu" in key for row in writer.rows.values() for key in row)


def test_tf32_on_a_gpu_without_tf32_tensor_cores_is_its_fp32_peak(monkeypatch):
    """Volta has no TF32: fp32 matmuls run at 15.7 TFLOP/s on a V100 SXM2 whatever the matmul
    precision setting (Lightning asks for tf32 only on Ampere or later). A tf32 run had no MFU."""
    name = "Tesla V100-SXM2-32GB"
    assert peak_flops(name, "tf32") == 15.7e12
    assert peak_flops(name, "fp32") == 15.7e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12  # Ampere keeps its TF32
    _on_cuda_device(monkeypatch, name)
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=2, clock=clock, flops_per_token=1e9, precision="tf32")
    model = torch.nn.Linear(3, 1)
    writer = _steps(monitor, clock, model, lambda ids: model(ids.float()), [torch.ones(2, 3)] * 3)
    tokens_per_sec = 6 / 1.0  # 2 x 3 token ids per 1 s step
    assert writer.rows[2]["throughput/mfu"] == pytest.approx(1e9 * tokens_per_sec / 15.7e12)


D, VOCAB = 8, 20


class _Attention(torch.nn.Module):
    """Single-head self-attention written with matmuls (counted by FlopCounterMode on CPU):
    the score and value products cost 2 * 2 * L * D flops per token in the forward, growing
    with the sequence length L."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)
        self.out = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


def _flops_per_token(model: _Attention, batch: int, length: int) -> float:
    ids = torch.randint(0, VOCAB, (batch, length))
    return measure_flops(lambda: model(ids).sum().backward()) / (batch * length)


def test_measured_flops_per_token_on_another_sequence_length_are_warned_about():
    """Flops are measured on the first step and spread over its tokens; a later step of longer
    sequences has more attention flops per token, so the flops keys come out low (here about
    half) without a word. The window's tokens per sample differing from the measured step's is
    now warned about (once), and the measured length survives a checkpoint."""
    torch.manual_seed(0)
    model = _Attention()
    short, long = _flops_per_token(model, 2, 4), _flops_per_token(model, 2, 64)
    assert long > 1.5 * short  # the case: per-token flops grow with the length
    batches = [torch.randint(0, VOCAB, (2, n)) for n in (4, 4, 64, 64)]

    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True)
    with pytest.warns(RuntimeWarning, match="4 tokens per sample") as record:
        writer = _steps(monitor, clock, model, model, batches)
    assert sum("tokens per sample" in str(w.message) for w in record) == 1  # once
    assert monitor.state_dict()["measured"] == ["tokens", pytest.approx(short)]
    # what it writes meanwhile (documented): the short steps' figure times the long tokens
    row = writer.rows[3]
    assert row["throughput/device/flops_per_sec"] == pytest.approx(short * 2 * 128 / 2.0)
    assert row["throughput/device/flops_per_sec"] < 0.7 * long * 2 * 128 / 2.0
    state = monitor.state_dict()
    assert state["measured_tokens_per_sample"] == 4.0

    # ... nor for a run of one length; a restored instance keeps the measured length
    clock = FakeClock()
    same = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(same, clock, model, model, [torch.randint(0, VOCAB, (2, 4)) for _ in range(4)])
    clock = FakeClock()
    restored = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True)
    restored.load_state_dict(state)
    with pytest.warns(RuntimeWarning, match="4 tokens per sample"):
        _steps(restored, clock, model, model, [torch.randint(0, VOCAB, (2, 64)) for _ in range(3)])
