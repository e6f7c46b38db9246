"""Suite-wide settings: callbacks re-raise instead of disabling themselves, backends stay offline."""

import os

import pytest

os.environ.setdefault("TRAINVITALS_STRICT", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("COMET_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _fresh_moe_metrics_tracker():
    """Each test starts with an empty global MoE metrics tracker: routers record into it from
    any forward, and a tracker left by an earlier test (other layer counts) would refuse them."""
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()
