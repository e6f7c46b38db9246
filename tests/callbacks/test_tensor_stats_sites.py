"""TensorStatsMonitor: which tensor of a site's arguments and outputs is input0 / output0."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor


class Gate(nn.Module):
    """A site called with token ids first and the hidden states second, returning expert
    indices first and weights second (a router's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(6, 4))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor):
        weights = torch.softmax(hidden @ self.proj, dim=-1) * (ids.unsqueeze(-1) % 3 + 1)
        return weights.argmax(-1), weights


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        _, weights = self.gate(ids, hidden)
        return weights.pow(2).sum()


def test_the_first_floating_point_argument_and_output_are_measured(tmp_path: Path) -> None:
    # module(ids, hidden) -> (indices, weights): input0 is hidden, output0 the weights. An
    # integer first argument used to leave input0 out (and an integer first output, output0),
    # while a non-tensor first argument was passed over: "the first floating-point input".
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(
        kinds=["activation", "dgrad"], module_types=(Gate,), kernel="eager"
    )
    ids = torch.randint(0, 10, (3, 5))
    hidden = torch.randn(3, 5, 6, requires_grad=True)
    captured: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        captured["gate/input0"] = args[1].detach().double().clone()
        captured["gate/output0"] = output[1].detach().double().clone()
        output[1].register_hook(
            lambda g: captured.__setitem__("dgrad/gate/output0", g.double().clone())
        )
        args[1].register_hook(
            lambda g: captured.__setitem__("dgrad/gate/input0", g.double().clone())
        )

    model.gate.register_forward_hook(keep)
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        vitals.batch((ids, hidden))
        model(ids, hidden).backward()
        opt.step()
        opt.zero_grad()
    records = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    check_line(
        records["activation"],
        {n: captured[n] for n in ("gate/input0", "gate/output0")},
        "activation",
    )
    check_line(
        records["dgrad"],
        {n: captured[f"dgrad/{n}"] for n in ("gate/input0", "gate/output0")},
        "dgrad",
    )
