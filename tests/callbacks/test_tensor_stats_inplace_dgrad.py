"""TensorStatsMonitor: the dgrad of a Linear output that is changed in place afterwards."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor

D = 16


class Mlp(nn.Module):
    """fc1 -> ReLU -> fc2 + residual, in place or not (the same numbers either way)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = torch.relu_(h) if self.inplace else torch.relu(h)
        y = self.fc2(h)
        if self.inplace:
            y += x  # a residual added in place
        else:
            y = y + x
        return y


@pytest.mark.parametrize("ckpt", [None, False, True])
def test_dgrad_of_a_linear_output_changed_in_place_is_measured(
    tmp_path: Path, ckpt: bool | None
) -> None:
    # nn.Linear's output for a 3-D input is a view of its 2-D addmm result, and a tensor hook on
    # a view never fires once the view is changed in place (ReLU(inplace=True), `y += x`): the
    # dgrad of fc1/output0 and fc2/output0 was missing from the file, silently. The reference
    # is an out-of-place twin of the model (the same gradients), captured with plain hooks.
    torch.manual_seed(0)
    twin = Mlp(inplace=False)
    model = copy.deepcopy(twin)
    model.inplace = True
    want: dict[str, list[torch.Tensor]] = {}

    def capture(name: str):
        def hook(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                t.register_hook(
                    lambda g, s=f"{name}/{suffix}": want.setdefault(s, []).append(
                        g.detach().double().reshape(-1).clone()
                    )
                )

        return hook

    for name in ("fc1", "fc2"):
        twin.get_submodule(name).register_forward_hook(capture(name))
    xs = [torch.randn(3, 5, D, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:
        twin(x.clone().requires_grad_()).pow(2).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=["dgrad"], kernel="eager")
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path) as vitals:
        vitals.attach(model, opt)
        for x in xs:  # one step of two micro-batches
            x = x.clone().requires_grad_()
            vitals.batch(x)
            out = model(x) if ckpt is None else checkpoint(model, x, use_reentrant=ckpt)
            out.pow(2).sum().backward()
        opt.step()
    (line,) = read_lines(tmp_path / "tensor_stats.jsonl")
    assert line["kind"] == "dgrad"
    expected = {s: torch.cat(v) for s, v in want.items()}
    assert set(expected) == {f"{m}/{s}" for m in ("fc1", "fc2") for s in ("input0", "output0")}
    check_line(line, expected, f"dgrad, checkpoint={ckpt}")
