"""Suite-wide settings: callbacks re-raise instead of disabling themselves, backends stay offline."""

import os
import sys

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


def _forget_mlflow_tracking_uri() -> None:
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if tracking is not None and hasattr(tracking, "_tracking_uri"):
        tracking._tracking_uri = None


@pytest.fixture(autouse=True)
def _no_process_wide_mlflow_uri():
    """``mlflow.set_tracking_uri`` (Lightning's ``MLFlowLogger`` calls it) is process-wide and
    beats ``MLFLOW_TRACKING_URI``: a test that sets the variable wrote to the store of an
    earlier test's logger (tests/test_driver_resume_and_end.py after
    tests/adapters/test_from_frameworks.py found its MLflow history empty)."""
    _forget_mlflow_tracking_uri()
    yield
    _forget_mlflow_tracking_uri()


@pytest.fixture
def fresh_dynamo():
    """A test that compiles starts and ends with torch.compile's caches cleared: compiled code
    and recompile counts of other tests (``nn.Linear.forward`` is one code object for all)
    must not use up this one's recompile limit, nor this one's theirs."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
