"""Adapters: the fan-out writer and its sinks, and the framework glue around them.

``import trainvitals.adapters`` needs torch only: each backend (tensorboard, mlflow, comet_ml,
wandb, lightning, accelerate) is imported by the sink or constructor that uses it, when it is
first used.

Example::

    from trainvitals.adapters import FanoutWriter, JsonlSink, MLflowSink, TensorBoardSink

    with FanoutWriter([
        TensorBoardSink("runs/demo/tb"),
        MLflowSink(run_dir="runs/demo"),
        JsonlSink("runs/demo/metrics.jsonl"),
    ]) as writer:
        writer.add_scalar("train/loss", 2.3, step=0)
"""

from trainvitals.adapters.fanout_writer import FanoutWriter
from trainvitals.adapters.jsonl import iter_jsonl, metric_history, read_jsonl
from trainvitals.adapters.sinks import (
    CometSink,
    JsonlSink,
    KeyRule,
    LightningLoggerSink,
    MLflowSink,
    Sink,
    StepRefused,
    TensorBoardSink,
    TrackerSink,
    WandbSink,
    unmap_key,
)

__all__ = [
    "CometSink",
    "FanoutWriter",
    "JsonlSink",
    "KeyRule",
    "LightningLoggerSink",
    "MLflowSink",
    "Sink",
    "StepRefused",
    "TensorBoardSink",
    "TrackerSink",
    "WandbSink",
    "iter_jsonl",
    "metric_history",
    "read_jsonl",
    "unmap_key",
]
