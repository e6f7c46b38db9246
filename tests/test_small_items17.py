"""Three small items: MoEMetricsMonitor's pipeline check of stage layer numbers counts only the
routers that record; MemoryMonitor under Lightning with accelerator="cpu" writes no CUDA key
when other code of the process initialised CUDA; ``trainvitals report FILE`` / ``query FILE``
say what to run instead."""

from __future__ import annotations

import math
import shlex
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.callbacks.test_moe_metrics_monitor import ref_losses
from tests.callbacks.test_moe_metrics_monitor_pipeline_layers import (
    _capture,
    _lm,
    train_two_steps,
)
from tests.helpers.dist import run_distributed
from tests.helpers.fake_cuda import OffloadedShard, expected_cuda_row, fake_cuda_api
from tests.helpers.moe_models import EXPERTS, HIDDEN, TOPK
from tests.scripts.vitals_testing import RecordingWriter

# ------------------------------------------------------ MoEMetricsMonitor: stage layer numbers


def test_stage_check_ignores_a_router_that_records_nothing():
    """A router with a layer number but no ``num_layers`` records nothing into the tracker: it
    shares no slot with another stage's router of that number. Two recording routers of one
    number on two stages are still the error."""
    from trainvitals.callbacks.moe_metrics_monitor import _check_stage_layer_numbers

    _check_stage_layer_numbers([[(1, 4), (2, None)], [(1, None), (3, 4), (None, None)]])
    with pytest.raises(ValueError, match=r"pipeline stages 0 and 1 .* layer_number=3"):
        _check_stage_layer_numbers([[(3, 4), (1, None)], [(1, None), (3, 4)]])


class _Stage(nn.Module):
    """The blocks ``keep`` of ``full`` under their global names ``layers.<i>``; on the last
    stage also a side router numbered 1 without ``num_layers`` (it records nothing), run in
    every training forward."""

    def __init__(self, full: nn.Module, keep: list[int], side: bool) -> None:
        from trainvitals.moe import TopKRouter

        super().__init__()
        self.embed = full.embed
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in keep})
        self.side = (
            TopKRouter(HIDDEN, EXPERTS, TOPK, aux_loss_type="aux_loss", layer_number=1)
            if side
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers.values():
            h = block(h)
        loss = h.pow(2).mean()
        if self.side is not None:
            probs, _ = self.side(h.detach())
            loss = loss + 0.0 * probs.sum()
        return loss


def _pp_body(rank: int, world_size: int) -> dict:
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import MoEMetricsMonitor
    from trainvitals.distributed import ProcessGroups, world_group
    from trainvitals.moe import MoEMetricsTracker, set_moe_metrics_tracker

    set_moe_metrics_tracker(MoEMetricsTracker())
    keep = [0, 1] if rank == 0 else [2, 3]
    model = _Stage(_lm(4, [1, 0, 1, 0]), keep, side=rank == 1)
    assert model.side is None or (model.side.layer_number, model.side.num_layers) == (1, None)
    # (0-based layer, input, weight) of each forward of the stage's own routers (not the side's)
    seen = _capture(model.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    vitals = Vitals(
        [MoEMetricsMonitor(per_layer_logging=True, writer=writer)],
        groups=ProcessGroups(pp=world_group()),
        log_every_n_steps=1,
    )
    try:
        vitals.attach(model, opt)
        train_two_steps(vitals, model, opt)  # 2 optimizer steps of 2 micro-batches
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None, "rows": writer.rows, "seen": seen}


@pytest.mark.timeout(240)
def test_pipeline_run_with_a_side_router_numbered_like_another_stages_layer():
    """Stage 0 records layer 1 (``layers.0``); stage 1 records layer 3 and runs a side router
    numbered 1 without ``num_layers``. The run goes on (it was a ValueError on both ranks) and
    writes the mean over the 2 MoE layers, from float64 losses of the routers' inputs."""
    results = run_distributed(_pp_body, 2, timeout=200)
    for r in results:
        assert r["error"] is None, r["error"]
    seen = [entry for r in results for entry in r["seen"]]
    assert sorted({layer for layer, _, _ in seen}) == [0, 2]
    by_layer: dict[int, list] = {}
    for layer, x, w in seen:
        by_layer.setdefault(layer, []).append(ref_losses(torch.tensor(x), torch.tensor(w)))
    for step in (0, 1):
        for name in ("load_balancing_loss", "z_loss"):
            layer_means = {
                layer: math.fsum(v[name] for v in values[2 * step : 2 * step + 2]) / 2
                for layer, values in by_layer.items()
            }
            expected = {f"moe/{name}_layer_{i}": v for i, v in layer_means.items()}
            expected[f"moe/{name}"] = math.fsum(layer_means.values()) / 2
            for rank, r in enumerate(results):
                row = r["rows"][step]
                assert {k for k in row if k.startswith(f"moe/{name}")} == set(expected)
                for key, value in expected.items():
                    assert row[key] == pytest.approx(value, rel=1e-4), (rank, step, key)


# ------------------------------------------------- MemoryMonitor: Lightning accelerator="cpu"

_CUDA_KEYS = expected_cuda_row()


@pytest.fixture
def cuda_initialised_elsewhere(monkeypatch):
    """CUDA available and initialised (by other code of the process), current device 1;
    returns the devices ``torch.cuda.memory_stats`` was asked for."""
    return fake_cuda_api(monkeypatch, initialised=True)


class _CudaBuffer(torch.Tensor):
    """A CPU tensor that reports itself on cuda:0 (only its ``device`` is looked at)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _one_step(model: nn.Module, root: torch.device | None) -> tuple[dict, object]:
    from trainvitals.adapters.context import RunContext
    from trainvitals.callbacks.memory_monitor import MemoryMonitor
    from trainvitals.distributed import ProcessGroups

    writer = RecordingWriter()
    trainer = None if root is None else SimpleNamespace(strategy=SimpleNamespace(root_device=root))
    ctx = RunContext(
        writer=writer, groups=ProcessGroups(), model=model, log_every_n_steps=1, trainer=trainer
    )
    monitor = MemoryMonitor(host=False)
    monitor.run_start(ctx)
    monitor.step_end(ctx)
    return writer.rows.get(0, {}), monitor


@pytest.mark.parametrize(
    ("root", "model_kind", "expected_device"),
    [
        # Lightning accelerator="cpu", a CPU model: nothing of the run is on CUDA
        (torch.device("cpu"), "cpu", None),
        # ... but a buffer the user put on CUDA is the run's CUDA memory
        (torch.device("cpu"), "cuda_buffer", torch.device("cuda", 0)),
        # FSDP2 with CPU offload: the shards on the CPU, the compute on the current device
        (torch.device("cpu"), "offloaded", torch.device("cuda", 1)),
        (torch.device("cuda", 1), "offloaded", torch.device("cuda", 1)),
        # no framework device (plain loop): CUDA initialised -> the current device, as before
        (None, "cpu", torch.device("cuda", 1)),
    ],
)
def test_memory_device_rule(cuda_initialised_elsewhere, root, model_kind, expected_device):
    model = nn.Linear(2, 2)
    if model_kind == "cuda_buffer":
        model.register_buffer("on_gpu", torch.zeros(2).as_subclass(_CudaBuffer))
    elif model_kind == "offloaded":
        model.weight = OffloadedShard(torch.zeros(2, 2))
    row, monitor = _one_step(model, root)
    if expected_device is None:
        assert row == {} and cuda_initialised_elsewhere == [] and monitor._cuda == ()
    else:
        assert row == pytest.approx(_CUDA_KEYS, rel=1e-15)
        assert cuda_initialised_elsewhere == [expected_device]


def test_lightning_cpu_run_writes_no_cuda_key_with_cuda_initialised(cuda_initialised_elsewhere):
    """A real Lightning Trainer(accelerator="cpu"): host keys only, the allocator never read
    (the current CUDA device's 10 keys were written before)."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.memory_monitor import MemoryMonitor

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    writer = RecordingWriter()
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[MemoryMonitor(writer=writer)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    assert sorted(writer.rows) == [0, 1]
    for row in writer.rows.values():
        assert set(row) == {"memory/rss_gb", "memory/peak_rss_gb"}, sorted(row)
    assert cuda_initialised_elsewhere == []


# ---------------------------------------------------------- trainvitals report/query FILE


def _metrics_run(folder: Path) -> Path:
    """A run folder with the metrics.jsonl of the package's own JSONL sink."""
    from trainvitals.adapters import FanoutWriter, JsonlSink

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metrics.jsonl"
    with FanoutWriter([JsonlSink(path)]) as writer:
        for step in (0, 1):
            writer.add_scalars({"train/loss": 1.0 / (step + 1)}, step)
    return path


def test_report_of_a_metrics_file_says_to_use_metrics(tmp_path, capsys):
    from trainvitals.cli import EXIT_ERROR, main

    path = _metrics_run(tmp_path / "run one")
    assert main(["report", str(path)]) == EXIT_ERROR
    err = capsys.readouterr().err
    command = (
        f"trainvitals report {shlex.quote(str(path.parent))} --metrics {shlex.quote(str(path))}"
    )
    assert err == (
        f"trainvitals report: error: {path} is a file, not a run folder: a metrics file (JSONL, "
        f"TensorBoard event file, CSV) goes to --metrics, run `{command}`\n"
    )
    assert not (path.parent / "report.html").exists()
    # the command it names works
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the metrics are read: no "no metric values"
        assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == f"{path.parent / 'report.html'}\n"
    assert "train/loss" in (path.parent / "report.html").read_text()


def test_report_of_a_tensor_stats_file_says_to_give_its_folder(tmp_path, capsys):
    from trainvitals.cli import EXIT_ERROR, main

    path = tmp_path / "tensor_stats.jsonl"
    path.write_text("")
    assert main(["report", str(path)]) == EXIT_ERROR
    assert capsys.readouterr().err == (
        f"trainvitals report: error: {path} is a file, not a run folder: run "
        f"`trainvitals report {shlex.quote(str(tmp_path))}` (the folder holding it)\n"
    )
    # a missing path keeps its message
    assert main(["report", str(tmp_path / "nope")]) == EXIT_ERROR
    assert "error: no run folder at" in capsys.readouterr().err


def test_query_of_a_metrics_file_says_what_to_run(tmp_path, capsys):
    from trainvitals.cli import EXIT_ERROR, main

    path = _metrics_run(tmp_path)
    with pytest.warns(RuntimeWarning, match="schema version None"):  # (the reader's lines)
        assert main(["query", str(path)]) == EXIT_ERROR
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"trainvitals query: error: {path} holds no tensor-statistics record: `trainvitals "
        "query` reads the tensor_stats.jsonl of TensorStatsMonitor; a metrics file is read by "
        f"`trainvitals report {tmp_path} --metrics {path}`"
    )
    # with a tensor_stats.jsonl beside it, the query of the folder is named
    (tmp_path / "tensor_stats.jsonl").write_text("")
    with pytest.warns(RuntimeWarning, match="schema version None"):
        assert main(["query", str(path)]) == EXIT_ERROR
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the tensor statistics of its folder: `trainvitals query {tmp_path}`;" in last
