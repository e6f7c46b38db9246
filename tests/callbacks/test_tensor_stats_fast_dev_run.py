"""Lightning's fast_dev_run turns its loggers and checkpoints off: TensorStatsMonitor then
writes no tensor_stats.jsonl (it landed in default_root_dir, the working directory by default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainvitals.callbacks import TensorStatsMonitor

pl = pytest.importorskip("lightning.pytorch")


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, **trainer_args) -> None:
    data = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TensorStatsMonitor(kinds=("param", "grad", "activation"))],
        **trainer_args,
    )
    trainer.fit(_Module(), data)


@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_fast_dev_run_writes_no_tensor_stats_file(
    tmp_path: Path, monkeypatch, fast_dev_run
) -> None:
    monkeypatch.chdir(tmp_path)
    _fit(tmp_path, fast_dev_run=fast_dev_run)
    assert not list(tmp_path.rglob("tensor_stats*.jsonl*"))


def test_a_normal_run_without_logger_writes_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fit(tmp_path, max_steps=3, logger=False, enable_checkpointing=False)
    (path,) = tmp_path.rglob("tensor_stats.jsonl")
    assert len(path.read_text().splitlines()) == 3 * 3  # 3 steps x param, grad, activation
