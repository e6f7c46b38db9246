"""The snippets of README.md and of the docs pages not covered by tests/test_examples.py run
as a new user would run them: python blocks with a tiny model (a Lightning trainer a block
builds is fitted for two steps), `trainvitals ...` command lines against a small run folder,
and `benchmarks/*.py` command lines only with options the script defines."""

from __future__ import annotations

import ast
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_TINY = dict(
    vocab_size=32, hidden_size=16, num_layers=2, num_experts=4, top_k=2, ffn_hidden_size=16
)
_BATCHES, _BATCH_SIZE, _SEQ_LEN = 4, 4, 8


def _fenced(page: str) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block of a page, in order."""
    blocks, lang, body = [], None, []
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _blocks(page: str, lang: str) -> list[str]:
    return [text for block_lang, text in _fenced(page) if block_lang == lang]


def _command_lines(page: str) -> list[list[str]]:
    """The command lines (python, trainvitals) of a page's bash and untagged blocks, as argv."""
    lines = []
    for lang, text in _fenced(page):
        if lang not in ("", "bash"):
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if re.match(r"(\.venv/bin/)?(python|trainvitals)\b", line):
                lines.append(shlex.split(line, comments=True))
    return lines


def _loader():
    from trainvitals.moe.tiny_model import RandomTokenDataset

    data = RandomTokenDataset(_BATCHES * _BATCH_SIZE, _SEQ_LEN, _TINY["vocab_size"], seed=0)
    return torch.utils.data.DataLoader(data, batch_size=_BATCH_SIZE)


def _tb_tags(folder: Path) -> set[str]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


_STEP = "model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()"


def _run_blocks(page: str, namespace: dict) -> dict:
    """A page's python blocks in order in one namespace, as a reader runs them; a trainer a
    block builds is fitted for two steps on the tiny MoE model."""
    from trainvitals.moe import destroy_moe_metrics_tracker
    from trainvitals.moe.tiny_model import TinyMoELightningModule

    blocks = _blocks(page, "python")
    assert blocks
    for i, code in enumerate(blocks):
        # a loop body left to the reader (`...`) is the reader's training step
        code = re.sub(r"^( +)\.\.\.$", r"\1" + _STEP, code, flags=re.M)
        exec(compile(code, f"{page} python block {i}", "exec"), namespace)
        trainer = namespace.pop("trainer", None)
        if trainer is not None:
            trainer.fit_loop.epoch_loop.max_steps = 2
            trainer.fit(namespace.pop("module", None) or TinyMoELightningModule(**_TINY), _loader())
        destroy_moe_metrics_tracker()  # the next block may route another number of layers
    return namespace


def _reader_namespace() -> dict:
    """What a reader of a snippet brings: a model, its optimizer, a loader of dict batches, an
    Accelerator without trackers, and the loop variables the snippets leave to the reader."""
    from accelerate import Accelerator

    from trainvitals.moe.tiny_model import TinyMoELM

    torch.manual_seed(0)
    model = TinyMoELM(**_TINY)
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "loader": _loader(),
        "accelerator": Accelerator(cpu=True),
        "n_params": sum(p.numel() for p in model.parameters()),
        "loss": torch.tensor(2.0),
        "lr": 0.01,
        "step": 0,
    }


def test_readme_snippets_run_and_log_where_they_say(tmp_path, monkeypatch):
    for package in ("lightning", "accelerate", "tensorboard", "mlflow"):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    namespace = _run_blocks("README.md", _reader_namespace())
    # Lightning block: its TensorBoardLogger("runs"); the Accelerate block: an accelerator
    # without trackers writes runs/vitals/metrics.jsonl; the writer block: its three sinks
    assert {"moe/load_balancing_loss", "l2_norm/grad/global"} <= _tb_tags(tmp_path / "runs")
    assert namespace["vitals"].step == _BATCHES
    assert (tmp_path / "runs" / "vitals" / "metrics.jsonl").exists()
    assert {"loss", "lr"} <= _tb_tags(tmp_path / "runs" / "tb")
    assert (tmp_path / "runs" / "m.jsonl").read_text().count('"loss"') == 1
    assert (tmp_path / "runs" / "mlflow.db").exists()


def test_moe_page_snippets_run_and_write_their_keys(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    from trainvitals.adapters.jsonl import read_jsonl

    monkeypatch.chdir(tmp_path)
    namespace = _reader_namespace()
    batches = list(_loader())
    namespace.update(accum=2, loader=[batches[:2], batches[2:]])  # lists of accum micro-batches
    _run_blocks("docs/moe.md", namespace)  # the first block's module, fitted for two steps
    # percentiles {"load_balancing_loss": [0.5, 0.95]} and per_layer_logging, as the key table
    assert {
        "moe/load_balancing_loss_p50",
        "moe/load_balancing_loss_p95",
        "moe/z_loss_layer_0",
        "moe/load_balancing_loss_layer_3",
    } <= _tb_tags(tmp_path / "lightning_logs")
    records = read_jsonl(tmp_path / "runs" / "moe" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]  # two optimizer steps of two micro-batches
    assert "moe/load_balancing_loss" in records[0]["metrics"]


def test_callbacks_page_snippets_run_and_write_their_keys(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        namespace = _run_blocks("docs/callbacks.md", _reader_namespace())
    tags = _tb_tags(tmp_path / "lightning_logs")
    # MemoryMonitor(reduce=("max", "min")): every key also as <key>/min
    assert {"memory/rss_gb", "memory/rss_gb/min", "time/train_hours"} <= tags
    assert namespace["vitals"].step == _BATCHES
    assert (tmp_path / "runs" / "vitals" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A small run folder as `make demo` leaves one: metrics.jsonl and tensor_stats.jsonl."""
    from trainvitals import NormMonitor, TensorStatsMonitor
    from trainvitals.adapters.loop import Vitals
    from trainvitals.moe import destroy_moe_metrics_tracker
    from trainvitals.moe.tiny_model import TinyMoELM

    run_dir = tmp_path_factory.mktemp("docs") / "run"
    torch.manual_seed(0)
    model = TinyMoELM(**_TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitors = [NormMonitor(), TensorStatsMonitor()]
    with Vitals(monitors, log_every_n_steps=1, run_dir=run_dir) as vitals:
        vitals.attach(model, optimizer)
        for batch in _loader():
            vitals.batch(batch)
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    destroy_moe_metrics_tracker()
    return run_dir


_CLI_PAGES = ["README.md", "docs/report.md", "docs/tensor_stats.md"]


@pytest.mark.parametrize("page", _CLI_PAGES)
def test_cli_command_lines_run(page, run_folder, tmp_path, monkeypatch, capsys):
    from trainvitals import cli

    monkeypatch.chdir(tmp_path)
    ran = 0
    for argv in _command_lines(page):
        if argv[0].endswith("python") and argv[1:3] == ["-m", "trainvitals"]:
            argv = argv[3:]
        elif argv[0].endswith("trainvitals"):
            argv = argv[1:]
        else:
            continue
        argv = [str(tmp_path / Path(a).name) if a.startswith("/") else a for a in argv]
        argv = [str(run_folder) if re.fullmatch(r"runs/\w+|RUN_DIR", a) else a for a in argv]
        # 0: rows or a report; 1: a step range past this short run's (a query that matched
        # nothing); never 2 (bad arguments, unreadable run)
        assert cli.main(argv) in (0, 1), (page, argv, capsys.readouterr().err)
        ran += 1
    assert ran


def _script_options(script: Path) -> set[str]:
    """The option strings a benchmark script's argparse defines (string literals '--x')."""
    return {
        node.value
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"--[a-z][a-z0-9-]*", node.value)
    }


def test_benchmark_command_lines_name_real_scripts_and_options():
    checked = 0
    for argv in _command_lines("docs/benchmarks.md"):
        if argv[0].endswith("python") and argv[1] == "-m":
            script = ROOT / (argv[2].replace(".", "/") + ".py")
            options = argv[3:]
        elif argv[0].endswith("python"):
            script = ROOT / argv[1]
            options = argv[2:]
        else:
            continue
        assert script.is_file(), argv
        unknown = {o for o in options if o.startswith("--")} - _script_options(script)
        assert not unknown, (argv, unknown)
        checked += 1
    assert checked >= 10
