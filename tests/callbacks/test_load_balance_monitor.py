"""LoadBalanceMonitor end to end: the numbers it writes against an independent float64
computation on the routers' own routing maps, over micro-batches, steps and ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import tiny_moe_lm
from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from tests.scripts.vitals_testing import quiet_trainer
from tests.stats.test_load_balance_stats import _reference
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.stats.load_balance import UTILIZATION_QUANTILES

VOCAB = 32


@pytest.fixture(autouse=True)
def _fresh_moe_tracker():
    """TinyMoELM's routers record into the global MoE tracker: start each test without one."""
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def tiny_lm(num_layers: int = 3, seed: int = 0) -> nn.Module:
    return tiny_moe_lm(seed, vocab_size=VOCAB, num_layers=num_layers)


class MapRecorder:
    """The routers' own routing maps and aux losses per training forward (independent hooks)."""

    def __init__(self, model: nn.Module) -> None:
        from trainvitals.moe import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.maps: list[list[np.ndarray]] = [[] for _ in self.routers]
        self.aux: list[list[float]] = [[] for _ in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(m: nn.Module, inp: Any, out: Any) -> None:
            if m.training and torch.is_grad_enabled():
                self.maps[i].append(out[1].numpy().copy())
                self.aux[i].append(float(m.last_aux_loss))

        return hook

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        loads = np.stack([np.concatenate(m).sum(0) for m in self.maps]).astype(np.float64)
        aux = np.array([np.mean(a) for a in self.aux])
        self.maps = [[] for _ in self.routers]
        self.aux = [[] for _ in self.routers]
        return loads, aux


def expected_keys(
    loads: np.ndarray, labels: list[str], aux: np.ndarray | None, top_k: int
) -> dict[str, float]:
    ref = _reference(loads)
    out: dict[str, float] = {}
    for metric in ("cv", "dead_expert_frac", "expert_diversity", "max_overload_factor"):
        v = ref[metric][~np.isnan(ref[metric])]
        out.update(
            {
                f"moe/{metric}_mean": v.mean(),
                f"moe/{metric}_median": np.median(v),
                f"moe/{metric}_min": v.min(),
                f"moe/{metric}_max": v.max(),
            }
        )
    if aux is not None:
        out.update(
            {
                "moe/aux_loss_mean": aux.mean(),
                "moe/aux_loss_median": np.median(aux),
                "moe/aux_loss_min": aux.min(),
                "moe/aux_loss_max": aux.max(),
            }
        )
    util = loads / (loads.sum(1, keepdims=True) / loads.shape[1])
    for name, q in UTILIZATION_QUANTILES:
        out[f"moe/expert_utilization_{name}"] = np.quantile(util, q)
    for i, label in enumerate(labels):
        for metric, values in ref.items():
            out[f"moe/layer_{label}/{metric}"] = values[i]
        for e in range(loads.shape[1]):
            out[f"moe/layer_{label}/tokens_per_expert/{e}"] = loads[i, e]
        if aux is not None:
            out[f"moe/layer_{label}/aux_loss"] = aux[i]
    return out


def check_row(
    row: dict[str, float],
    loads: np.ndarray,
    labels: list[str],
    aux: np.ndarray | None,
    top_k: int,
    detailed: bool = True,
) -> None:
    expected = expected_keys(loads, labels, aux, top_k)
    if not detailed:
        expected = {k: v for k, v in expected.items() if not k.startswith("moe/layer_")}
    for key, value in expected.items():
        assert key in row, key
        # aux losses: float32 on the device (the router's, or a float32 softmax of its logits)
        rel = 1e-5 if "aux_loss" in key else 1e-9
        assert row[key] == pytest.approx(value, rel=rel, abs=1e-12), key
    # the top/bottom experts: their utilization is right, and they are the extremes
    util = loads / (loads.sum(1, keepdims=True) / loads.shape[1])
    per_expert = {k: v for k, v in row.items() if k.startswith("moe_expert_utilization/")}
    assert 0 < len(per_expert) <= 2 * top_k
    for key, value in per_expert.items():
        layer, expert = key.removeprefix("moe_expert_utilization/layer_").split("_expert_")
        assert value == pytest.approx(util[labels.index(layer), int(expert)], rel=1e-12)
    flat = np.sort(util.reshape(-1))
    assert max(per_expert.values()) == pytest.approx(flat[-1])
    assert min(per_expert.values()) == pytest.approx(flat[0])
    assert sorted(per_expert.values())[-1] >= flat[-top_k] - 1e-12


def test_driver_grad_accumulation_eval_not_counted_reset_each_step() -> None:
    model = tiny_lm()
    maps = MapRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=2).attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    expected: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for step in range(4):
        for _ in range(3):  # three micro-batches per optimizer step
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            vitals.batch(x)
            model(x, labels=x).loss.backward()
        with vitals.validating(), torch.no_grad():
            model.eval()
            model(x)
            model.train()
        model(x)  # a training forward outside the micro-batches: counted (it routes tokens)
        expected[step] = maps.take()
        opt.step()
        opt.zero_grad()
    vitals.close()
    assert sorted(writer.rows) == [0, 2]  # logging steps only
    labels = ["0", "1", "2"]
    for step in (0, 2):
        loads, aux = expected[step]
        # k * tokens of the 3 micro-batches and the extra training forward, in every layer
        assert (loads.sum(1) == 2 * (3 * 12 + 12)).all()
        check_row(writer.rows[step], loads, labels, aux, top_k=2)
    # counts of step 1 did not leak into step 2 (reset at every step end)
    assert writer.rows[2]["moe/layer_0/tokens_per_expert/0"] == expected[2][0][0, 0]


def test_brief_mode_keys_and_real_jsonl_writer(tmp_path: Path) -> None:
    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

    model = tiny_lm(num_layers=2)
    maps = MapRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], rank=0)
    vitals = Vitals([LoadBalanceMonitor(top_k=1)], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    x = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(0))
    vitals.batch(x)
    model(x, labels=x).loss.backward()
    loads, aux = maps.take()
    opt.step()
    vitals.close()
    writer.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    row = {k: v for r in records if r["step"] == 0 for k, v in r["metrics"].items()}
    assert not any(k.startswith("moe/layer_") for k in row)
    check_row(row, loads, ["0", "1"], aux, top_k=1, detailed=False)
    assert row["moe/dead_experts_persistent"] == 0


# ---------------------------------------------------------------------- dead experts, state


class FixedGate(nn.Module):
    """Routes token t to expert t % 3: expert 3 of 4 never gets a token."""

    num_experts = 4

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w(x), torch.arange(x.shape[0]) % 3


def _gate_counts(module: nn.Module, inputs: Any, output: Any) -> torch.Tensor:
    return torch.zeros(4).index_add_(0, output[1], torch.ones(output[1].numel()))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"gate": FixedGate()}) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b["gate"](x)[0].sum() for b in self.layers)


def _run_gated(
    monitor: LoadBalanceMonitor, steps: int, writer: Recorder, log_every: int = 2
) -> list[int]:
    """Run ``steps`` steps; return the steps at which a dead-expert warning was raised."""
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=log_every).attach(model, opt)
    warned = []
    for step in range(steps):
        vitals.batch()
        model(torch.randn(6, 2)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if any("consecutive logging steps" in str(w.message) for w in caught):
            message = next(str(w.message) for w in caught if "consecutive" in str(w.message))
            assert "layer 0 expert 3" in message and "layer 1 expert 3" in message
            warned.append(step)
    vitals.close()
    return warned


def test_dead_expert_warning_after_patience_and_resume() -> None:
    writer = Recorder()
    monitor = LoadBalanceMonitor(
        mode="detailed", dead_expert_patience=3, extractors=[(FixedGate, _gate_counts)]
    )
    # logging steps 0, 2, 4, 6: the third consecutive dead logging step is step 4
    assert _run_gated(monitor, 7, writer) == [4]
    assert [writer.rows[s]["moe/dead_experts_persistent"] for s in (0, 2, 4, 6)] == [0, 0, 2, 2]
    assert writer.rows[0]["moe/layer_0/dead_expert_frac"] == 0.25
    assert writer.rows[0]["moe/layer_1/tokens_per_expert/3"] == 0.0

    # resume after two dead logging steps: the streak continues, the warning comes one step in
    first = LoadBalanceMonitor(dead_expert_patience=3, extractors=[(FixedGate, _gate_counts)])
    assert _run_gated(first, 3, Recorder()) == []
    state = json.loads(json.dumps(first.state_dict()))
    resumed = LoadBalanceMonitor(dead_expert_patience=3, extractors=[(FixedGate, _gate_counts)])
    resumed.load_state_dict(state)
    assert _run_gated(resumed, 1, Recorder()) == [0]


class PartlyGated(nn.Module):
    """Two FixedGate layers; layer 1 is skipped on the steps in ``skip``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"gate": FixedGate()}) for _ in range(2)])

    def forward(self, x: torch.Tensor, run: tuple[bool, bool]) -> torch.Tensor:
        return sum(b["gate"](x)[0].sum() for b, on in zip(self.layers, run, strict=True) if on)


def test_persistent_dead_count_keeps_streaks_of_layers_that_routed_nothing() -> None:
    # Which layers route tokens at each (logging) step: layer 1 sits out step 2, and step 4
    # routes nothing at all (an empty step).
    runs = [(True, True), (True, True), (True, False), (True, True), (False, False)]
    patience = 2
    model = PartlyGated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(
        dead_expert_patience=patience, extractors=[(FixedGate, _gate_counts)]
    )
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for run in runs:
            vitals.batch()
            x = torch.randn(6, 2)
            (model(x, run) + sum(p.sum() for p in model.parameters())).backward()
            opt.step()
            opt.zero_grad()
    vitals.close()
    # Independent: a layer that ran gives loads [2, 2, 2, 0] (token t -> expert t % 3); a
    # layer that did not run is no evidence, so its streaks are kept, and still counted.
    streaks = np.zeros((2, 4), dtype=int)
    for step, run in enumerate(runs):
        for layer, on in enumerate(run):
            if on:
                loads = np.bincount(np.arange(6) % 3, minlength=4)
                streaks[layer] = np.where(loads == 0, streaks[layer] + 1, 0)
        expected = int((streaks >= patience).sum())
        assert writer.rows[step]["moe/dead_experts_persistent"] == expected, step
    # the empty step wrote nothing else (no NaN, no misleading 0 for the balance metrics)
    assert set(writer.rows[4]) == {"moe/dead_experts_persistent"}
    assert writer.rows[4]["moe/dead_experts_persistent"] == 2


def test_state_of_other_expert_count_loaded_mid_run_keeps_logging() -> None:
    # A state whose streaks have another number of experts (e.g. from a model before its
    # experts were changed), loaded after run_start: the monitor must go on (it used to raise
    # IndexError in step_end, which disabled it for the rest of the run).
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(dead_expert_patience=2, extractors=[(FixedGate, _gate_counts)])
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            vitals.batch()
            model(torch.randn(6, 2)).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                state = {"dead_streak": {"0": [1, 1], "1": [5] * 8}}
                vitals.load_state_dict({"step": 1, "callbacks": {monitor.state_key: state}})
    vitals.close()
    assert not any("disabled" in str(w.message) for w in caught)
    assert sorted(writer.rows) == [0, 1, 2]
    # the mismatched streaks restart at step 1: expert 3 of each layer is dead for 2 steps
    # (steps 1 and 2), which reaches the patience at step 2
    assert [writer.rows[s]["moe/dead_experts_persistent"] for s in (1, 2)] == [0, 2]


def test_not_measured_step_keeps_dead_streaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A logging step whose loads come back NaN (on accelerators, what the reduction gives
    every rank when a peer rank's callback failed: trainvitals.distributed._check_mark) is no
    evidence about dead experts: the streaks are kept, as for a layer that routed nothing, and
    the step writes nothing."""
    from trainvitals.moe.capture import RouterCapture

    not_measured = {1}
    read_host = RouterCapture.read_host
    calls: list[int] = []

    def read_host_nan_at_some_steps(self: RouterCapture) -> Any:
        rows, aux_sum, aux_count = read_host(self)
        calls.append(len(calls))  # one read per logging step (every step logs here)
        if calls[-1] in not_measured:
            nan = float("nan")
            rows = [[nan] * len(r) for r in rows]
            aux_sum, aux_count = [nan] * len(aux_sum), [nan] * len(aux_count)
        return rows, aux_sum, aux_count

    monkeypatch.setattr(RouterCapture, "read_host", read_host_nan_at_some_steps)
    patience, steps = 2, 4
    writer = Recorder()
    monitor = LoadBalanceMonitor(
        dead_expert_patience=patience, extractors=[(FixedGate, _gate_counts)]
    )
    _run_gated(monitor, steps, writer, log_every=1)
    # Independent: both layers get loads [2, 2, 2, 0] (token t -> expert t % 3) on measured
    # steps; a step not measured leaves the streaks as they are.
    streaks = np.zeros((2, 4), dtype=int)
    for step in range(steps):
        if step not in not_measured:
            loads = np.bincount(np.arange(6) % 3, minlength=4)
            streaks = np.where(loads == 0, streaks + 1, 0)
        expected = int((streaks >= patience).sum())
        if step in not_measured:
            # nothing written, not even the count (no NaN, no stale value; as on several
            # ranks, where no rank writes a step that no layer measured)
            assert step not in writer.rows
        else:
            assert writer.rows[step]["moe/dead_experts_persistent"] == expected, step


class AuxGate(nn.Module):
    """A router whose counts and aux loss in its next forwards are set by the test."""

    num_experts = 4

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 1)
        self.counts = torch.zeros(4)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


def _aux_gate_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    return module.counts.clone(), module.aux


def test_nan_aux_loss_is_written_not_hidden_by_the_other_layers() -> None:
    """A layer whose aux loss is NaN (a diverged router) shows as NaN, and the aggregates are
    those of numpy over the layers that report an aux loss (NaN then), not the aggregates
    of the other layers; a layer that reports none is left out."""
    nan = float("nan")
    # aux loss per step, layer and micro-batch; None: the layer reports no aux loss
    aux_losses = [
        [[1.0, 1.25], [nan, 1.5], [None, None]],  # layer 1 diverges in one micro-batch
        [[1.0, 1.125], [1.5, 2.0], [None, None]],
    ]
    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleDict({"gate": AuxGate()}) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", extractors=[(AuxGate, _aux_gate_output)])
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    x = torch.randn(3, 2)
    for per_layer in aux_losses:
        for micro_batch in range(2):
            vitals.batch()
            loss = torch.zeros(())
            for block, values in zip(model.layers, per_layer, strict=True):
                gate = block["gate"]
                gate.counts = torch.tensor([1.0, 2.0, 3.0, 4.0])
                value = values[micro_batch]
                gate.aux = None if value is None else torch.tensor(value, dtype=torch.float64)
                loss = loss + gate(x).sum()
            loss.backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    for step, per_layer in enumerate(aux_losses):
        row = writer.rows[step]
        # independent: numpy means over the micro-batches, then over the reporting layers
        layers = {str(i): np.mean(v) for i, v in enumerate(per_layer) if v[0] is not None}
        values = np.array(list(layers.values()))
        expected = {f"moe/layer_{label}/aux_loss": v for label, v in layers.items()}
        expected |= {
            "moe/aux_loss_mean": np.mean(values),
            "moe/aux_loss_median": np.median(values),
            "moe/aux_loss_min": np.min(values),
            "moe/aux_loss_max": np.max(values),
        }
        for key, value in expected.items():
            assert key in row, (step, key)
            np.testing.assert_allclose(row[key], value, rtol=1e-12, err_msg=f"{step} {key}")
        assert "moe/layer_2/aux_loss" not in row
    assert np.isnan(writer.rows[0]["moe/aux_loss_mean"])


def test_no_router_and_bad_arguments() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([LoadBalanceMonitor()], writer=Recorder()).attach(model, opt)
    with pytest.raises(
        ValueError, match=r"found no router in Linear.*MixtralTopKRouter.*tokens_per_expert"
    ):
        vitals.batch()
    with pytest.raises(ValueError, match="mode"):
        LoadBalanceMonitor(mode="verbose")
    with pytest.raises(ValueError, match="top_k"):
        LoadBalanceMonitor(top_k=-1)
    with pytest.raises(ValueError, match="dead_expert_patience"):
        LoadBalanceMonitor(dead_expert_patience=0)


# ---------------------------------------------------------------------- several ranks


# ----------------------------------------------------------- ranks shared by the 2-rank cases
# (tests/helpers/shared_ranks.py: one set of gloo processes runs them in turn)

shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()


def _on_fresh_tracker(rank: int, world_size: int, body: Any, *args: Any) -> dict[str, Any]:
    """``body`` on an empty global MoE metrics tracker, left empty for the next case (routers
    record into it; one left by another case, with other layer counts, would refuse them)."""
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    try:
        return body(rank, world_size, *args)
    finally:
        destroy_moe_metrics_tracker()


def _ddp_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from trainvitals.distributed import ProcessGroups, collective_counter

    model = tiny_lm(num_layers=12)  # same weights on every rank
    maps = MapRecorder(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=3)
    vitals = Vitals([monitor], writer=writer, groups=ProcessGroups.world(), log_every_n_steps=2)
    vitals.attach(ddp, opt)
    gen = torch.Generator().manual_seed(100 + rank)  # different tokens on each rank
    local: dict[int, list] = {}
    collectives: dict[int, int] = {}
    for step in range(3):
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 5 + rank), generator=gen)
            vitals.batch(x)
            ddp(x, labels=x).loss.backward()
        loads, aux = maps.take()
        local[step] = [loads.tolist(), aux.tolist()]
        before = sum(collective_counter.values())
        opt.step()  # step_end runs in the optimizer's post-hook
        collectives[step] = sum(collective_counter.values()) - before
        opt.zero_grad()
    vitals.close()
    return {
        "rows": writer.rows,
        "local": local,
        "collectives": collectives,
        "labels": monitor.capture.layer_labels,
    }


@pytest.mark.slow
@shared.on_ranks(2, _on_fresh_tracker, _ddp_body)
def test_two_gloo_ranks_sum_loads_in_one_collective(ran) -> None:
    _, results = ran
    labels = results[0]["labels"]
    assert labels == [str(i) for i in range(12)]  # DDP's "module." prefix, numeric order
    # one all-reduce on logging steps (0, 2) whatever the number of layers, none otherwise
    for r in results:
        assert r["collectives"] == {0: 1, 1: 0, 2: 1}
    for step in (0, 2):
        loads = sum(np.array(r["local"][step][0]) for r in results)
        # aux: mean over every micro-batch of every rank (each rank ran 2)
        aux = sum(np.array(r["local"][step][1]) for r in results) / 2
        for r in results:  # every rank computed the same reduced numbers
            check_row(r["rows"][step], loads, labels, aux, top_k=3)
    assert sorted(results[0]["rows"]) == [0, 2]


def _lightning_body(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_lm(num_layers=2)
            self.maps = MapRecorder(self.model)
            self.local: dict[int, list] = {}

        def training_step(self, batch, batch_idx):
            return self.model(batch[0], labels=batch[0]).loss

        def validation_step(self, batch, batch_idx):
            self.model(batch[0])  # eval forwards: must not be counted

        def on_before_optimizer_step(self, optimizer):
            loads, aux = self.maps.take()
            self.local[self.trainer.global_step] = [loads.tolist(), aux.tolist()]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randint(0, VOCAB, (16, 6), generator=torch.Generator().manual_seed(7))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)
    writer = Recorder()
    module = Lit()
    trainer = quiet_trainer(
        devices=world_size,
        strategy="ddp",
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        limit_val_batches=2,
        callbacks=[LoadBalanceMonitor(mode="detailed", top_k=2, writer=writer)],
        default_root_dir=out_dir,
    )
    trainer.fit(module, loader, loader)
    return {"rows": writer.rows, "local": module.local}


@pytest.mark.slow
@shared.on_ranks(2, _on_fresh_tracker, _lightning_body, CASE_DIR, needs="lightning")
def test_lightning_ddp_two_devices_accumulation_and_validation(ran) -> None:
    pytest.importorskip("lightning.pytorch")
    _, results = ran
    for step in range(4):
        loads = sum(np.array(r["local"][step][0]) for r in results)
        aux = sum(np.array(r["local"][step][1]) for r in results) / 2
        # 2 micro-batches of 2 x 6 tokens on each of 2 ranks, top-2
        assert (loads.sum(1) == 2 * 2 * 2 * 12).all()
        for r in results:
            check_row(r["rows"][step], loads, ["0", "1"], aux, top_k=2)


def test_non_logging_steps_read_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a non-logging step neither the capture nor the monitor reads a tensor back."""
    model = tiny_lm(num_layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals([LoadBalanceMonitor(mode="detailed")], writer=writer, log_every_n_steps=3)
    vitals.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy")}

    def forbid(name: str):
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    for step in range(4):
        logging = step % 3 == 0
        if not logging:
            for name in originals:
                monkeypatch.setattr(torch.Tensor, name, forbid(name))
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            vitals.batch(x)
            model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        monkeypatch.undo()
        assert reads == [], f"step {step} read tensors back: {reads}"
    vitals.close()
    assert sorted(writer.rows) == [0, 3]


# ---------------------------------------------------------------------- pipeline stages


class Stage(nn.Module):
    """One pipeline stage of a 4-layer TinyMoELM: layers ``keep`` under their global names
    (``layers.<i>``), or renumbered from 0 (``local_names``, Megatron's stage-local numbering)."""

    def __init__(self, keep: list[int], moe_layers: list[int], local_names: bool) -> None:
        super().__init__()
        full = tiny_lm(num_layers=4) if moe_layers == [0, 1, 2, 3] else _lm_with(moe_layers)
        self.embed = full.embed
        names = [str(j) for j in range(len(keep))] if local_names else [str(i) for i in keep]
        self.layers = nn.ModuleDict({n: full.layers[i] for n, i in zip(names, keep, strict=True)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers.values():
            h = block(h)
        return h.pow(2).mean()


def _lm_with(moe_layers: list[int]) -> nn.Module:
    pattern = [int(i in moe_layers) for i in range(4)]
    return tiny_moe_lm(vocab_size=VOCAB, num_layers=4, moe_layer_freq=pattern)


def _pipeline_body(rank: int, world_size: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups, collective_counter

    dp_size = world_size // 2
    pp_rank, dp_rank = divmod(rank, dp_size)
    # every rank creates every group, in the same order
    pp_groups = [dist.new_group([p * dp_size + d for p in range(2)]) for d in range(dp_size)]
    dp_groups = [dist.new_group([p * dp_size + d for d in range(dp_size)]) for p in range(2)]
    groups = ProcessGroups(dp=dp_groups[pp_rank] if dp_size > 1 else None, pp=pp_groups[dp_rank])
    keep = [0, 1] if pp_rank == 0 else [2, 3]
    moe_layers = [2, 3] if case == "dense_first_stage" else [0, 1, 2, 3]
    model = Stage(keep, moe_layers, local_names=case == "local_names")
    maps = MapRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals(
        [LoadBalanceMonitor(mode="detailed", top_k=2)],
        writer=writer,
        groups=groups,
        log_every_n_steps=2,
    ).attach(model, opt)
    gen = torch.Generator().manual_seed(10 + rank)
    local: dict[int, list] = {}
    collectives: dict[int, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for _ in range(2):
                x = torch.randint(0, VOCAB, (2, 6), generator=gen)
                vitals.batch(x)
                model(x).backward()
            local[step] = [a.tolist() for a in maps.take()] if maps.routers else []
            before = sum(collective_counter.values())
            opt.step()
            collectives[step] = sum(collective_counter.values()) - before
            opt.zero_grad()
    vitals.close()
    return {
        "rows": writer.rows,
        "local": local,
        "collectives": collectives,
        "pp_rank": pp_rank,
        "warned": [str(w.message) for w in caught if "pipeline stages" in str(w.message)],
    }


PIPELINE_CASES = [("global_names", 4), ("local_names", 2), ("dense_first_stage", 2)]


def _pipeline_cases(test):
    for case, world_size in PIPELINE_CASES:
        param = f"{case}-{world_size}"
        test = shared.on_ranks(world_size, _on_fresh_tracker, _pipeline_body, case, param=param)(
            test
        )
    return test


@pytest.mark.slow
@_pipeline_cases
@pytest.mark.parametrize(("case", "world_size"), PIPELINE_CASES)
def test_pipeline_stages_report_every_layer(case: str, world_size: int, ran) -> None:
    _, results = ran
    dp_size = world_size // 2
    if case == "local_names":
        labels = ["pp0_0", "pp0_1", "pp1_0", "pp1_1"]  # the full model's order: stage, then number
        assert all(r["warned"] for r in results)
    else:
        labels = ["2", "3"] if case == "dense_first_stage" else ["0", "1", "2", "3"]
        assert not any(r["warned"] for r in results)
    group_count = 2 if dp_size > 1 else 1  # one SUM per group: dp (when > 1 rank) and pp
    for step in (0, 2):
        # rows of each stage summed over its data-parallel ranks, stages stacked
        # (aux: mean over the micro-batches of every data-parallel rank of the stage)
        per_stage = {}
        for p in (0, 1):
            mine = [r["local"][step] for r in results if r["pp_rank"] == p and r["local"][step]]
            if mine:
                per_stage[p] = (
                    sum(np.array(m[0]) for m in mine),
                    sum(np.array(m[1]) for m in mine) / dp_size,
                )
        if case == "local_names":  # stage 0's layers, then stage 1's: pp0_0, pp0_1, pp1_0, pp1_1
            order = [(0, 0), (0, 1), (1, 0), (1, 1)]
            loads = np.stack([per_stage[p][0][i] for p, i in order])
            aux = np.array([per_stage[p][1][i] for p, i in order])
        else:
            loads = np.concatenate([v[0] for v in per_stage.values()])
            aux = np.concatenate([v[1] for v in per_stage.values()])
        for r in results:  # every rank, of every stage, reports every layer
            check_row(r["rows"][step], loads, labels, aux, top_k=2)
    for r in results:
        assert r["collectives"] == {0: group_count, 1: 0, 2: group_count}


def _hf_step(vitals, model, opt, recorder, seed: int, seq_len: int) -> None:
    """One optimizer step of 2 micro-batches of random tokens (``[2, seq_len]``) through a
    Hugging Face model, the recorder recording; then ``vitals.close()``."""
    from tests.moe.test_router_capture import VOCAB as HF_VOCAB

    gen = torch.Generator().manual_seed(seed)
    recorder.recording = True
    for _ in range(2):
        x = torch.randint(0, HF_VOCAB, (2, seq_len), generator=gen)
        vitals.batch(x)
        model(x).logits.float().pow(2).mean().backward()
    recorder.recording = False
    opt.step()
    vitals.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hugging_face_model_through_the_driver(family: str) -> None:
    pytest.importorskip("transformers")
    from tests.moe.test_router_capture import IndexRecorder, build

    model, router_cls, layers, num_experts = build(family)
    recorder = IndexRecorder(model, router_cls)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = Recorder()
    vitals = Vitals([LoadBalanceMonitor(mode="detailed", top_k=3)], writer=writer)
    vitals.attach(model, opt)
    _hf_step(vitals, model, opt, recorder, seed=5, seq_len=7)
    aux = None if family == "deepseek_v3" else recorder.switch_aux(num_experts)
    row = writer.rows[0]
    check_row(row, recorder.counts(num_experts), [str(x) for x in layers], aux, top_k=3)
    assert ("moe/aux_loss_mean" in row) == (aux is not None)


def _fsdp2_hf_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.moe.test_router_capture import IndexRecorder, build
    from trainvitals.distributed import ProcessGroups

    model, router_cls, layers, num_experts = build("mixtral")
    recorder = IndexRecorder(model, router_cls)  # hooks on the original router instances
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer.mlp.gate, mesh=mesh)  # the router's class becomes FSDPMixtralTopKRouter
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = Recorder()
    vitals = Vitals(
        [LoadBalanceMonitor(mode="detailed", top_k=2)],
        writer=writer,
        groups=ProcessGroups.from_device_mesh(mesh),
    ).attach(model, opt)
    _hf_step(vitals, model, opt, recorder, seed=20 + rank, seq_len=5)
    return {
        "row": writer.rows[0],
        "counts": recorder.counts(num_experts).tolist(),
        "aux": recorder.switch_aux(num_experts).tolist(),
        "class": type(model.model.layers[0].mlp.gate).__name__,
        "labels": [str(x) for x in layers],
    }


@pytest.mark.slow
@shared.on_ranks(2, _on_fresh_tracker, _fsdp2_hf_body, needs="transformers")
def test_fsdp2_hugging_face_two_ranks(ran) -> None:
    pytest.importorskip("transformers")
    _, results = ran
    assert results[0]["class"] == "FSDPMixtralTopKRouter"
    loads = sum(np.array(r["counts"]) for r in results)
    aux = sum(np.array(r["aux"]) for r in results) / 2
    for r in results:
        check_row(r["row"], loads, r["labels"], aux, top_k=2)


def test_key_strings_follow_a_new_layout_and_match_the_set_written() -> None:
    """The key strings are cached per layout: a second run on a model with more layers writes
    that model's keys (and exactly the expected set, nothing stale), checked against the
    independent reference."""
    from trainvitals.moe import destroy_moe_metrics_tracker

    monitor = LoadBalanceMonitor(mode="detailed", top_k=2)
    for num_layers in (2, 3):
        destroy_moe_metrics_tracker()  # the routers' tracker metrics change size too
        model = tiny_lm(num_layers=num_layers, seed=num_layers)
        maps = MapRecorder(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        writer = Recorder()
        vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
        x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(num_layers))
        vitals.batch(x)
        model(x, labels=x).loss.backward()
        loads, aux = maps.take()
        opt.step()
        vitals.close()
        labels = [str(i) for i in range(num_layers)]
        row = writer.rows[0]
        check_row(row, loads, labels, aux, top_k=2)
        expected = set(expected_keys(loads, labels, aux, top_k=2)) | {"moe/dead_experts_persistent"}
        per_expert = {k for k in row if k.startswith("moe_expert_utilization/")}
        assert set(row) - per_expert == expected
