"""MoEMetricsMonitor under the loop driver (gradient accumulation, interval means, nothing on
non-logging steps, 2 gloo ranks) and under Lightning with accumulate_grad_batches=2 and the real
FanoutWriter, against float64 router losses recomputed here from the routers' inputs."""

from __future__ import annotations

import glob
import math
import warnings

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.moe_models import (
    EXPERTS,
    HIDDEN,
    LOSS_COEFFS,
    TOPK,
    VOCAB,
    fresh_tracker_fixture,
    tiny_moe_kwargs,
)
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from tests.scripts.vitals_testing import quiet_trainer
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe import (
    MoEMetricsTracker,
    TinyMoELM,
    TopKRouter,
    set_moe_metrics_tracker,
)
from trainvitals.moe.tiny_model import RandomTokenDataset, random_token_batches

LAYERS = 3
PATTERN = [1, 0, 1]  # blocks 0 and 2 are MoE

fresh_tracker = fresh_tracker_fixture()

MODEL_KW = tiny_moe_kwargs(
    num_layers=LAYERS, ffn_hidden_size=32, moe_layer_freq=PATTERN, **LOSS_COEFFS
)


def tiny_model(seed: int = 0) -> TinyMoELM:
    torch.manual_seed(seed)
    return TinyMoELM(**MODEL_KW)


def step_collectives(opt: torch.optim.Optimizer) -> dict[str, int]:
    """``opt.step()`` (the driver's step end, and a logging step's report, run there), then
    ``opt.zero_grad()``; returns the collectives counted during them, by kind."""
    from trainvitals.distributed import collective_counter

    before = dict(collective_counter)
    opt.step()
    opt.zero_grad()
    return {k: v - before.get(k, 0) for k, v in collective_counter.items() if v != before.get(k, 0)}


def capture_router_inputs(
    model: torch.nn.Module, skip_backward: bool = False
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(0-based layer, input, weight) of every training forward of every router, in float64;
    with ``skip_backward``, not the activation-checkpoint recomputes in the backward pass."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])

            def hook(mod, args, out, layer=layer):
                if skip_backward and torch._C._current_graph_task_id() != -1:
                    return
                if mod.training and torch.is_grad_enabled():
                    x = args[0].detach().double().reshape(-1, args[0].shape[-1])
                    seen.append((layer, x, mod.weight.detach().double().clone()))

            module.register_forward_hook(hook)
    return seen


def ref_losses(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """Switch loss (before its coefficient) and z-loss, float64, from the formulas."""
    logits = x @ w.T
    p = torch.softmax(logits, dim=-1)
    t, e = p.shape
    tokens = torch.zeros(e, dtype=torch.float64)
    for row in p:
        tokens[torch.topk(row, TOPK).indices] += 1
    switch = e / (TOPK * t * t) * float((p.sum(dim=0) * tokens).sum())
    z = float(torch.logsumexp(logits, dim=-1).square().mean())
    return {"load_balancing_loss": switch, "z_loss": z}


def expected_rows(captured, micro_per_step: int, windows: dict[int, list[int]]):
    """Per logging step: mean over the window's micro-batches of the mean over MoE layers, and
    per layer."""
    moe_layers = [i for i, m in enumerate(PATTERN) if m]
    per_micro = len(moe_layers)
    out = {}
    for log_step, steps in windows.items():
        sums: dict[str, float] = {}
        count = 0
        for s in steps:
            for m in range(micro_per_step):
                start = (s * micro_per_step + m) * per_micro
                count += 1
                for layer, x, w in captured[start : start + per_micro]:
                    for name, v in ref_losses(x, w).items():
                        sums[f"moe/{name}"] = sums.get(f"moe/{name}", 0.0) + v / len(moe_layers)
                        key = f"moe/{name}_layer_{layer}"
                        sums[key] = sums.get(key, 0.0) + v
        out[log_step] = {k: v / count for k, v in sums.items()}
    return out


def test_driver_with_accumulation_writes_interval_means_and_nothing_between(monkeypatch):
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    monitor = MoEMetricsMonitor(per_layer_logging=True, moe_layer_freq=PATTERN)
    reports = []
    original = monitor.tracker.report
    monkeypatch.setattr(
        monitor.tracker,
        "report",
        lambda *a, **k: reports.append(k["iteration"]) or original(*a, **k),
    )
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=2)
    vitals.attach(model, opt)
    batches = random_token_batches(12, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=1)
    for _ in range(6):  # 6 optimizer steps of 2 micro-batches
        for _ in range(2):
            batch = next(batches)
            vitals.batch(batch)
            (model(batch["input_ids"], batch["labels"]).loss / 2).backward()
        opt.step()
        opt.zero_grad()
        model.moe_step_end()
    vitals.close()
    # Logging steps 0, 2, 4; the last two steps (5) are reported at run end, at step 5.
    assert reports == [0, 2, 4, 5]
    expected = expected_rows(captured, 2, {0: [0], 2: [1, 2], 4: [3, 4], 5: [5]})
    assert sorted(writer.rows) == [0, 2, 4, 5]
    for step, row in expected.items():
        assert set(writer.rows[step]) == set(row)
        for key, value in row.items():
            assert writer.rows[step][key] == pytest.approx(value, rel=1e-4), (step, key)
    assert set(monitor.last_losses) == {"load_balancing_loss", "z_loss"}


def ref_dropped_fraction(x: torch.Tensor, w: torch.Tensor, capacity_factor: float) -> float:
    """Fraction of the T*k top-k selections over an expert's capacity, float64 from the
    formulas (a top-k of the logits; with the "position" policy the count over capacity is
    what an expert drops, whichever tokens they are)."""
    logits = x @ w.T
    t, e = logits.shape
    tokens = torch.zeros(e, dtype=torch.float64)
    for row in logits:
        tokens[torch.topk(row, TOPK).indices] += 1
    capacity = math.ceil(t * TOPK / e * capacity_factor)
    return float((tokens - capacity).clamp(min=0).sum()) / (t * TOPK)


def expected_per_forward(captured, capacity_factor: float | None = None) -> dict[str, float]:
    """Per layer, the mean over the captured router forwards (however many a micro-batch ran);
    per metric, the mean of those over the MoE layers."""
    per_layer: dict[str, dict[int, list[float]]] = {}
    for layer, x, w in captured:
        values = ref_losses(x, w)
        if capacity_factor is not None:
            values["dropped_token_fraction"] = ref_dropped_fraction(x, w, capacity_factor)
        for name, v in values.items():
            per_layer.setdefault(name, {}).setdefault(layer, []).append(v)
    row = {}
    for name, layers in per_layer.items():
        means = {layer: math.fsum(vs) / len(vs) for layer, vs in layers.items()}
        row[f"moe/{name}"] = math.fsum(means.values()) / sum(PATTERN)
        for layer, mean in means.items():
            row[f"moe/{name}_layer_{layer}"] = mean
    return row


def with_dropout_after_embedding(model: TinyMoELM, p: float = 0.3) -> TinyMoELM:
    """R-Drop needs dropout: the two forwards of a batch then route different inputs."""
    model.embed.register_forward_hook(
        lambda mod, args, out: torch.nn.functional.dropout(out, p, training=mod.training)
    )
    return model


def r_drop_loss(model: TinyMoELM, batch: dict) -> torch.Tensor:
    """R-Drop: two forwards of the same batch (different dropout), both in the loss."""
    a = model(batch["input_ids"], batch["labels"])
    b = model(batch["input_ids"], batch["labels"])
    pa, pb = a.logits.log_softmax(-1), b.logits.log_softmax(-1)
    kl = torch.nn.functional.kl_div(pa, pb, log_target=True, reduction="batchmean")
    return (a.loss + b.loss) / 2 + 0.5 * kl


def test_two_forwards_per_micro_batch_log_the_mean_over_router_forwards():
    """R-Drop runs the model twice per micro-batch: each layer records two values per
    micro-batch. A logged value is the mean over the router forwards (float64 from each
    forward's router input), not twice it (dividing by the micro-batches gave a load-balancing
    loss of ~2.0 and a dropped-token fraction above 1), under gradient accumulation and
    logging every 2 steps, with the run-end report."""
    from trainvitals.adapters.loop import Vitals

    capacity_factor = 0.5  # an expert keeps ceil(T*k/E/2) tokens: at least half are dropped
    torch.manual_seed(0)
    model = TinyMoELM(**MODEL_KW, capacity_factor=capacity_factor, drop_policy="position")
    with_dropout_after_embedding(model)
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    monitor = MoEMetricsMonitor(per_layer_logging=True, moe_layer_freq=PATTERN)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=2)
    vitals.attach(model, opt)
    batches = random_token_batches(8, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=5)
    for _ in range(4):  # 4 optimizer steps of 2 micro-batches
        for _ in range(2):
            batch = next(batches)
            vitals.batch(batch)
            (r_drop_loss(model, batch) / 2).backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    per_step = 2 * 2 * sum(PATTERN)  # micro-batches x forwards x MoE layers
    assert len(captured) == 4 * per_step
    # the two forwards of a micro-batch routed different inputs (dropout)
    assert not torch.equal(captured[0][1], captured[sum(PATTERN)][1])
    windows = {0: (0, 1), 2: (1, 3), 3: (3, 4)}  # logging step -> optimizer steps [a, b)
    assert sorted(writer.rows) == sorted(windows)
    for step, (first, end) in windows.items():
        expected = expected_per_forward(
            captured[first * per_step : end * per_step], capacity_factor
        )
        assert set(writer.rows[step]) == set(expected)
        for key, value in expected.items():
            assert writer.rows[step][key] == pytest.approx(value, rel=1e-4), (step, key)
        assert 0.5 <= writer.rows[step]["moe/dropped_token_fraction"] <= 1.0
        assert writer.rows[step]["moe/load_balancing_loss"] < 1.5  # 1.0 at perfect balance


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def test_two_forwards_under_activation_checkpointing_count_no_recompute():
    """Non-reentrant activation checkpointing re-runs each of the two forwards in the backward
    pass: the routers do not record a re-run, so it is no router forward of the mean."""
    from trainvitals.adapters.loop import Vitals

    model = with_dropout_after_embedding(tiny_model(seed=2))
    model.layers = torch.nn.ModuleList(_Checkpointed(block) for block in model.layers)
    captured = capture_router_inputs(model, skip_backward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    vitals = Vitals([MoEMetricsMonitor(per_layer_logging=True)], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    for batch in random_token_batches(2, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=6):
        vitals.batch(batch)
        r_drop_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    per_step = 2 * sum(PATTERN)
    assert len(captured) == 2 * per_step
    for step in (0, 1):
        expected = expected_per_forward(captured[step * per_step : (step + 1) * per_step])
        assert set(writer.rows[step]) == set(expected)
        for key, value in expected.items():
            assert writer.rows[step][key] == pytest.approx(value, rel=1e-4), (step, key)


def test_two_forwards_with_validation_between_them_keep_validation_apart():
    """Validation forwards (training mode, gradients on: the routers record) between the two
    forwards of a micro-batch are set aside with their record counts."""
    from trainvitals.adapters.loop import Vitals

    model = with_dropout_after_embedding(tiny_model(seed=3))
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals([MoEMetricsMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    batch, other = random_token_batches(2, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=7)
    vitals.batch(batch)
    first = model(batch["input_ids"], batch["labels"]).loss
    with vitals.validating():
        for _ in range(3):
            model(other["input_ids"])
    second = model(batch["input_ids"], batch["labels"]).loss
    (first + second).backward()
    opt.step()
    vitals.close()
    moe = sum(PATTERN)
    training = captured[:moe] + captured[4 * moe :]
    assert len(training) == 2 * moe
    expected = expected_per_forward(training)
    for key in ("moe/load_balancing_loss", "moe/z_loss"):
        assert writer.rows[0][key] == pytest.approx(expected[key], rel=1e-4), key


def test_nothing_leaves_the_device_on_non_logging_steps(monkeypatch):
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals([MoEMetricsMonitor()], writer=writer, log_every_n_steps=3)
    vitals.attach(model, opt)
    transfers = {"tolist": 0, "item": 0, "cpu": 0}
    for method in transfers:
        original = getattr(torch.Tensor, method)

        def counting(self, *a, _m=method, _o=original, **k):
            transfers[_m] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counting)
    per_step = []
    for batch in random_token_batches(4, batch_size=2, seq_len=8, vocab_size=VOCAB):
        vitals.batch(batch)
        model(batch["input_ids"], batch["labels"]).loss.backward()
        before = dict(transfers)
        opt.step()  # the driver runs step_end in the optimizer's post-hook
        opt.zero_grad()
        per_step.append({k: transfers[k] - before[k] for k in transfers})
    monkeypatch.undo()
    vitals.close()
    assert per_step == [
        {"tolist": 1, "item": 0, "cpu": 0},
        {"tolist": 0, "item": 0, "cpu": 0},
        {"tolist": 0, "item": 0, "cpu": 0},
        {"tolist": 1, "item": 0, "cpu": 0},
    ]
    assert sorted(writer.rows) == [0, 3]


def test_validation_records_do_not_mix_into_training_values():
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals([MoEMetricsMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    batches = list(random_token_batches(2, batch_size=2, seq_len=8, vocab_size=VOCAB))
    vitals.batch(batches[0])
    model(batches[0]["input_ids"], batches[0]["labels"]).loss.backward()
    with vitals.validating():  # a forward in training mode with grad: the routers record
        model(batches[1]["input_ids"])
    del captured[2:]
    opt.step()
    vitals.close()
    expected = expected_rows(captured, 1, {0: [0]})[0]
    assert writer.rows[0]["moe/load_balancing_loss"] == pytest.approx(
        expected["moe/load_balancing_loss"], rel=1e-4
    )


def test_rollback_drops_the_abandoned_timelines_values_and_global_tokens():
    """Vitals.load_state_dict mid-run (a rollback to an earlier checkpoint) replays from the
    restored step: the router losses recorded since the last report (steps after the
    checkpoint, and a step cut off after one micro-batch) belong to the abandoned timeline.
    The next report is the mean over the replayed micro-batches only (float64 from the
    routers' inputs), and the global_aux_loss token counts of the cut-off step are gone."""
    import copy

    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    captured = capture_router_inputs(model)
    global_router = TopKRouter(
        HIDDEN, EXPERTS, TOPK, aux_loss_type="global_aux_loss", aux_loss_coeff=0.01
    )
    model.extra_router = global_router  # records nothing (no layer number): only its counts
    writer = Recorder()
    monitor = MoEMetricsMonitor(per_layer_logging=True, moe_layer_freq=PATTERN)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=4)
    vitals.attach(model, opt)
    batches = random_token_batches(40, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=3)
    micro_batches = 0  # training forwards so far (captured holds 2 routers per forward)

    def micro_batch() -> None:
        nonlocal micro_batches
        batch = next(batches)
        vitals.batch(batch)
        (model(batch["input_ids"], batch["labels"]).loss / 2).backward()
        global_router(torch.randn(4, HIDDEN))
        micro_batches += 1

    def step() -> None:
        for _ in range(2):
            micro_batch()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # steps 0 (logged), 1, 2
        step()
    saved = (vitals.state_dict(), copy.deepcopy(model.state_dict()), opt.state_dict())
    step()  # step 3: abandoned
    micro_batch()  # step 4 cut off after one micro-batch: abandoned
    assert global_router.global_aux_micro_batches == 1
    vitals.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    opt.load_state_dict(saved[2])
    assert global_router.global_aux_micro_batches == 0
    assert not global_router.global_tokens_per_expert.any()
    replay_start = micro_batches
    for _ in range(2):  # steps 3 and 4 again: step 4 logs
        step()
    vitals.close()
    assert sorted(writer.rows) == [0, 4]
    per_micro = sum(PATTERN)
    kept = captured[replay_start * per_micro :]
    assert len(kept) == 4 * per_micro
    expected = expected_rows(kept, 1, {4: [0, 1, 2, 3]})[4]
    assert set(writer.rows[4]) == set(expected)
    for key, value in expected.items():
        assert writer.rows[4][key] == pytest.approx(value, rel=1e-4), key


def test_trailing_micro_batches_without_a_step_count_in_the_run_end_report():
    """A manual accumulation loop whose loader length is not a multiple of the accumulation
    runs its last micro-batch without an optimizer step. The run-end report covers what the
    routers recorded since the last report, that micro-batch included, so its micro-batch
    count includes it too: the mean over those 5 micro-batches (float64 from the routers'
    inputs), not their sum over the 4 micro-batches of the completed steps."""
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    monitor = MoEMetricsMonitor(per_layer_logging=True, moe_layer_freq=PATTERN)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=4)
    vitals.attach(model, opt)
    accumulation = 2
    loader = list(random_token_batches(7, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=4))
    for i, batch in enumerate(loader):
        vitals.batch(batch)
        (model(batch["input_ids"], batch["labels"]).loss / accumulation).backward()
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
    vitals.close()  # steps 0 (logged), 1, 2 and a trailing micro-batch
    assert sorted(writer.rows) == [0, 2]
    per_micro = sum(PATTERN)
    expected = expected_rows(captured[2 * per_micro :], 1, {2: [0, 1, 2, 3, 4]})[2]
    assert set(writer.rows[2]) == set(expected)
    for key, value in expected.items():
        assert writer.rows[2][key] == pytest.approx(value, rel=1e-4), key


def test_a_model_without_recording_routers_warns_once_that_nothing_is_written():
    from trainvitals.adapters.loop import Vitals

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals([MoEMetricsMonitor()], writer=writer, log_every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="nothing was recorded up to step 0") as record:
        vitals.attach(model, opt)
        for _ in range(3):
            x = torch.randn(2, 4)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        vitals.close()
    assert sum("nothing was recorded" in str(w.message) for w in record) == 1
    assert not writer.rows


def test_a_router_recording_only_a_loss_writes_it_without_the_nothing_warning():
    # losses go to total_loss_dict, not to the console string: still "something recorded"
    from trainvitals.adapters.loop import Vitals
    from trainvitals.moe import get_moe_metrics_tracker

    class LossOnlyRouter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)

        def forward(self, x):
            logits = self.gate(x)
            loss = logits.softmax(-1).mean(0).square().sum() * 2
            get_moe_metrics_tracker().record("load_balancing_loss", loss.detach(), 1, 1)
            return logits

    model = LossOnlyRouter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    expected = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with Vitals([MoEMetricsMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for step in range(2):
                x = torch.randn(3, 4)
                vitals.batch(x)
                logits = model(x)
                probs = logits.detach().double().softmax(-1)
                expected[step] = float(probs.mean(0).square().sum() * 2)
                logits.sum().backward()
                opt.step()
                opt.zero_grad()
    assert not [w for w in record if "nothing was recorded" in str(w.message)]
    for step, value in expected.items():
        assert writer.rows[step]["moe/load_balancing_loss"] == pytest.approx(value, rel=1e-6)


def test_mtp_layers_with_the_routers_pattern_are_counted_once_and_reported():
    """A model with Multi-Token-Prediction layers: its routers' ``num_layers`` (the tracker's
    vector length) counts the MTP slot too. With ``mtp_num_layers`` the monitor takes the MoE
    pattern of the transformer layers from the routers and the tracker adds the MTP slot:
    2 transformer layers (block 0 MoE, block 1 dense) + 1 MTP layer -> MoE slots 0 and 2, the
    mean over those 2. The routers' 3-entry pattern used to go to the tracker as
    ``moe_layer_freq`` for 2 transformer layers: a ValueError at the first logging step, so
    the monitor was disabled and nothing was written."""
    from trainvitals.adapters.loop import Vitals

    torch.manual_seed(0)
    routers = torch.nn.ModuleList(
        TopKRouter(HIDDEN, EXPERTS, TOPK, aux_loss_type="aux_loss", aux_loss_coeff=0.01)
        for _ in range(2)
    )
    routers[0].set_layer_number(1, num_layers=3)  # block 0
    routers[1].set_layer_number(3, num_layers=3)  # the MTP layer
    opt = torch.optim.SGD(routers.parameters(), lr=0.5)
    writer = Recorder()
    vitals = Vitals(
        [MoEMetricsMonitor(per_layer_logging=True, mtp_num_layers=1)],
        writer=writer,
        log_every_n_steps=1,
    )
    vitals.attach(routers, opt)
    expected = {}
    for step in range(2):
        x = torch.randn(2, 8, HIDDEN)
        vitals.batch(x)
        ref = [
            ref_losses(x.reshape(-1, HIDDEN).double(), r.weight.detach().double())[
                "load_balancing_loss"
            ]
            for r in routers
        ]
        sum(r(x)[0].square().sum() for r in routers).backward()
        opt.step()
        opt.zero_grad()
        expected[step] = {
            "moe/load_balancing_loss": (ref[0] + ref[1]) / 2,
            "moe/load_balancing_loss_layer_0": ref[0],
            "moe/load_balancing_loss_layer_2": ref[1],
        }
    vitals.close()
    assert sorted(writer.rows) == [0, 1]
    for step, row in expected.items():
        assert set(writer.rows[step]) == set(row)
        for key, value in row.items():
            assert writer.rows[step][key] == pytest.approx(value, rel=1e-5), (step, key)


def test_monitor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_layers"):
        MoEMetricsMonitor(num_layers=0)
    with pytest.raises(ValueError, match="percentiles"):
        MoEMetricsMonitor(percentiles={"z_loss": [2.0]})
    with pytest.raises(TypeError, match="moe_layer_freq"):
        MoEMetricsMonitor(moe_layer_freq="every")
    with pytest.raises(TypeError, match="tracker"):
        MoEMetricsMonitor(tracker=object())


# ---------------------------------------------------------------------- Lightning


def test_lightning_with_gradient_accumulation_and_the_real_writer(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from trainvitals.adapters.jsonl import metric_history, read_jsonl
    from trainvitals.moe.tiny_model import TinyMoELightningModule

    torch.manual_seed(0)
    module = TinyMoELightningModule(lr=0.05, **MODEL_KW)
    captured = capture_router_inputs(module)
    loader = torch.utils.data.DataLoader(RandomTokenDataset(12, 8, VOCAB, seed=3), batch_size=2)
    monitor = MoEMetricsMonitor(percentiles={"load_balancing_loss": [0.5]}, moe_layer_freq=PATTERN)
    trainer = quiet_trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        callbacks=[monitor],
        default_root_dir=tmp_path,
        devices=1,
        limit_val_batches=0,
    )
    trainer.fit(module, loader)
    (path,) = glob.glob(str(tmp_path / "**" / "metrics.jsonl"), recursive=True)
    records = read_jsonl(path)
    expected = expected_rows(captured, 2, {0: [0], 1: [1], 2: [2]})
    for key in ("moe/load_balancing_loss", "moe/z_loss"):
        history = dict(metric_history(records, key))
        assert sorted(history) == [0, 1, 2]
        for step in (0, 1, 2):
            assert history[step] == pytest.approx(expected[step][key], rel=1e-4), (key, step)
    # the median over the two MoE layers is their mean
    p50 = dict(metric_history(records, "moe/load_balancing_loss_p50"))
    for step in (0, 1, 2):
        assert p50[step] == pytest.approx(expected[step]["moe/load_balancing_loss"], rel=1e-4)


# ---------------------------------------------------------------------- 2 gloo ranks


def _lightning_ddp(rank: int, world_size: int, out_dir: str) -> dict:
    """Lightning DDP on the 2 ranks, accumulate_grad_batches=2, 2 optimizer steps."""

    from trainvitals.moe.tiny_model import TinyMoELightningModule

    set_moe_metrics_tracker(MoEMetricsTracker())
    torch.manual_seed(0)
    module = TinyMoELightningModule(lr=0.05, **MODEL_KW)
    captured = capture_router_inputs(module)
    # 16 samples, DistributedSampler: 8 per rank = 4 micro-batches of 2 = 2 optimizer steps
    loader = torch.utils.data.DataLoader(RandomTokenDataset(16, 8, VOCAB, seed=3), batch_size=2)
    writer = Recorder()
    trainer = quiet_trainer(
        devices=world_size,
        strategy="ddp",
        max_steps=2,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        callbacks=[MoEMetricsMonitor(writer=writer)],
        default_root_dir=out_dir,
        limit_val_batches=0,
    )
    trainer.fit(module, loader)
    return {
        "rows": writer.rows,
        "captured": [(layer, x.tolist(), w.tolist()) for layer, x, w in captured],
    }


def _two_rank_body(rank: int, world_size: int, out_dir: str) -> dict:
    return {
        "driver": _driver_two_ranks(rank, world_size),
        "lightning": _lightning_ddp(rank, world_size, out_dir),
        "no_tokens": _no_tokens_two_ranks(rank, world_size),
    }


class _TwoRouters(torch.nn.Module):
    """Two MoE layers' routers (``layers.0``, ``layers.1``), each fed its own tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            TopKRouter(
                HIDDEN,
                EXPERTS,
                TOPK,
                aux_loss_type="aux_loss",
                aux_loss_coeff=0.01,
                z_loss_coeff=0.001,
            )
            for _ in range(2)
        )
        for i, router in enumerate(self.layers):
            router.set_layer_number(i + 1, num_layers=2)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum(
            (router(x)[0] * x.sum(-1, keepdim=True)).sum()
            for router, x in zip(self.layers, xs, strict=True)
        )


def _no_tokens_two_ranks(rank: int, world_size: int) -> dict:
    """Data parallel on 2 ranks; rank 1's layer 1 router gets no token in any forward (an
    empty dispatch), so it records nothing for that layer during the whole interval."""
    from trainvitals.adapters.loop import Vitals
    from trainvitals.distributed import ProcessGroups, world_group

    set_moe_metrics_tracker(MoEMetricsTracker())
    torch.manual_seed(0)  # the same weights on both ranks, as under DDP
    model = _TwoRouters()
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals(
        [MoEMetricsMonitor(per_layer_logging=True)],
        writer=writer,
        groups=ProcessGroups(dp=world_group()),
        log_every_n_steps=1,
    )
    vitals.attach(model, opt)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):  # 2 optimizer steps of 2 micro-batches
        for _ in range(2):
            xs = [torch.randn(6, HIDDEN, generator=gen), torch.randn(6, HIDDEN, generator=gen)]
            if rank == 1:
                xs[1] = xs[1][:0]  # no token for layer 1 on this rank
            vitals.batch(xs)
            model(xs).backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    return {
        "rows": writer.rows,
        "captured": [(layer, x.tolist(), w.tolist()) for layer, x, w in captured],
    }


def _driver_two_ranks(rank: int, world_size: int) -> dict:
    import torch

    from trainvitals.adapters.loop import Vitals
    from trainvitals.distributed import ProcessGroups, world_group
    from trainvitals.moe import MoEMetricsTracker, set_moe_metrics_tracker

    set_moe_metrics_tracker(MoEMetricsTracker())
    model = tiny_model(seed=rank)
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals(
        [MoEMetricsMonitor(moe_layer_freq=PATTERN)],
        writer=writer,
        groups=ProcessGroups(dp=world_group()),
        log_every_n_steps=3,
    )
    vitals.attach(model, opt)
    counts = []
    for batch in random_token_batches(4, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=rank):
        vitals.batch(batch)
        model(batch["input_ids"], batch["labels"]).loss.backward()
        counts.append(step_collectives(opt))
    vitals.close()
    return {
        "rows": writer.rows,
        "counts": counts,
        "captured": [(layer, x.tolist(), w.tolist()) for layer, x, w in captured],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both 2-rank scenarios in one pair of processes (spawning is the slow part)."""
    pytest.importorskip("lightning.pytorch")
    out_dir = str(tmp_path_factory.mktemp("moe_ddp"))
    return run_distributed(_two_rank_body, 2, args=(out_dir,), timeout=240)


def _tensors(captured):
    return [
        (layer, torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
        for layer, x, w in captured
    ]


def test_lightning_ddp_two_ranks_with_accumulation_averages_over_ranks(two_ranks):
    results = [r["lightning"] for r in two_ranks]
    per_rank = [expected_rows(_tensors(r["captured"]), 2, {0: [0], 1: [1]}) for r in results]
    for res in results:
        assert sorted(res["rows"]) == [0, 1]
        for step in (0, 1):
            for key in ("moe/load_balancing_loss", "moe/z_loss"):
                expected = (per_rank[0][step][key] + per_rank[1][step][key]) / 2
                assert res["rows"][step][key] == pytest.approx(expected, rel=1e-4), (step, key)
    # the ranks saw different tokens: the average is not just rank 0's value
    assert per_rank[0][0]["moe/z_loss"] != pytest.approx(per_rank[1][0]["moe/z_loss"], rel=1e-3)


def test_two_ranks_average_over_dp_and_communicate_only_on_logging_steps(two_ranks):
    results = [r["driver"] for r in two_ranks]
    per_rank = []
    for res in results:
        captured = [
            (layer, torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
            for layer, x, w in res["captured"]
        ]
        per_rank.append(expected_rows(captured, 1, {0: [0], 3: [1, 2, 3]}))
    for res in results:
        assert res["counts"] == [
            {"all_gather_object": 1, "all_reduce": 1},
            {},
            {},
            {"all_gather_object": 1, "all_reduce": 1},
        ]
        for step in (0, 3):
            for key in ("moe/load_balancing_loss", "moe/z_loss"):
                expected = (per_rank[0][step][key] + per_rank[1][step][key]) / 2
                assert res["rows"][step][key] == pytest.approx(expected, rel=1e-4)


def test_a_disabled_monitor_still_resets_the_global_aux_token_counts_each_step():
    """global_aux_loss routers average their token counts over the micro-batches since their
    last reset, which the monitor does at step end: training state. A monitor the guard
    disables must not turn the loss into a running mean over the whole run."""
    from trainvitals.adapters.loop import Vitals

    class Failing(MoEMetricsMonitor):
        def _report(self, ctx, step):
            if step == 1:
                raise RuntimeError("telemetry bug")
            super()._report(ctx, step)

    model = torch.nn.Linear(HIDDEN, HIDDEN)
    router = TopKRouter(HIDDEN, EXPERTS, TOPK, aux_loss_type="global_aux_loss", aux_loss_coeff=0.01)
    model.router = router
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([Failing()], writer=Recorder(), log_every_n_steps=1).attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("TRAINVITALS_STRICT", raising=False)
            for _ in range(4):
                for _ in range(2):  # two micro-batches per step
                    x = torch.randn(4, HIDDEN)
                    vitals.batch(x)
                    router(model(x))
                # each step starts from a reset: only this step's micro-batches are counted
                assert router.global_aux_micro_batches == 2
                opt.step()
                opt.zero_grad()
    vitals.close()


def test_a_data_parallel_rank_whose_router_saw_no_token_counts_for_nothing(two_ranks):
    """Rank 1's layer 1 router gets no token in any forward of the interval, so it records
    nothing for layer 1: the logged layer 1 value is rank 0's mean over its forwards (float64
    from the routers' inputs), not half of it (a true 0.99965 was logged as 0.49983 on 2
    ranks); layer 0 is still the mean of both ranks' means."""
    results = [r["no_tokens"] for r in two_ranks]
    # per rank, step and layer: the float64 losses of that step's 2 forwards (rank 1 layer 1: none)
    per_rank: list[dict[tuple[int, int], list[dict[str, float]]]] = []
    for res in results:
        forwards: dict[tuple[int, int], list[dict[str, float]]] = {}
        counters = {0: 0, 1: 0}
        for layer, x, w in _tensors(res["captured"]):
            if x.shape[0] == 0:
                continue
            step = counters[layer] // 2
            counters[layer] += 1
            forwards.setdefault((step, layer), []).append(ref_losses(x, w))
        per_rank.append(forwards)
    assert sorted(per_rank[0]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(per_rank[1]) == [(0, 0), (1, 0)]  # no record of layer 1
    for res in results:
        assert sorted(res["rows"]) == [0, 1]
        for step in (0, 1):
            row = res["rows"][step]
            for name in ("load_balancing_loss", "z_loss"):
                means = [
                    {
                        layer: math.fsum(f[name] for f in fw[(step, layer)])
                        / len(fw[(step, layer)])
                        for layer in (0, 1)
                        if (step, layer) in fw
                    }
                    for fw in per_rank
                ]
                layer0 = (means[0][0] + means[1][0]) / 2
                layer1 = means[0][1]  # rank 0 alone recorded layer 1
                key = f"moe/{name}"
                assert row[f"{key}_layer_0"] == pytest.approx(layer0, rel=1e-5), (step, name)
                assert row[f"{key}_layer_1"] == pytest.approx(layer1, rel=1e-5), (step, name)
                assert row[key] == pytest.approx((layer0 + layer1) / 2, rel=1e-5), (step, name)


def test_routers_of_another_size_than_num_layers_raise_at_run_start():
    """A monitor built for 3 layers on routers that record vectors of 2: the tracker refused the
    sizes at the first logging step (a whole logging interval of training later, then the guard
    disabled the monitor); now a ValueError at run start names both sizes."""
    from trainvitals.adapters.loop import Vitals

    routers = torch.nn.ModuleList(
        TopKRouter(HIDDEN, EXPERTS, TOPK, aux_loss_type="aux_loss", aux_loss_coeff=0.01)
        for _ in range(2)
    )
    for i, router in enumerate(routers):
        router.set_layer_number(i + 1, num_layers=2)
    opt = torch.optim.SGD(routers.parameters(), lr=0.5)
    hooks: list[str] = []

    class Seen(MoEMetricsMonitor):
        def run_start(self, ctx):
            hooks.append("run_start")
            super().run_start(ctx)

    vitals = Vitals([Seen(num_layers=3)], writer=Recorder(), log_every_n_steps=4)
    vitals.attach(routers, opt)
    with pytest.raises(ValueError, match=r"num_layers=3.*expects per-layer vectors of 3.*record 2"):
        vitals.batch(torch.randn(2, 8, HIDDEN))
    vitals.close()
    assert hooks == ["run_start"]
    # the same routers with a matching monitor (2 layers, or 1 + 1 MTP) run
    for kwargs in ({"num_layers": 2}, {"num_layers": 1, "mtp_num_layers": 1}):
        writer = Recorder()
        with Vitals([MoEMetricsMonitor(**kwargs)], writer=writer, log_every_n_steps=1) as v:
            v.attach(routers, opt)
            x = torch.randn(2, 8, HIDDEN)
            v.batch(x)
            sum(r(x)[0].square().sum() for r in routers).backward()
            opt.step()
            opt.zero_grad()
        assert "moe/load_balancing_loss" in writer.rows[0], kwargs
