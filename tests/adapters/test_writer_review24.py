"""Review 24 (R4): a writer with ``rank=None`` works out its rank when it first needs it.

A writer built before the process group exists (before Lightning's ``fit()``, whose launcher
sets ``LOCAL_RANK``/``NODE_RANK`` but no ``RANK``) took rank 0 on every process: each
delivered, two processes appended to one JSONL file and each made its own MLflow run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from tests.adapters.conftest import RecordingSink
from tests.helpers.dist import run_distributed
from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "WORLD_SIZE")


def _writer_before_the_group(rank: int, world_size: int, tmp: str) -> dict:
    # As a script run under Lightning's launcher builds its writer: no process group yet, and
    # nothing in the environment (the parent process has no LOCAL_RANK before fit()).
    dist.destroy_process_group()
    for name in _LAUNCH_VARS:
        os.environ.pop(name, None)
    recording = RecordingSink()
    writer = FanoutWriter([JsonlSink(os.path.join(tmp, "metrics.jsonl")), recording])
    rank_before = writer.rank
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store-late", rank=rank, world_size=world_size
    )
    for step in range(5):
        writer.add_scalars({"loss": 100.0 * rank + step, "step_x2": 2.0 * step}, step)
    writer.close()
    dist.barrier()
    return {
        "rank_before": rank_before,
        "rank": writer.rank,
        "steps": [s for s, _, _ in recording.steps],
        "opened": recording.opened,
    }


@pytest.mark.timeout(60)
def test_writer_built_before_the_process_group_delivers_on_rank_zero_only(tmp_path) -> None:
    results = run_distributed(_writer_before_the_group, 2, args=(str(tmp_path),), timeout=50)
    # before the group existed nothing told the two processes apart
    assert [r["rank_before"] for r in results] == [0, 0]
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["steps"] == [0, 1, 2, 3, 4] and results[0]["opened"] == 1
    assert results[1]["steps"] == [] and results[1]["opened"] == 0
    # one file, every step once, rank 0's values; nothing moved aside
    assert sorted(p.name for p in tmp_path.glob("metrics.jsonl*")) == ["metrics.jsonl"]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["metrics"]) for r in records] == [
        (s, {"loss": float(s), "step_x2": 2.0 * s}) for s in range(5)
    ]


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_rank_is_read_at_the_first_value_not_when_the_writer_is_built(no_launcher) -> None:
    no_launcher.setenv("RANK", "1")
    sink = RecordingSink()
    writer = FanoutWriter([sink])
    assert writer.rank == 1
    no_launcher.setenv("RANK", "0")  # what the process turns out to be when it logs
    writer.add_scalar("a", 2.5, 3)
    writer.close()
    assert writer.rank == 0 and sink.steps and sink.steps[0][:2] == (3, {"a": 2.5})
    # fixed once known: a later change of the environment changes nothing
    no_launcher.setenv("RANK", "4")
    assert writer.rank == 0
    # an explicit rank= is fixed when the writer is built, as before
    no_launcher.setenv("RANK", "0")
    other = RecordingSink()
    explicit = FanoutWriter([other], rank=1)
    explicit.add_scalar("a", 1.0, 0)
    explicit.close()
    assert explicit.rank == 1 and other.steps == [] and other.opened == 0


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1),  # Lightning's child
        ({"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"}, None),  # node 1: not 0
        ({"LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "8"}, None),
        # one process: rank 0 whatever its environment holds (a sweep's SLURM task, a
        # LOCAL_RANK left over); before, each of these wrote nothing, without a word
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, 0),
        ({"LOCAL_RANK": "1"}, 0),
        ({"NODE_RANK": "1", "WORLD_SIZE": "1"}, 0),
    ],
)
def test_rank_from_the_launchers_environment(no_launcher, env: dict, rank: int | None) -> None:
    for name, value in env.items():
        no_launcher.setenv(name, value)
    sink = RecordingSink()
    writer = FanoutWriter([sink])
    writer.add_scalar("a", 1.0, 0)
    writer.close()
    assert writer.rank == rank
    assert [s for s, _, _ in sink.steps] == ([0] if rank == 0 else [])


def test_an_unknown_non_zero_rank_is_asked_again_later(no_launcher) -> None:
    no_launcher.setenv("NODE_RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "2")
    sink = RecordingSink()
    writer = FanoutWriter([sink])
    writer.add_scalar("a", 1.0, 0)  # not rank 0: dropped, the rank is not fixed
    assert writer.rank is None
    no_launcher.setenv("RANK", "9")  # e.g. the process group now exists
    writer.add_scalar("a", 2.0, 1)
    writer.close()
    assert writer.rank == 9 and sink.steps == [] and sink.opened == 0


def test_resume_at_before_the_rank_is_known_reaches_the_sinks(no_launcher, tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "time": 1.0, "metrics": {"a": s}}) + "\n" for s in range(10))
    )
    no_launcher.setenv("RANK", "1")  # a guess before the group exists
    writer = FanoutWriter([JsonlSink(path)])
    writer.resume_at(5)
    no_launcher.setenv("RANK", "0")
    # a rollback, then a flush before the next logging step: the abandoned lines go
    assert writer.flush() is True
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3, 4]
    writer.add_scalar("a", 50.0, 5)
    writer.close()
    assert [(r["step"], r["metrics"]["a"]) for r in read_jsonl(path)] == [
        *((s, float(s)) for s in range(5)),
        (5, 50.0),
    ]
