"""The key-mapping rule: identity where accepted, valid for the backend, injective, reversible."""

from __future__ import annotations

import random
import re

import pytest

from trainvitals.adapters.sinks.base import MLFLOW_KEYS, WANDB_KEYS, KeyRule, unmap_key

# MLflow's own checks, written out here so the test does not depend on MLflow internals moving:
# the Windows variant of mlflow.utils.validation.validate_param_and_metric_name (the stricter
# one: no colon), path_not_unique, and MAX_ENTITY_KEY_LENGTH.
_MLFLOW_CHARS = re.compile(r"^[/\w.\- ]*$")


def mlflow_accepts(name: str) -> bool:
    import posixpath

    norm = posixpath.normpath(name)
    path_ok = not (norm != name or norm == "." or norm.startswith("..") or norm.startswith("/"))
    return bool(_MLFLOW_CHARS.match(name)) and name.isascii() and path_ok and len(name) <= 250


def test_mlflow_own_validators_agree_with_the_copy_above() -> None:
    from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

    for name in ["a/b", "a//b", "/a", "a/", "..a", "a/./b", "a:b", "a b", "x[0]", "a.b-c_d"]:
        ours = mlflow_accepts(name)
        theirs = bool(validate_param_and_metric_name(name)) and not path_not_unique(name)
        # ours is stricter only about the colon (refused by MLflow servers on Windows)
        assert ours == theirs or (":" in name and not ours), name


@pytest.mark.parametrize(
    "key",
    [
        "moe/load_balancing_loss",
        "moe/layer_3/cv",
        "throughput/device/tokens_per_sec",
        "l2_norm/grad/global",
        "lm loss",
        "lr-Adam",
        "decoder.layers.3.mlp",
        "my_xylophone",  # "_x" followed by non-hex letters is not an escape
        "grad_xY12",  # upper-case hex is not an escape
        "a...b",
        "time/remaining_hours",
    ],
)
def test_keys_mlflow_accepts_are_unchanged(key: str) -> None:
    assert mlflow_accepts(key)
    assert MLFLOW_KEYS.map(key) == key
    assert WANDB_KEYS.map(key) == key


@pytest.mark.parametrize(
    ("key", "mapped"),
    [
        ("loss[0]", "loss_x5b0_x5d"),
        ("a:b", "a_x3ab"),
        ("grad%", "grad_x25"),
        ("/abs", "_x2fabs"),
        ("trailing/", "trailing_x2f"),
        ("a//b", "a_x2f/b"),
        ("a/./b", "a/_x2e/b"),
        ("a/../b", "a/_x2e./b"),
        ("..up", "_x2e.up"),
        (".", "_x2e"),
        ("idx_x1f", "idx_x5fx1f"),  # a literal "_x1f" would read as an escape
        ("temp°C", "temp_xc2_xb0C"),  # UTF-8 bytes of the degree sign
    ],
)
def test_mlflow_mapping_examples(key: str, mapped: str) -> None:
    assert MLFLOW_KEYS.map(key) == mapped
    assert mlflow_accepts(mapped)
    assert unmap_key(mapped) == key


@pytest.mark.parametrize(
    ("key", "mapped"),
    [
        ("_step", "_x5fstep"),
        ("_runtime", "_x5fruntime"),
        ("_timestamp", "_x5ftimestamp"),
        ("_wandb", "_x5fwandb"),
        ("_wandb_extra", "_x5fwandb_extra"),
        ("_other", "_other"),
        ("_x5fstep", "_x5fx5fstep"),  # the user's own "_x5fstep" differs from the mapped _step
        ("loss[0]", "loss[0]"),
    ],
)
def test_wandb_mapping_examples(key: str, mapped: str) -> None:
    assert WANDB_KEYS.map(key) == mapped
    assert unmap_key(mapped) == key


def _random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [*"ab_x5f2e/ .:-[]%é", "_x", "_x2", "/", "..", "_x5f"]
    return list(
        {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(n)}
    )


def test_mapping_is_valid_injective_and_reversible_on_random_tricky_keys() -> None:
    keys = _random_keys(20000, seed=0)
    for rule in (MLFLOW_KEYS, WANDB_KEYS):
        mapped = {}
        for key in keys:
            m = rule.map(key)
            assert unmap_key(m) == key, (rule, key, m)
            assert mapped.setdefault(m, key) == key, f"{rule}: {key!r} and {mapped[m]!r} -> {m!r}"
            if rule is MLFLOW_KEYS:
                assert mlflow_accepts(m), (key, m)
        assert len(mapped) == len(keys)


def test_long_keys_are_cut_with_a_hash_and_do_not_collide() -> None:
    base = "moe/" + "layer_with_a_long_name/" * 12
    keys = [base + f"{i}" for i in range(100)] + [base + f"[{i}]" for i in range(100)]
    mapped = [MLFLOW_KEYS.map(k) for k in keys]
    assert all(len(m) <= 250 and mlflow_accepts(m) for m in mapped)
    assert len(set(mapped)) == len(keys)
    assert all(m.endswith(m[-12:]) and "_x2d" in m for m in mapped)
    assert unmap_key(mapped[0]) is None  # a cut key cannot be reversed
    # the cut never splits an escape: stripping the mark leaves a decodable prefix
    for m in mapped:
        prefix = m[: m.rindex("_x2d")]
        assert unmap_key(prefix) is not None
    # deterministic: the same key maps to the same name in a fresh rule
    fresh = KeyRule("mlflow", allowed=r"A-Za-z0-9_\-. /", path_safe=True, max_length=250)
    assert [fresh.map(k) for k in keys] == mapped


def test_a_250_character_key_is_kept_and_a_251_character_key_is_cut() -> None:
    assert MLFLOW_KEYS.map("a" * 250) == "a" * 250
    cut = MLFLOW_KEYS.map("a" * 251)
    assert len(cut) <= 250 and cut != "a" * 250 and "_x2d" in cut


def test_mapped_keys_are_accepted_by_a_real_mlflow_store(tmp_path) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    keys = ["loss[0]", "a:b", "/abs", "a//b", "..up", "temp°C", "idx_x1f", "x" * 300, "ok/key"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    run_id = client.create_run(client.create_experiment("keys")).info.run_id
    client.log_batch(run_id, metrics=[Metric(MLFLOW_KEYS.map(k), 1.0, 0, 0) for k in keys])
    stored = set(client.get_run(run_id).data.metrics)
    assert stored == {MLFLOW_KEYS.map(k) for k in keys}
    assert {unmap_key(k) for k in stored} == (set(keys) - {"x" * 300}) | {None}
