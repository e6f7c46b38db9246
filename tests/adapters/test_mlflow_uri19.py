"""MLflowSink's SQLite store file is the one SQLAlchemy (and so MLflow) opens: ``%20`` in a
``sqlite:///`` URI is decoded, a query string dropped, ``sqlite+pysqlite`` understood; and a
run folder whose name holds ``%`` or ``?`` gets its store inside it. Before, the sink's check
created and tested ``my%20runs/m.db`` beside the user's ``my runs/m.db`` (so a read-only store
was not caught before MLflow's own retries), and skipped ``sqlite+pysqlite`` URIs; a run
folder named ``run%20a?b`` had its store written to a file ``run a`` beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.adapters.conftest import read_mlflow
from trainvitals.adapters import FanoutWriter, MLflowSink
from trainvitals.adapters.sinks.mlflow import _sqlite_file

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")


def test_the_store_file_is_the_one_sqlalchemy_opens(tmp_path: Path) -> None:
    from sqlalchemy.engine import make_url

    for uri, expected in [
        (f"sqlite:///{tmp_path}/my%20runs/m.db", tmp_path / "my runs" / "m.db"),
        (f"sqlite:///{tmp_path}/x.db?timeout=5", tmp_path / "x.db"),
        (f"sqlite+pysqlite:///{tmp_path}/p.db", tmp_path / "p.db"),
    ]:
        assert _sqlite_file(uri) == expected == Path(make_url(uri).database)
    for uri in ["sqlite://", "sqlite:///:memory:", "sqlite:///file:x.db?mode=ro&uri=true"]:
        assert _sqlite_file(uri) is None, uri


@pytest.mark.parametrize("name", ["run%20a?b", "my runs é"])
def test_a_run_folder_holds_its_store_whatever_its_name(tmp_path: Path, name: str) -> None:
    run_dir = tmp_path / name
    sink = MLflowSink(run_dir=run_dir, experiment_name="uri19")
    with FanoutWriter([sink]) as writer:
        for step in range(3):
            writer.add_scalar("train/loss", 1.0 + step, step)
    assert (run_dir / "mlflow.db").stat().st_size > 0
    assert _sqlite_file(sink.tracking_uri) == run_dir / "mlflow.db"
    if "%" not in name:  # (MLflow itself makes an empty folder of the undecoded URI path)
        assert [p.name for p in tmp_path.iterdir()] == [name]  # nothing beside it
    assert read_mlflow(sink.client, sink.run_id, ["train/loss"]) == {
        "train/loss": {0: 1.0, 1: 2.0, 2: 3.0}
    }
