"""trainvitals.report.sources: a resumed run's repeated steps, read from every format, keep the
value read last, in step order, against a dict built independently from the same lines."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import pytest

from trainvitals.report.sources import StepValues, load_metrics


def reference(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    latest: dict[int, float] = {}
    for step, value in points:
        latest[step] = value  # a later point of a step replaces the earlier one
    return sorted(latest.items())


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(
        sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
        for (sa, va), (sb, vb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("seed", range(6))
def test_step_values_keep_the_last_value_of_each_step_in_order(seed: int) -> None:
    rng = random.Random(seed)
    points: list[tuple[int, float]] = []
    step = 0
    for _ in range(rng.randint(1, 400)):
        # mostly increasing; sometimes a resume back to an earlier step, or a step repeated
        step = rng.choice([step + 1, step + 1, step, max(0, step - rng.randint(1, 30))])
        points.append((step, rng.choice([rng.gauss(0, 1), math.nan, math.inf])))
    sv = StepValues()
    for s, v in points:
        sv.append(s, v)
    sv.finish()
    want = reference(points)
    assert same(list(zip(sv.steps, sv.values, strict=True)), want)
    for s, v in want[:: max(1, len(want) // 7)]:
        got = sv.get(s, -1.0)
        assert got == v or (math.isnan(got) and math.isnan(v))
    assert sv.get(want[-1][0] + 1, -1.0) == -1.0


def test_load_metrics_from_a_resumed_jsonl_keeps_the_later_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [(s, {"train/loss": float(s), "lr": 0.1}) for s in range(10)]
    lines += [(s, {"train/loss": 100.0 + s}) for s in range(6, 12)]  # resumed from step 6
    path.write_text(
        "".join(json.dumps({"step": s, "time": 0.0, "metrics": m}) + "\n" for s, m in lines)
    )
    src = load_metrics(path, lambda key: key != "lr", 2, None)
    assert set(src.values) == {"train/loss"}
    loss = src.values["train/loss"]
    want = reference([(s, m["train/loss"]) for s, m in lines if s >= 2])
    assert list(zip(loss.steps, loss.values, strict=True)) == want
    assert want[4] == (6, 106.0) and want[-1] == (11, 111.0)


def points_of(src_values: dict, key: str) -> list[tuple[int, float]]:
    """The (step, value) pairs of ``key`` as loaded (any format), in step order."""
    points = src_values[key]
    return list(zip(points.steps, points.values, strict=True))


def write_tensorboard(logdir: Path, points: list[tuple[int, float]], *, start: int = 0) -> None:
    """A run's scalars as TensorBoardSink writes them (one event file per writer)."""
    from trainvitals.adapters import FanoutWriter, TensorBoardSink

    writer = FanoutWriter([TensorBoardSink(logdir)], rank=0)
    writer.resume_at(start)
    for step, value in points:
        writer.add_scalar("train/loss", value, step)
    writer.close()


@pytest.mark.parametrize("uid", [None, 9], ids=["any", "counter_9_to_10"])
def test_tensorboard_resume_hides_the_steps_purged_by_the_resumed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uid: int | None
) -> None:
    # A run logged steps 0..9 to TensorBoard, was resumed from its step-5 checkpoint into the
    # same folder (TensorBoardSink opens SummaryWriter(purge_step=5)) and logged steps 5, 6.
    # TensorBoard hides the first run's steps >= 5; the report must show the same timeline,
    # not the abandoned steps 7..9 behind the resumed ones. With the file counter going from
    # 9 to 10 within one second (a rollback in the same process), the names sort as text:
    # "...<second>.<host>.<pid>.10" before "....9", unless the sink waits for the next second.
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    if uid is not None:
        monkeypatch.setattr(event_file_writer._global_uid, "_value", uid)

    first = [(s, float(s)) for s in range(10)]
    resumed = [(s, 100.0 + s) for s in range(5, 7)]
    write_tensorboard(tmp_path / "tb", first)
    write_tensorboard(tmp_path / "tb", resumed, start=5)
    files = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 2
    if uid is not None:  # the resumed run's file (counter 10) is read last
        assert [f.name.rsplit(".", 1)[1] for f in files] == ["9", "10"]
    want = reference([p for p in first if p[0] < 5] + resumed)  # [(0, 0.0) .. (6, 106.0)]
    src = load_metrics(tmp_path, lambda key: True, None, None)
    assert points_of(src.values, "train/loss") == want
    assert len(src.times) == len(want)  # the purged steps' wall times are gone too


def test_tensorboard_double_precision_values_are_read(tmp_path: Path) -> None:
    # TensorBoardSink(double_precision=True) stores float64 tensors of the scalars plugin,
    # which EventAccumulator.Scalars() does not return: the report read no metric at all.
    pytest.importorskip("tensorboard")
    from trainvitals.adapters import FanoutWriter, TensorBoardSink

    points = [(s, 1.0 / 3.0 + s * 1e-9) for s in range(4)]  # not representable in float32
    writer = FanoutWriter([TensorBoardSink(tmp_path / "tb", double_precision=True)])
    for step, value in points:
        writer.add_scalars({"train/loss": value, "lr": 0.1}, step)
    writer.close()
    src = load_metrics(tmp_path / "tb", lambda key: key != "lr", None, None)
    assert set(src.values) == {"train/loss"}
    assert points_of(src.values, "train/loss") == points  # exact: float64 kept
    assert "float64 values" in src.description


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as a TensorBoard ``simple_value`` stores it."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@pytest.mark.parametrize("double_precision", [False, True], ids=["float32", "float64"])
def test_tensorboard_resume_purges_both_precisions(tmp_path: Path, double_precision: bool) -> None:
    # A run logs steps 0..9, is resumed at step 5 (logs 5..7), then again at step 6 (logs 6),
    # all into one folder through TensorBoardSink + FanoutWriter.resume_at: three event files,
    # the later two opened with SummaryWriter(purge_step=N). Float64 values are tensor events,
    # which tensorboard's EventAccumulator does not purge: the report kept the abandoned
    # steps 8, 9 (and 7 of the first resume) behind the ones the resumed runs wrote.
    pytest.importorskip("tensorboard")
    from trainvitals.adapters import FanoutWriter, TensorBoardSink

    logdir = tmp_path / "tb"
    timelines = [  # (resumed at, {step: {key: value}}); third-ish values: not float32-exact
        (0, {s: {"train/loss": 1.0 / 3.0 + s, "lr": 0.1 + s} for s in range(10)}),
        (5, {s: {"train/loss": 100.0 + 1.0 / 7.0 + s} for s in range(5, 8)}),
        (6, {6: {"train/loss": 1000.0 + 1.0 / 11.0}}),
    ]
    for start, steps in timelines:
        writer = FanoutWriter([TensorBoardSink(logdir, double_precision=double_precision)], rank=0)
        writer.resume_at(start)
        for step, metrics in steps.items():
            writer.add_scalars(metrics, step)
        writer.close()
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 3
    # the run that happened: each resume drops every key's steps >= its step, then writes
    happened: dict[str, dict[int, float]] = {}
    for start, steps in timelines:
        for series in happened.values():
            for step in [s for s in series if s >= start]:
                del series[step]
        for step, metrics in steps.items():
            for key, value in metrics.items():
                happened.setdefault(key, {})[step] = value
    stored = (lambda v: v) if double_precision else as_float32
    src = load_metrics(tmp_path, lambda key: True, None, None)
    assert set(src.values) == {"train/loss", "lr"}
    for key, series in happened.items():
        want = [(step, stored(value)) for step, value in sorted(series.items())]
        assert points_of(src.values, key) == want, key  # every step, float64 bit-exact
    assert points_of(src.values, "train/loss")[-2:] == [
        (5, stored(100.0 + 1.0 / 7.0 + 5)),
        (6, stored(1000.0 + 1.0 / 11.0)),
    ]
    assert [s for s, _ in points_of(src.values, "lr")] == [0, 1, 2, 3, 4]
    # one wall time per point kept (7 + 5): the purged points' wall times are gone too
    assert len(src.times) == sum(len(series) for series in happened.values())
    assert ("float64" if double_precision else "float32") + " values" in src.description


def test_a_folder_of_several_tensorboard_runs_is_an_error_naming_them(tmp_path: Path, capsys):
    # lightning_logs/ of two runs: the report showed version_0 (first in name order), the older
    # run, as if it were the current one. It must refuse and name both; each folder alone works.
    pytest.importorskip("tensorboard")
    from trainvitals.cli import main
    from trainvitals.report.sources import find_metrics

    logs = tmp_path / "lightning_logs"
    old, new = [(s, float(s)) for s in range(3)], [(s, 10.0 + s) for s in range(5)]
    write_tensorboard(logs / "version_0", old)
    write_tensorboard(logs / "version_1", new)
    for folder in (logs, tmp_path):
        with pytest.raises(FileNotFoundError, match="2 run folders below it") as raised:
            find_metrics(folder)
        assert str(logs / "version_0") in str(raised.value)
        assert str(logs / "version_1") in str(raised.value)
    assert main(["report", str(logs), "-o", str(tmp_path / "r.html")]) == 2
    assert "version_1" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    chosen = find_metrics(logs / "version_1")
    assert chosen == logs / "version_1"
    src = load_metrics(chosen, lambda key: True, None, None)
    assert points_of(src.values, "train/loss") == new


def test_event_files_of_one_run_folder_and_its_subfolders_are_one_run(tmp_path: Path) -> None:
    # A resumed run adds a second event file to its folder, and SummaryWriter.add_scalars puts
    # one folder per key inside the run's folder: one run, not several.
    pytest.importorskip("tensorboard")
    import time

    from torch.utils.tensorboard import SummaryWriter

    from trainvitals.report.sources import find_metrics

    run = tmp_path / "run"
    write_tensorboard(run / "tb", [(s, float(s)) for s in range(6)])
    time.sleep(1.0 - time.time() % 1.0 + 0.01)  # event files are ordered by their second
    write_tensorboard(run / "tb", [(3, 30.0)], start=3)
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2
    assert find_metrics(run) == run / "tb"
    with SummaryWriter(run / "tb") as writer:
        writer.add_scalars("lr", {"group0": 0.1, "group1": 0.2}, 3)
    assert len({p.parent for p in run.rglob("events.out.tfevents.*")}) == 3
    assert find_metrics(run) == run / "tb"
    src = load_metrics(find_metrics(run), lambda key: key == "train/loss", None, None)
    assert points_of(src.values, "train/loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_folder_of_several_csv_runs_is_an_error_naming_them(tmp_path: Path) -> None:
    from trainvitals.report.sources import find_metrics

    for version in (0, 1):
        folder = tmp_path / "lightning_logs" / f"version_{version}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(f"step,train/loss\n0,{version}.5\n")
    with pytest.raises(FileNotFoundError, match=r"version_0, .*version_1; a report shows one run"):
        find_metrics(tmp_path)
    only = tmp_path / "lightning_logs" / "version_1"
    assert find_metrics(only) == only / "metrics.csv"
    src = load_metrics(find_metrics(only), lambda key: True, None, None)
    assert points_of(src.values, "train/loss") == [(0, 1.5)]


def write_jsonl_and_tensorboard(run: Path, points: list[tuple[int, float]]) -> None:
    """A run as the demo (examples/demo.py) leaves it: ``metrics.jsonl`` at the top of the run
    folder and TensorBoard event files in its ``tensorboard/``, from one writer."""
    from trainvitals.adapters import FanoutWriter, JsonlSink, TensorBoardSink

    with FanoutWriter(
        [TensorBoardSink(run / "tensorboard"), JsonlSink(run / "metrics.jsonl")]
    ) as w:
        for step, value in points:
            w.add_scalar("train/loss", value, step)


def test_a_metrics_jsonl_below_the_run_folder_is_found_first(tmp_path: Path) -> None:
    # Given the parent folder of the demo's run, the JSONL one level down was not looked for:
    # the report read the event files beside it (float32: 1/3 + s rounded) instead of the
    # exact float64 file; a JSONL alone in version_0/ was not found at all (None).
    pytest.importorskip("tensorboard")
    from trainvitals.cli import main
    from trainvitals.report.sources import find_metrics

    points = [(s, 1.0 / 3.0 + s) for s in range(4)]  # not representable in float32
    demo = tmp_path / "runs" / "demo"
    write_jsonl_and_tensorboard(demo, points)
    assert find_metrics(demo) == demo / "metrics.jsonl"  # the demo's own folder, as before
    for given in (tmp_path / "runs", tmp_path):
        chosen = find_metrics(given)
        assert chosen == demo / "metrics.jsonl"
        src = load_metrics(chosen, lambda key: True, None, None)
        assert points_of(src.values, "train/loss") == points  # exact: the float64 file
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "runs"), "-o", str(out)]) == 0
    assert f"Read from {demo / 'metrics.jsonl'} (4 lines)" in out.read_text()

    logs = tmp_path / "lightning_logs"
    (logs / "version_0").mkdir(parents=True)
    (logs / "version_0" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time": 0.0, "metrics": {"x": v}}) + "\n" for s, v in points)
    )
    chosen = find_metrics(logs)
    assert chosen == logs / "version_0" / "metrics.jsonl"
    assert points_of(load_metrics(chosen, lambda key: True, None, None).values, "x") == points


def test_a_metrics_jsonl_in_several_run_folders_below_is_an_error_naming_them(
    tmp_path: Path,
) -> None:
    from trainvitals.report.sources import find_metrics

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            json.dumps({"step": 0, "time": 0.0, "metrics": {"train/loss": 1.0}}) + "\n"
        )
    with pytest.raises(
        FileNotFoundError, match=r"2 run folders below it hold a metrics.jsonl: .*a, .*b; a report"
    ) as raised:
        find_metrics(tmp_path)
    assert f"{tmp_path / 'a'}, {tmp_path / 'b'};" in str(raised.value)
    assert find_metrics(tmp_path / "b") == tmp_path / "b" / "metrics.jsonl"


def test_event_files_and_a_csv_of_different_run_folders_are_an_error_naming_both(
    tmp_path: Path, capsys
) -> None:
    # lightning_logs/version_0 written by a TensorBoardLogger, version_1 by a CSVLogger (two
    # fits, or one Trainer with both loggers: Lightning 2.6 gives each its own version_N).
    # The report silently showed version_0's event files; it must name both folders.
    pytest.importorskip("tensorboard")
    from trainvitals.cli import main
    from trainvitals.report.sources import find_metrics

    logs = tmp_path / "lightning_logs"
    tb_points = [(s, 10.0 + s) for s in range(3)]
    write_tensorboard(logs / "version_0", tb_points)
    (logs / "version_1").mkdir()
    (logs / "version_1" / "metrics.csv").write_text("step,train/loss\n0,0.5\n1,0.25\n")
    for given in (logs, tmp_path):
        with pytest.raises(FileNotFoundError, match="different run folders") as raised:
            find_metrics(given)
        message = str(raised.value)
        assert f"{logs / 'version_0'} (TensorBoard event files)" in message
        assert f"{logs / 'version_1'} (a metrics.csv)" in message
    assert main(["report", str(logs), "-o", str(tmp_path / "r.html")]) == 2
    assert "version_1 (a metrics.csv)" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    # each folder given is its own run
    assert find_metrics(logs / "version_0") == logs / "version_0"
    src = load_metrics(logs / "version_0", lambda key: True, None, None)
    assert points_of(src.values, "train/loss") == tb_points  # small integers: float32-exact
    assert find_metrics(logs / "version_1") == logs / "version_1" / "metrics.csv"
    src = load_metrics(logs / "version_1" / "metrics.csv", lambda key: True, None, None)
    assert points_of(src.values, "train/loss") == [(0, 0.5), (1, 0.25)]

    # One run's loggers in one folder (both given version=2), or the CSV in a folder inside
    # the one of the event files: one run, its event files read first as before.
    same = tmp_path / "same" / "version_2"
    write_tensorboard(same, tb_points)
    (same / "metrics.csv").write_text("step,train/loss\n0,0.5\n")
    assert find_metrics(same.parent) == same
    inside = tmp_path / "inside" / "run"
    write_tensorboard(inside, tb_points)
    (inside / "csv").mkdir()
    (inside / "csv" / "metrics.csv").write_text("step,train/loss\n0,0.5\n")
    assert find_metrics(inside.parent) == inside


def test_a_metrics_jsonl_and_event_files_of_different_run_folders_are_an_error(
    tmp_path: Path,
) -> None:
    # runs/a wrote JSONL only, runs/b TensorBoard only: the report showed b's event files.
    pytest.importorskip("tensorboard")
    from trainvitals.report.sources import find_metrics

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "time": 0.0, "metrics": {"train/loss": 1.0}}) + "\n"
    )
    write_tensorboard(tmp_path / "b" / "tb", [(0, 2.0)])
    with pytest.raises(FileNotFoundError, match="different run folders") as raised:
        find_metrics(tmp_path)
    message = str(raised.value)
    assert f"{tmp_path / 'a'} (a metrics.jsonl), {tmp_path / 'b' / 'tb'} (TensorBoard" in message
    assert find_metrics(tmp_path / "b") == tmp_path / "b" / "tb"
    assert find_metrics(tmp_path / "a") == tmp_path / "a" / "metrics.jsonl"


def test_each_name_of_summary_writer_add_scalars_is_a_key_of_its_own(tmp_path: Path) -> None:
    # SummaryWriter.add_scalars(main_tag, {name: value}, step), which Lightning's
    # TensorBoardLogger and Accelerate's tensorboard tracker call for a dict value, writes each
    # name to a folder "<main_tag>_<name>" under the one tag main_tag. Keyed by the tag alone,
    # the names fell on one key and the folder read last hid the others: "lr" showed
    # group1's values (0.2 s) as the learning rate, group0's (0.1 s) were gone.
    pytest.importorskip("tensorboard")
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    from trainvitals.report.sources import find_metrics

    run = tmp_path / "run"
    want: dict[str, list[tuple[int, float]]] = {}
    with SummaryWriter(run) as writer:
        for s in range(5):
            logged = {
                "train/loss": 1.0 / (s + 1),
                "lr": {"group0": 0.1 * s, "group1": 0.2 * s},
                "loss/split": {"train": 1.0 + s, "val": 2.0 + s},
            }
            for tag, value in logged.items():
                if isinstance(value, dict):
                    writer.add_scalars(tag, value, s)
                    for name, v in value.items():
                        want.setdefault(f"{tag}/{name}", []).append((s, float(np.float32(v))))
                else:
                    writer.add_scalar(tag, value, s)
                    want.setdefault(tag, []).append((s, float(np.float32(value))))
    assert find_metrics(run) == run
    for given in (run, tmp_path):  # found, and --metrics naming a folder above the run's
        src = load_metrics(given, lambda key: True, None, None)
        assert sorted(src.values) == sorted(want)  # lr/group0, lr/group1, loss/split/train, ...
        for key, points in want.items():
            assert points_of(src.values, key) == points, key


def test_metrics_naming_a_folder_of_several_tensorboard_runs_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by the report, lightning_logs/ holding version_0 and version_1 is an error naming
    # them; named by --metrics it was read as one run: version_1's steps 0..4 hid all of
    # version_0's (train/loss 10..14 shown, 0..2 gone), one run's numbers shown as the other's.
    pytest.importorskip("tensorboard")
    from trainvitals.cli import main

    logs = tmp_path / "lightning_logs"
    for v in range(2):
        write_tensorboard(logs / f"version_{v}", [(s, 10.0 * v + s) for s in range(3 + 2 * v)])
    with pytest.raises(FileNotFoundError, match="event files of 2 run folders") as info:
        load_metrics(logs, lambda key: True, None, None)
    assert "version_0" in str(info.value) and "version_1" in str(info.value)
    status = main(["report", str(tmp_path), "--metrics", str(logs), "-o", str(tmp_path / "r.html")])
    assert status == 2 and "2 run folders" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    src = load_metrics(logs / "version_0", lambda key: True, None, None)  # one run: its values
    assert points_of(src.values, "train/loss") == [(s, float(s)) for s in range(3)]


def test_wall_times_cost_eight_bytes_a_point(tmp_path: Path) -> None:
    # A long run's report holds one wall time per point read (the span it shows): boxed Python
    # floats in a list cost 32 bytes each (pointer + object), a float64 array 8. Measured with
    # tracemalloc on what load_metrics keeps: steps (8) + values (8) + times (8) a point.
    import tracemalloc

    n = 40_000
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"step": s, "time": 1e9 + s / 7, "metrics": {"loss": s / 3}}) + "\n"
            for s in range(n)
        )
    )
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        src = load_metrics(path, lambda key: True, None, None)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(src.times) == n and min(src.times) == 1e9 and max(src.times) == 1e9 + (n - 1) / 7
    assert kept / n < 30, f"{kept / n:.1f} bytes a point"
