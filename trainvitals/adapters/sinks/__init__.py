"""The writer's sinks, one module per backend; backends are imported when a sink first writes."""

from trainvitals.adapters.sinks.base import (
    COMET_KEYS,
    MLFLOW_KEYS,
    WANDB_KEYS,
    WANDB_SHARED_KEYS,
    KeyRule,
    Sink,
    StepRefused,
    unmap_key,
)
from trainvitals.adapters.sinks.comet import CometSink
from trainvitals.adapters.sinks.framework import LightningLoggerSink, TrackerSink
from trainvitals.adapters.sinks.jsonl import JsonlSink
from trainvitals.adapters.sinks.mlflow import MLflowSink
from trainvitals.adapters.sinks.tensorboard import TensorBoardSink
from trainvitals.adapters.sinks.wandb import WandbSink

__all__ = [
    "COMET_KEYS",
    "MLFLOW_KEYS",
    "WANDB_KEYS",
    "WANDB_SHARED_KEYS",
    "CometSink",
    "JsonlSink",
    "KeyRule",
    "LightningLoggerSink",
    "MLflowSink",
    "Sink",
    "StepRefused",
    "TensorBoardSink",
    "TrackerSink",
    "WandbSink",
    "unmap_key",
]
