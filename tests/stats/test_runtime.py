"""TrainClock against hand-computed times."""

from __future__ import annotations

from trainvitals.stats.runtime import TrainClock


def test_validation_before_start_is_counted_as_validation_not_training():
    now = [100.0]
    synced = []
    clock = TrainClock(lambda: now[0], lambda: synced.append(now[0]))
    assert clock.read() == {"train": 0.0, "validation": 0.0, "total": 0.0}
    clock.pause()  # an evaluation before training: nothing of training queued, no sync
    now[0] = 140.0
    assert clock.read() == {"train": 0.0, "validation": 40.0, "total": 40.0}
    clock.resume()  # t=140: its own queued work is waited for
    now[0] = 145.0  # between the evaluation and the first batch: neither
    assert clock.read() == {"train": 0.0, "validation": 40.0, "total": 40.0}
    clock.start()
    now[0] = 155.0
    clock.pause()
    now[0] = 175.0
    clock.resume()
    now[0] = 180.0
    assert clock.read() == {"train": 15.0, "validation": 60.0, "total": 75.0}
    assert clock.train_seconds() == 15.0  # what ThroughputMonitor reads: unchanged
    assert synced == [140.0, 155.0, 175.0]


def test_start_inside_a_validation_ends_it():
    now = [0.0]
    clock = TrainClock(lambda: now[0])
    clock.pause()
    now[0] = 10.0
    clock.start()  # a training batch: the validation before it is over
    now[0] = 12.0
    assert clock.read() == {"train": 2.0, "validation": 10.0, "total": 12.0}
    assert not clock.paused
