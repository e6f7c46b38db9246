"""LoadBalanceMonitor: how evenly the routers of a mixture-of-experts model spread tokens."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.adapters.context import BatchInfo, RunContext
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.distributed import (
    all_gather_objects,
    all_reduce_by_groups,
    all_reduce_coalesced,
    group_rank,
    group_size,
)
from trainvitals.moe.capture import HF_ROUTER_CLASSES, RouterCapture
from trainvitals.stats.load_balance import (
    AGGREGATES,
    LAYER_METRICS,
    UTILIZATION_QUANTILES,
    aggregate_across_layers,
    load_balance_stats,
)

__all__ = ["LoadBalanceMonitor"]

_MODES = ("brief", "detailed")
# Across-layer aggregates written in both modes (NeMo Automodel names for cv, dead expert
# fraction and diversity; the same pattern for the overload factor).
_AGGREGATED = ("cv", "dead_expert_frac", "expert_diversity", "max_overload_factor")


class LoadBalanceMonitor(VitalsCallback):
    """Expert load balance of every MoE layer, counted over all micro-batches of each step.

    At ``run_start`` the monitor finds the model's routers (see :mod:`trainvitals.moe.capture`:
    ``TopKRouter``, Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3 /
    GPT-OSS routers, torchtitan ``MoE``, and your own extractors) and hooks them, without
    changing the model. Every training forward of a logging step, i.e. every micro-batch,
    adds its tokens-per-expert counts into one ``[layers, experts]`` tensor on the device
    (evaluation and activation-checkpoint re-runs are not counted). At the end of a logging
    step the counts of all layers, and the aux-loss sums when routers report them, are summed
    over the data- and context-parallel ranks (``ctx.groups.dp_cp``) in ONE collective (plus
    one over ``ctx.groups.pp`` with pipeline stages), the statistics are computed on the
    device (:mod:`trainvitals.stats.load_balance`), brought to the host in one transfer and
    written together. The hooks count only during steps that will be logged (a host-side flag
    set at each micro-batch and step end), and the counts are zeroed on the device at every
    step end: a non-logging step costs a Python check per router forward and nothing else (no
    kernel, no sync, no collective).

    CV uses the population standard deviation (NeMo Automodel uses ``n - 1``; multiply ours by
    ``sqrt(E / (E - 1))`` to compare). Quantiles interpolate linearly. Layers that routed no
    tokens in the step get no per-layer keys and are left out of the aggregates (their
    statistics would be undefined, not "balanced"). ``<l>`` in keys is the layer number from
    the module name (``model.layers.10.mlp.gate`` -> 10), ordered numerically.

    With pipeline parallelism (``ctx.groups.pp`` of more than one rank) the stages agree on
    their layers once at run start, and each logging step adds one SUM over the pipeline group,
    so every rank, the writing one included, reports the layers of all stages. Layer numbers
    are expected to be global across stages (torchtitan keeps ``layers.<i>`` of the full
    model); when two stages report the same number (stage-local numbering, as Megatron's
    ``decoder.layers.0`` on every stage) the labels are prefixed ``pp<stage>_``, with a warning.

    Args:
        mode: ``"brief"`` (aggregates and the top/bottom experts) or ``"detailed"`` (also
            every layer's statistics and tokens per expert).
        top_k: how many of the highest and of the lowest utilization experts (over all layers)
            to write; 0 for none.
        dead_expert_patience: warn (once per streak, on rank 0) when an expert received no
            token on this many consecutive logging steps; ``None`` disables the warning.
        extractors: extra ``(predicate_or_type, fn)`` or ``(predicate_or_type, fn,
            num_experts)`` router extractors, see
            :func:`trainvitals.moe.capture.register_router_extractor`.
        log_every_n_steps: interval in optimizer steps (default: the run's).
        writer: where values go (default: the run's writer).

    Example::

        trainer = lightning.pytorch.Trainer(callbacks=[LoadBalanceMonitor(mode="detailed")])
        # or, in a plain loop:
        vitals = Vitals([LoadBalanceMonitor()], log_every_n_steps=10).attach(model, optimizer)

    Keys written (on logging steps; "load" = token-to-expert assignments, a token routed to
    ``k`` experts counts ``k`` times; utilization = load / (layer's load / E)):

    =================================================  ===============================================  =====
    key                                                meaning                                          unit
    =================================================  ===============================================  =====
    ``moe/cv_{mean,median,min,max}``                   CV (std/mean of the loads) across layers         1
    ``moe/dead_expert_frac_{mean,median,min,max}``     fraction of a layer's experts with no token      1
    ``moe/expert_diversity_{mean,median,min,max}``     ``exp(entropy of the load distribution) / E``    1
    ``moe/max_overload_factor_{mean,median,min,max}``  a layer's max load / its mean load               ratio
    ``moe/aux_loss_{mean,median,min,max}``             the layers' Switch aux loss before its           1
                                                       coefficient (1.0 = balanced), mean over the
                                                       step's micro-batches and ranks: TopKRouter's
                                                       ``last_aux_loss``, an extractor's, or from the
                                                       router logits of HF softmax routers
    ``moe/expert_utilization_<q>``                     quantiles of the utilization of all experts of   ratio
                                                       all layers together, ``<q>`` one of ``min``,
                                                       ``p25``, ``median``, ``p75``, ``max``
    ``moe_expert_utilization/layer_<l>_expert_<e>``    utilization of the ``top_k`` highest and         ratio
                                                       ``top_k`` lowest experts overall
    ``moe/dead_experts_persistent``                    experts with no token for at least               count
                                                       ``dead_expert_patience`` logging steps in a row
                                                       (when the patience is set)
    ``moe/layer_<l>/cv``                               the layer's CV (detailed)                        1
    ``moe/layer_<l>/dead_expert_frac``                 (detailed)                                       1
    ``moe/layer_<l>/expert_diversity``                 (detailed)                                       1
    ``moe/layer_<l>/max_overload_factor``              (detailed)                                       ratio
    ``moe/layer_<l>/utilization_<q>``                  quantiles of the layer's utilizations            ratio
                                                       (detailed), ``<q>`` as above
    ``moe/layer_<l>/aux_loss``                         the layer's aux loss (detailed, when known)      1
    ``moe/layer_<l>/tokens_per_expert/<e>``            tokens routed to expert ``e`` in the step,       tokens
                                                       summed over micro-batches and ranks (detailed)
    =================================================  ===============================================  =====
    """

    def __init__(
        self,
        *,
        mode: str = "brief",
        top_k: int = 5,
        dead_expert_patience: int | None = 10,
        extractors: Iterable[Any] | None = None,
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
        if dead_expert_patience is not None and (
            isinstance(dead_expert_patience, bool)
            or not isinstance(dead_expert_patience, int)
            or dead_expert_patience <= 0
        ):
            raise ValueError(
                f"dead_expert_patience must be a positive int or None, got {dead_expert_patience!r}"
            )
        self.mode = mode
        self.top_k = top_k
        self.dead_expert_patience = dead_expert_patience
        self.extractors = list(extractors) if extractors is not None else []
        self.capture: RouterCapture | None = None
        self._layout = _Layout([], [], 0, None)
        # Consecutive logging steps each expert had no token, per layer label (host ints).
        self._dead_streak: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        """Find the routers and hook them."""
        if ctx.model is None:
            raise ValueError("LoadBalanceMonitor needs the model (ctx.model is None)")
        if self.capture is not None:
            self.capture.remove()
        model_name = type(ctx.model).__name__
        if group_size(getattr(ctx.groups, "pp", None)) == 1:
            capture = RouterCapture(ctx.model, extractors=self.extractors)
            layout = _layout(capture, ctx.groups, model_name)
        else:
            # Pipeline stages: a configuration error on one stage must reach every stage
            # (they all wait in the same gather), so it is raised after the stages agreed.
            try:
                capture, error = RouterCapture(ctx.model, extractors=self.extractors), None
            except (ValueError, TypeError) as exc:
                capture, error = RouterCapture(torch.nn.Module()), f"{type(exc).__name__}: {exc}"
            layout = _layout(capture, ctx.groups, model_name, error)
        self.capture = capture
        self._layout = layout
        for label in layout.labels:
            streak = self._dead_streak.get(label)
            if streak is None or len(streak) != layout.num_experts:
                self._dead_streak[label] = [0] * layout.num_experts
        capture.enabled = self.should_log(ctx)

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        """Count only in steps that will be logged (a host-side flag, nothing on the device)."""
        if self.capture is not None:
            self.capture.enabled = self.should_log(ctx)

    def step_end(self, ctx: RunContext) -> None:
        """Report the step's loads on logging steps, then zero them (every step)."""
        if self.capture is None:
            return
        try:
            if self.should_log(ctx):
                self._report(ctx)
        finally:
            self.capture.reset()
            self.capture.enabled = self.should_log(ctx, ctx.step + 1)

    def run_end(self, ctx: RunContext) -> None:
        self._remove_hooks()

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._remove_hooks()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove_hooks()
        super().teardown(trainer, pl_module, stage)

    def _remove_hooks(self) -> None:
        if self.capture is not None:
            self.capture.remove()

    # ------------------------------------------------------------------ the logging step

    def _report(self, ctx: RunContext) -> None:
        capture = self.capture
        assert capture is not None
        layout = self._layout
        loads = capture.loads(device=capture.device or ctx.device)
        aux_sum, aux_count = capture.aux_losses(device=loads.device)
        if layout.rows is None:
            # One SUM collective over data x context parallel carries every layer (and the aux).
            loads, aux_sum, aux_count = all_reduce_coalesced(
                [loads, aux_sum, aux_count], "sum", ctx.groups.dp_cp
            )
        else:
            # Pipeline stages: this stage's rows in the table of all stages' layers, summed
            # over data x context parallel, then over the stages: one collective per group.
            rows = torch.tensor(layout.rows, dtype=torch.long).to(loads.device, non_blocking=True)
            n = len(layout.labels)
            loads = loads.reshape(len(layout.rows), layout.num_experts)  # a stage may have none
            full = [
                torch.zeros(n, *t.shape[1:], dtype=torch.float64, device=loads.device).index_copy_(
                    0, rows, t
                )
                for t in (loads, aux_sum, aux_count)
            ]
            groups = tuple(g for g in (ctx.groups.dp_cp, ctx.groups.pp) if g is not None)
            loads, aux_sum, aux_count = all_reduce_by_groups([(t, groups) for t in full], "sum")
        stats = load_balance_stats(loads, top_k=self.top_k)
        aux = torch.where(aux_count > 0, aux_sum / aux_count.clamp(min=1), float("nan"))

        # Everything the host needs, packed in one vector: one device->host transfer.
        parts = [
            stats.aggregates.reshape(-1),
            aggregate_across_layers(aux).reshape(-1),
            stats.utilization_quantiles,
            stats.top_values,
            stats.top_indices.to(torch.float64),
            stats.bottom_values,
            stats.bottom_indices.to(torch.float64),
            loads.reshape(-1),
        ]
        if self.mode == "detailed":
            parts += [stats.per_layer.reshape(-1), aux]
        host = torch.cat([p.to(torch.float64) for p in parts]).cpu().tolist()
        values = self._keys(host, stats.top_values.numel())
        values.update(self._update_dead_streaks(ctx, values.pop("_loads")))
        self.write(ctx, {k: v for k, v in values.items() if math.isfinite(v)})

    def _keys(self, host: list[float], k: int) -> dict[str, Any]:
        layout = self._layout
        labels = layout.labels
        num_layers, num_experts = len(labels), layout.num_experts
        it = iter(host)

        def take(n: int) -> list[float]:
            return [next(it) for _ in range(n)]

        out: dict[str, Any] = {}
        aggregates = take(len(LAYER_METRICS) * len(AGGREGATES))
        for m, metric in enumerate(LAYER_METRICS):
            if metric in _AGGREGATED:
                for a, agg in enumerate(AGGREGATES):
                    out[f"moe/{metric}_{agg}"] = aggregates[m * len(AGGREGATES) + a]
        aux_aggregates = take(len(AGGREGATES))
        if any(layout.has_aux):
            for a, agg in enumerate(AGGREGATES):
                out[f"moe/aux_loss_{agg}"] = aux_aggregates[a]
        for (name, _), value in zip(
            UTILIZATION_QUANTILES, take(len(UTILIZATION_QUANTILES)), strict=True
        ):
            out[f"moe/expert_utilization_{name}"] = value
        top_v, top_i, bot_v, bot_i = take(k), take(k), take(k), take(k)
        for value, flat in [*zip(top_v, top_i, strict=True), *zip(bot_v, bot_i, strict=True)]:
            layer, expert = divmod(int(flat), num_experts)
            out[f"moe_expert_utilization/layer_{labels[layer]}_expert_{expert}"] = value
        loads = take(num_layers * num_experts)
        out["_loads"] = loads
        if self.mode == "detailed":
            per_layer = take(len(LAYER_METRICS) * num_layers)
            aux = take(num_layers)
            for m, metric in enumerate(LAYER_METRICS):
                for i, label in enumerate(labels):
                    out[f"moe/layer_{label}/{metric}"] = per_layer[m * num_layers + i]
            for i, (label, has_aux) in enumerate(zip(labels, layout.has_aux, strict=True)):
                if has_aux:
                    out[f"moe/layer_{label}/aux_loss"] = aux[i]
                active = any(loads[i * num_experts : (i + 1) * num_experts])
                if active:
                    for e in range(num_experts):
                        out[f"moe/layer_{label}/tokens_per_expert/{e}"] = loads[i * num_experts + e]
        return out

    def _update_dead_streaks(self, ctx: RunContext, loads: list[float]) -> dict[str, float]:
        if self.dead_expert_patience is None:
            return {}
        patience = self.dead_expert_patience
        num_experts = self._layout.num_experts
        newly_dead: list[str] = []
        persistent = 0
        for i, label in enumerate(self._layout.labels):
            row = loads[i * num_experts : (i + 1) * num_experts]
            streak = self._dead_streak.setdefault(label, [0] * num_experts)
            if not any(row):
                continue  # the layer routed nothing this step: no evidence either way
            for e, load in enumerate(row):
                streak[e] = streak[e] + 1 if load == 0 else 0
                if streak[e] >= patience:
                    persistent += 1
                if streak[e] == patience:
                    newly_dead.append(f"layer {label} expert {e}")
        if newly_dead and ctx.global_rank == 0:
            warnings.warn(
                f"LoadBalanceMonitor: {len(newly_dead)} expert(s) received no token on "
                f"{patience} consecutive logging steps (up to step {ctx.step}): "
                f"{', '.join(newly_dead[:20])}{' ...' if len(newly_dead) > 20 else ''}",
                RuntimeWarning,
                stacklevel=2,
            )
        return {"moe/dead_experts_persistent": float(persistent)}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"dead_streak": {k: list(v) for k, v in self._dead_streak.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        streaks = state_dict.get("dead_streak", {}) if isinstance(state_dict, dict) else {}
        self._dead_streak = {str(k): [int(x) for x in v] for k, v in streaks.items()}


@dataclass
class _Layout:
    """The layers a report covers: this rank's, or with pipeline parallelism every stage's."""

    labels: list[str]
    has_aux: list[bool]
    num_experts: int
    rows: list[int] | None  # row of each local router in the table of all stages; None: local


def _layout(
    capture: RouterCapture, groups: Any, model_name: str, error: str | None = None
) -> _Layout:
    labels = capture.layer_labels
    has_aux = [r.has_aux_loss for r in capture.routers]
    pp = getattr(groups, "pp", None)
    if group_size(pp) == 1:
        if not labels:
            raise ValueError(_no_router_message(model_name))
        return _Layout(labels, has_aux, capture.num_experts, None)
    mine = [(r.label, r.sort_key[:2], r.has_aux_loss) for r in capture.routers]
    stages = all_gather_objects((capture.num_experts, mine, error), pp)  # once, at run start
    errors = [(stage, err) for stage, (_, _, err) in enumerate(stages) if err]
    if errors:
        raise ValueError(f"LoadBalanceMonitor: pipeline stage {errors[0][0]}: {errors[0][1]}")
    stages = [(e, routers) for e, routers, _ in stages]
    sizes = {e for e, routers in stages if routers}
    if len(sizes) > 1:
        raise ValueError(
            f"LoadBalanceMonitor: the pipeline stages have routers with different numbers of "
            f"experts {sorted(sizes)}; they must all be the same"
        )
    if not sizes:
        raise ValueError(_no_router_message(model_name))
    seen: dict[str, int] = {}
    for _, routers in stages:
        for label, _, _ in routers:
            seen[label] = seen.get(label, 0) + 1
    clash = any(count > 1 for count in seen.values())
    if clash:
        warnings.warn(
            "LoadBalanceMonitor: pipeline stages report the same layer numbers (stage-local "
            "module names); keys use pp<stage>_<layer> labels",
            RuntimeWarning,
            stacklevel=3,
        )
    table = []
    for stage, (_, routers) in enumerate(stages):
        for pos, (label, key, aux) in enumerate(routers):
            name = f"pp{stage}_{label}" if clash else label
            table.append((tuple(key), stage, pos, name, aux))
    table.sort(key=lambda row: (row[0], row[1], row[2]))
    me = group_rank(pp)
    index = {(stage, pos): i for i, (_, stage, pos, _, _) in enumerate(table)}
    return _Layout(
        labels=[row[3] for row in table],
        has_aux=[row[4] for row in table],
        num_experts=sizes.pop(),
        rows=[index[(me, pos)] for pos in range(len(capture.routers))],
    )


def _no_router_message(model_name: str) -> str:
    return (
        f"LoadBalanceMonitor found no router in {model_name}. It looks for "
        "trainvitals.moe.TopKRouter, the Hugging Face routers "
        f"{', '.join(sorted(HF_ROUTER_CLASSES))} (and transformers classes named *TopKRouter "
        "with num_experts and top_k), torchtitan MoE modules (a tokens_per_expert_E / "
        "tokens_per_expert buffer), and extractors registered with "
        "trainvitals.moe.capture.register_router_extractor or passed as extractors=."
    )
