"""LoadBalanceMonitor: how evenly the routers of a mixture-of-experts model spread tokens."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals._device import index_on
from trainvitals.adapters.context import BatchInfo, RunContext
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.distributed import (
    _collective_device,
    all_gather_objects,
    all_reduce_by_groups,
    group_rank,
    group_size,
)
from trainvitals.moe.capture import (
    HF_ROUTER_CLASSES,
    RouterCapture,
    unpack_loads,
    unpack_z_losses,
)
from trainvitals.stats.load_balance import (
    AGGREGATES,
    LAYER_METRICS,
    UTILIZATION_QUANTILES,
    aggregate_across_layers_lists,
    load_balance_stats_lists,
)

__all__ = ["LoadBalanceMonitor"]

_MODES = ("brief", "detailed")
# Across-layer aggregates written in both modes (NeMo Automodel names for cv, dead expert
# fraction and diversity; the same pattern for the overload factor).
_AGGREGATED = ("cv", "dead_expert_frac", "expert_diversity", "max_overload_factor")


class LoadBalanceMonitor(VitalsCallback):
    """Expert load balance of every MoE layer, counted over all micro-batches of each step.

    At ``run_start`` the monitor finds the model's routers (see :mod:`trainvitals.moe.capture`:
    ``TopKRouter``, the Hugging Face MoE routers listed in ``docs/load_balance.md`` (Mixtral,
    Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, HunYuan-MoE, Llama 4 and any transformers
    ``*TopKRouter``), torchtitan ``MoE``, and your own extractors) and hooks them, without
    changing the model. Every training forward of a logging step, i.e. every micro-batch,
    is counted on the device into one ``[layers, experts]`` table (evaluation, any forward
    between ``validation_start`` and ``validation_end`` even in training mode, and
    activation-checkpoint re-runs are not counted); for ``TopKRouter`` the hook only keeps the
    forward's routing map and the step's maps are counted together when it is read. At the end of a logging
    step the counts of all layers, and the aux-loss (and z-loss) sums when routers report
    them, are summed over the data- and context-parallel ranks (``ctx.groups.dp_cp``) in ONE
    collective (plus one over ``ctx.groups.pp`` with pipeline stages) of one buffer
    (:meth:`~trainvitals.moe.capture.RouterCapture.packed`), the summed ``[layers, experts]``
    counts come to the host in one transfer (over gloo, which reduces host tensors, that
    transfer comes before the collective), and the statistics are computed there in float64
    (:func:`trainvitals.stats.load_balance.load_balance_stats_lists`: a matrix this small costs
    tens of microseconds on the host, against ~35 small kernels on the device) and written
    together. Ties among the top/bottom experts go to the lowest layer, then expert. The hooks count only during steps that will be logged (a host-side flag
    set at each micro-batch and step end), and the counts are zeroed on the device at every
    step end: a non-logging step costs a Python check per router forward and nothing else (no
    kernel, no sync, no collective).

    A logging step that ran training micro-batches while no router hook ran, in it or in any
    logging step since run start (a host flag, :attr:`RouterCapture.fired`), is no
    measurement: a model compiled and run before the monitor attached (Dynamo never calls
    hooks added later), a forward calling ``router.forward`` directly, or routers found on
    another model than the one trained. It writes no key (zero loads would read as measured)
    and moves no dead-expert streak, and warns once with these causes and their fixes; with
    several ranks, a rank in that state sends NaN ("not measured") through the step's
    collective, so its layers are left out on every rank instead of summed without it (a
    silent pipeline stage's layers only: the other stages' are written). Once a hook has run,
    a step without one routed nothing (its micro-batches skipped the MoE layers) and is
    written as such, without a warning.

    A router that router capture gives up on (its counting raised, or its output was not the
    kind it reads; warned once: "no longer counted") is likewise not measured from that step
    on: its layer's values are NaN in the collective, so the layer is left out on every rank
    (not the other ranks' tokens written as the step's), and a step in which no layer was
    measured writes nothing. Its dead-expert streaks are kept as they were when it was given
    up (a layer not measured is no evidence) but, like every other key of the layer, left out
    of ``moe/dead_experts_persistent`` while it is not measured.

    CV uses the population standard deviation (NeMo Automodel uses ``n - 1``; multiply ours by
    ``sqrt(E / (E - 1))`` to compare). Quantiles interpolate linearly. Layers that routed no
    tokens in the step get no per-layer keys and are left out of the aggregates (their
    statistics would be undefined, not "balanced"). A layer's aux loss that is NaN or infinite
    (a diverged router) is written as it is, and a NaN makes the ``moe/aux_loss_*`` aggregates
    NaN; layers that report no aux loss are left out of them. Experts without compute, which
    the capture counts as a router's last columns (ZAYA's skip expert, LongCat-Flash's zero
    experts), are no experts here: every statistic, ``E`` and ``<e>`` included, is over the
    experts that compute (a skip expert is meant to be chosen rarely, not to get a fair share,
    and would read as dead), and their assignments are written as ``tokens_skipped``; a layer
    whose tokens all went to them has no load statistics. ``<l>`` in keys is the layer
    number from the module name (``model.layers.10.mlp.gate`` -> 10), ordered numerically.

    With pipeline parallelism (``ctx.groups.pp`` of more than one rank) the stages agree on
    their layers once at run start, and each logging step adds one SUM over the pipeline group,
    so every rank, the writing one included, reports the layers of all stages. Layer numbers
    are expected to be global across stages (torchtitan keeps ``layers.<i>`` of the full
    model); when two stages report the same number (stage-local numbering, as Megatron's
    ``decoder.layers.0`` on every stage) the labels are prefixed ``pp<stage>_``, with a warning,
    and the layers are ordered as in the full model: stage 0's, then stage 1's, ...
    (``pp0_0, pp0_1, pp1_0, pp1_1``), which is also the order ties among the top/bottom experts
    follow.

    Configuration errors are raised at ``run_start`` (``ValueError``, or the ``TypeError`` of a
    bad extractor), on every rank, before any training step: no router found, routers (or
    pipeline stages) with different numbers of experts, an extractor whose number of experts
    is unknown, and ranks of ``ctx.groups.dp_cp`` whose routers differ (their tables are summed
    element by element: e.g. pipeline stages passed as data-parallel ranks, which would be
    added into each other's rows). With several ranks the check costs one ``all_gather_object``
    over ``dp_cp`` (and one over ``pp``) once per run; a rank's own error is raised after it,
    so no rank is left waiting. That holds for any exception raised while the routers are
    found (e.g. an extractor's ``num_experts`` callable raising ``RuntimeError``): every rank
    raises a ``ValueError`` naming it (the failing rank's chained to the original).

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

    Keys written (on logging steps, each describing that step alone: the steps between two
    logging steps are not counted; "load" = token-to-expert assignments, a token routed to
    ``k`` experts counts ``k`` times; utilization = load / (layer's load / E)):

    =================================================  ===============================================  =======
    key                                                meaning                                          unit
    =================================================  ===============================================  =======
    ``moe/cv_{mean,median,min,max}``                   CV (std/mean of the loads) across layers         1
    ``moe/dead_expert_frac_{mean,median,min,max}``     fraction of a layer's experts with no token      1
    ``moe/expert_diversity_{mean,median,min,max}``     ``exp(entropy of the load distribution) / E``    1
    ``moe/max_overload_factor_{mean,median,min,max}``  a layer's max load / its mean load               ratio
    ``moe/aux_loss_{mean,median,min,max}``             the layers' Switch aux loss before its           1
                                                       coefficient (1.0 = balanced), mean over the
                                                       step's micro-batches and ranks: TopKRouter's
                                                       ``last_aux_loss``, an extractor's, or from the
                                                       router logits of HF routers whose family
                                                       trains with ``load_balancing_loss_func``
    ``moe/z_loss_{mean,median,min,max}``               the layers' router z-loss before its             logit^2
                                                       coefficient, mean over the step's micro-batches
                                                       and ranks of each forward's mean over its tokens
                                                       (padding included) of ``logsumexp(logits)**2``:
                                                       Switch Transformers' ``router_z_loss_func``
                                                       (only written for Switch Transformers routers)
    ``moe/expert_utilization_<q>``                     quantiles of the utilization of all experts of   ratio
                                                       all layers together, ``<q>`` one of ``min``,
                                                       ``p25``, ``median``, ``p75``, ``max``
    ``moe_expert_utilization/layer_<l>_expert_<e>``    utilization of the ``top_k`` highest and         ratio
                                                       ``top_k`` lowest experts overall
    ``moe/dead_experts_persistent``                    experts with no token for at least               count
                                                       ``dead_expert_patience`` logging steps in a row
                                                       (when the patience is set), in the layers
                                                       measured at the step
    ``moe/layer_<l>/cv``                               the layer's CV (detailed)                        1
    ``moe/layer_<l>/dead_expert_frac``                 (detailed)                                       1
    ``moe/layer_<l>/expert_diversity``                 (detailed)                                       1
    ``moe/layer_<l>/max_overload_factor``              (detailed)                                       ratio
    ``moe/layer_<l>/utilization_<q>``                  quantiles of the layer's utilizations            ratio
                                                       (detailed), ``<q>`` as above
    ``moe/layer_<l>/aux_loss``                         the layer's aux loss (detailed, when known)      1
    ``moe/layer_<l>/z_loss``                           the layer's z-loss (detailed, when known)        logit^2
    ``moe/layer_<l>/tokens_per_expert/<e>``            tokens routed to expert ``e`` in the step,       tokens
                                                       summed over micro-batches and ranks (detailed)
    ``moe/layer_<l>/tokens_skipped``                   assignments to the layer's experts without       tokens
                                                       compute (ZAYA's skip expert, LongCat-Flash's
                                                       zero experts), summed like tokens_per_expert
                                                       (detailed, only for such routers)
    =================================================  ===============================================  =======
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
        self._layout = _Layout([], [], 0, None, 0)
        # pipeline stages: (device, positions of this stage's packed values in the table of
        # all stages' layers), made at the first logging step of a layout
        self._table_index: tuple[torch.device, torch.Tensor] | None = None
        self._keys_cached: _Keys | None = None
        # Consecutive logging steps each expert had no token, per layer label (host ints).
        self._dead_streak: dict[str, list[int]] = {}
        # Between validation_start and validation_end the hooks count nothing; whether they
        # count once it ends (the step's own flag, kept up to date by step_end meanwhile).
        self._validating = False
        self._count_after_validation = False
        # A router hook has run in a logging step of this capture (host flag): then a later
        # step without one routed nothing (its micro-batches skipped the MoE layers).
        self._hooks_seen = False

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        """Find the routers and hook them."""
        if ctx.model is None:
            raise ValueError("LoadBalanceMonitor needs the model (ctx.model is None)")
        if self.capture is not None:
            self.capture.remove()
        capture, layout = _capture_and_layout(ctx.model, self.extractors, ctx.groups)
        self.capture = capture
        self._layout = layout
        self._table_index = None
        self._hooks_seen = False  # (new hooks)
        self._validating = False  # a validation that raised before its end is over
        for label in layout.labels:
            streak = self._dead_streak.get(label)
            if streak is None or len(streak) != layout.computed:
                self._dead_streak[label] = [0] * layout.computed
        self._set_counting(self.should_log(ctx))

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        """Count only in steps that will be logged (a host-side flag, nothing on the device)."""
        if self.capture is not None:
            self._set_counting(self.should_log(ctx))

    def validation_start(self, ctx: RunContext) -> None:
        """Validation forwards are not training: none is counted, also those of a loop that
        validates in training mode with autograd on (no ``model.eval()`` / ``no_grad``), which
        the hooks cannot tell from a training forward. MoEMetricsMonitor keeps its values
        apart during validation the same way."""
        self._validating = True
        if self.capture is not None:
            self.capture.enabled = False

    def validation_end(self, ctx: RunContext) -> None:
        """Counting resumes as the step's flag says (validation may run mid-step)."""
        self._validating = False
        if self.capture is not None:
            self.capture.enabled = self._count_after_validation

    def _set_counting(self, enabled: bool) -> None:
        assert self.capture is not None
        self._count_after_validation = enabled
        self.capture.enabled = enabled and not self._validating

    def step_end(self, ctx: RunContext) -> None:
        """Report the step's loads on logging steps, then zero them (every step)."""
        if self.capture is None:
            return
        try:
            if self.should_log(ctx):
                self._report(ctx)
        finally:
            self.capture.reset()
            self._set_counting(self.should_log(ctx, ctx.step + 1))

    def run_end(self, ctx: RunContext) -> None:
        self._remove_hooks()

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._remove_hooks()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove_hooks()
        super().teardown(trainer, pl_module, stage)

    def release(self, ctx: RunContext) -> None:
        """Disabled by the guard: no later step_end reads or zeroes the counts, so the router
        hooks go and the capture with its device counts is dropped. The capture is this
        monitor's own (made at run_start, used by nothing else); the next run makes a new one."""
        self._remove_hooks()
        self.capture = None

    def _remove_hooks(self) -> None:
        if self.capture is not None:
            self.capture.remove()

    # ------------------------------------------------------------------ the logging step

    def _report(self, ctx: RunContext) -> None:
        capture = self.capture
        assert capture is not None
        layout = self._layout
        num_layers, num_experts = len(layout.labels), layout.num_experts
        z_sum = z_count = [0.0] * num_layers
        silent = self._hooks_silent(ctx)
        if layout.rows is None and group_size(ctx.groups.dp_cp) == 1 and not any(layout.has_z):
            if silent:
                self._warn_hooks_silent(ctx)
                return
            # Nothing to reduce: the step's counts and aux sums come to the host in one
            # transfer (a few kernels, none per layer or micro-batch); the aux counts are host
            # ints already.
            rows, aux_sum, aux_count = capture.read_host()
            for i in capture.broken:  # no longer counted: not measured (see _reduce_to_host)
                rows[i] = [math.nan] * num_experts
                aux_count[i] = 0
        else:
            # (z-losses: the packed buffer, one transfer; its reduction over one rank is a copy)
            host = self._reduce_to_host(ctx, silent)
            if silent:  # (after the collective, which every rank takes part in)
                self._warn_hooks_silent(ctx)
                if layout.rows is None:
                    return
                # pipeline: the other stages' layers are measured; this stage's are NaN
            aux_count = host[num_layers * (num_experts + 1) : num_layers * (num_experts + 2)]
            rows, aux_sum = unpack_loads(host, num_layers, num_experts)
            z_sum, z_count = unpack_z_losses(host, num_layers, num_experts)
        if all(any(v != v for v in row) for row in rows):
            # No layer measured (NaN: a rank whose hooks never ran, or whose callback failed;
            # routers no longer counted): nothing to write on any rank, not even the dead-expert
            # count (the ranks that measured wrote it as if the step had been counted).
            return
        values = self._values(rows, aux_sum, aux_count, z_sum, z_count)
        computed = layout.computed
        if computed < num_experts:  # the experts that compute, without the no-compute columns
            rows = [row[:computed] for row in rows]
        values.update(self._update_dead_streaks(ctx, rows))
        self.write(ctx, values)

    def _hooks_silent(self, ctx: RunContext) -> bool:
        """Whether this rank's zero counts are no measurement: the step ran training
        micro-batches, this rank has routers, and no router hook has run in any logging step
        since they were hooked (host flags only). After a hook has run, a step without one
        routed nothing (micro-batches that skip the MoE layers); a step without micro-batches
        (validation only) has nothing to say."""
        capture = self.capture
        assert capture is not None
        if capture.fired:
            self._hooks_seen = True
            return False
        return not self._hooks_seen and bool(capture.routers) and ctx.micro_batches_in_step > 0

    def _warn_hooks_silent(self, ctx: RunContext) -> None:
        assert self.capture is not None
        self.warn_once(
            "hooks_silent",
            f"no router hook ran in logging step {ctx.step} ({ctx.micro_batches_in_step} "
            f"training micro-batch(es)), nor in any logging step since the {len(self.capture)} "
            "router(s) were hooked at run start: no load is known, so nothing is written for "
            "such steps (not zeros, not 'no dead expert'). Likely causes: the model was "
            "compiled (torch.compile) and run before the monitor attached, and code compiled "
            "then never calls hooks added later (Dynamo does not guard on module hooks: "
            "torch._dynamo.config.skip_nnmodule_hook_guards): attach before the compiled "
            "model's first forward, or call torch.compiler.reset() after attaching; the "
            "forward calls router.forward(x) (or a functional copy) instead of router(x), "
            "which skips module hooks: call the routers through __call__; or the model given "
            "to the monitor is not the one trained (a copy; a LightningModule vs an inner "
            "model built later). If this step's micro-batches skipped the MoE layers, ignore "
            "this; warned once",
        )

    def _reduce_to_host(self, ctx: RunContext, silent: bool = False) -> list[float]:
        """The step's loads ``[L, E]`` (row-major), aux sums and aux counts ``[L]`` (and z-loss
        sums and counts ``[L]`` when a layer has a z-loss) summed over the ranks, as host floats:
        one buffer (:meth:`RouterCapture.packed`), one collective per
        group, one device->host transfer. ``silent`` (:meth:`_hooks_silent`): this rank's
        values are sent as NaN, "not measured", so the sums of its layers are NaN on every
        rank and left out, not the loads of the other ranks alone."""
        capture = self.capture
        assert capture is not None
        layout = self._layout
        # Everything the host needs in one buffer: the [L, E] loads and the aux sums and counts
        # (a few hundred float64 values). The statistics are then computed on the host in
        # float64 (stats.load_balance_stats_lists): tens of microseconds instead of ~35 small
        # device kernels, with the same formulas.
        packed = capture.packed(device=capture.device or ctx.device)
        if silent:
            packed.fill_(math.nan)  # (a new tensor; before the pipeline table's zeros)
        elif capture.broken:
            # Routers no longer counted on this rank: their layers' counts would be the other
            # ranks' tokens alone, summed as if complete. NaN ("not measured") instead, like
            # a silent rank's, so those layers are left out on every rank.
            broken = _packed_positions(
                sorted(capture.broken), len(capture), capture.num_experts, capture.has_z_loss
            )
            packed[index_on(broken, packed.device)] = math.nan
        if layout.rows is None:
            # One SUM collective over data x context parallel carries every layer (and the aux).
            groups: tuple[Any, ...] = (ctx.groups.dp_cp,)
        else:
            # Pipeline stages: this stage's values in the table of all stages' layers, summed
            # over data x context parallel, then over the stages: one collective per group.
            packed = self._stage_table(packed)
            groups = tuple(g for g in (ctx.groups.dp_cp, ctx.groups.pp) if g is not None)
        reduced = [g for g in groups if group_size(g) > 1]
        if reduced and all(_collective_device(g, packed.device).type == "cpu" for g in reduced):
            # gloo reduces host tensors: copy the buffer to the host once and reduce it there
            # (from an accelerator, each reduction would copy it to the host and back)
            packed = packed.cpu()
        (packed,) = all_reduce_by_groups([(packed, groups)], "sum")
        # (to the host first: MPS has no float64, its counts are float32)
        return packed.cpu().to(torch.float64).tolist()

    def _stage_table(self, packed: torch.Tensor) -> torch.Tensor:
        """This stage's :meth:`RouterCapture.packed` values placed in the zeroed buffer of the
        same layout for all stages' layers (``n * (E + 2)`` values, ``n * (E + 4)`` when some
        stage's layers have a z-loss; a stage may have none)."""
        layout = self._layout
        rows, n, e = layout.rows, len(layout.labels), layout.num_experts
        assert rows is not None
        cached = self._table_index
        if cached is None or cached[0] != packed.device:
            # this stage's buffer holds its rows' values in the same order (z-losses when it
            # has them)
            has_z = self.capture is not None and self.capture.has_z_loss
            positions = index_on(_packed_positions(rows, n, e, has_z), packed.device)
            cached = self._table_index = (packed.device, positions)
        size = n * (e + (4 if any(layout.has_z) else 2))
        full = torch.zeros(size, dtype=packed.dtype, device=packed.device)
        return full.index_copy_(0, cached[1], packed)

    def _values(
        self,
        rows: list[list[float]],
        aux_sum: list[float],
        aux_count: list[float],
        z_sum: list[float],
        z_count: list[float],
    ) -> dict[str, float]:
        """The values of one report, by key (Python floats): the finite load statistics and
        the aux losses and z-losses of the layers that reported one (NaN and inf included)."""
        keys = self._key_cache()
        computed = self._layout.computed
        skipped: list[float] = []
        if computed < self._layout.num_experts:
            # no-compute experts (ZAYA's skip expert, LongCat-Flash's zero experts): their
            # assignments are not an expert's load, so the statistics are over the others
            skipped = [sum(row[computed:]) for row in rows]
            rows = [row[:computed] for row in rows]
        stats = load_balance_stats_lists(rows, top_k=self.top_k)
        detailed = self.mode == "detailed"
        aux_keys = [aux_key for aux_key, _ in keys.layer]
        loss_values = _layer_losses(aux_sum, aux_count, keys.aux_aggregates, aux_keys, detailed)
        loss_values.update(_layer_losses(z_sum, z_count, keys.z_aggregates, keys.z_layer, detailed))
        names: list[str] = list(keys.aggregates)
        numbers: list[float] = [v for row in stats.aggregates[: len(_AGGREGATED)] for v in row]
        names += keys.utilization_quantiles
        numbers += stats.utilization_quantiles
        expert_keys = keys.expert
        names += [expert_keys[i] for i in stats.top_indices]
        numbers += stats.top_values
        names += [expert_keys[i] for i in stats.bottom_indices]
        numbers += stats.bottom_values
        if detailed:
            names += keys.per_layer
            numbers += [v for metric in stats.per_layer for v in metric]
            for i, ((_, token_keys), row) in enumerate(zip(keys.layer, rows, strict=True)):
                if skipped and (any(row) or skipped[i]):
                    names.append(keys.skipped[i])
                    numbers.append(skipped[i])
                if any(row):
                    names += token_keys
                    numbers += row
        values = {k: v for k, v in zip(names, numbers, strict=True) if math.isfinite(v)}
        values.update(loss_values)
        return values

    def _key_cache(self) -> _Keys:
        """The key strings of the current layout, built once per layout (not per step)."""
        layout = self._layout
        signature = (
            tuple(layout.labels),
            tuple(layout.has_aux),
            tuple(layout.has_z),
            layout.num_experts,
            layout.computed,
            self.mode,
        )
        cached = self._keys_cached
        if cached is not None and cached.signature == signature:
            return cached
        labels, num_experts = layout.labels, layout.computed
        aggregates = [f"moe/{metric}_{agg}" for metric in _AGGREGATED for agg in AGGREGATES]
        if LAYER_METRICS[: len(_AGGREGATED)] != _AGGREGATED:
            raise AssertionError("LAYER_METRICS must start with the aggregated metrics")
        cached = _Keys(
            signature=signature,
            aggregates=aggregates,
            aux_aggregates=(
                [f"moe/aux_loss_{agg}" for agg in AGGREGATES] if any(layout.has_aux) else []
            ),
            z_aggregates=([f"moe/z_loss_{agg}" for agg in AGGREGATES] if any(layout.has_z) else []),
            z_layer=[
                f"moe/layer_{label}/z_loss" if has_z else None
                for label, has_z in zip(labels, layout.has_z, strict=True)
            ],
            utilization_quantiles=[
                f"moe/expert_utilization_{name}" for name, _ in UTILIZATION_QUANTILES
            ],
            expert=[
                f"moe_expert_utilization/layer_{label}_expert_{e}"
                for label in labels
                for e in range(num_experts)
            ],
            per_layer=[
                f"moe/layer_{label}/{metric}" for metric in LAYER_METRICS for label in labels
            ],
            layer=[
                (
                    f"moe/layer_{label}/aux_loss" if has_aux else None,
                    [f"moe/layer_{label}/tokens_per_expert/{e}" for e in range(num_experts)],
                )
                for label, has_aux in zip(labels, layout.has_aux, strict=True)
            ],
            skipped=[f"moe/layer_{label}/tokens_skipped" for label in labels],
        )
        self._keys_cached = cached
        return cached

    def _update_dead_streaks(self, ctx: RunContext, loads: list[list[float]]) -> dict[str, float]:
        if self.dead_expert_patience is None:
            return {}
        patience = self.dead_expert_patience
        num_experts = self._layout.computed
        newly_dead: list[str] = []
        persistent = 0
        for label, row in zip(self._layout.labels, loads, strict=True):
            streak = self._dead_streak.get(label)
            if streak is None or len(streak) != num_experts:
                # new layer, or a state loaded after run_start from a model with other experts
                streak = self._dead_streak[label] = [0] * num_experts
            # Only a layer that routed tokens is evidence: one that routed nothing this step,
            # or whose loads are NaN ("not measured": a peer rank's callback failed, on
            # accelerators), keeps its streaks.
            if sum(row) > 0:
                for e, load in enumerate(row):
                    streak[e] = streak[e] + 1 if load == 0 else 0
                    if streak[e] == patience:
                        newly_dead.append(f"layer {label} expert {e}")
            # A streak kept through a step without evidence is still a streak: count it, or
            # the count dips whenever a layer (or the whole step) routed nothing. A layer not
            # measured (NaN: a router given up, a silent rank) is left out of the count as of
            # every other key of the step; its streaks wait for it (a router given up for good
            # would otherwise hold its last count for the rest of the run).
            if not any(v != v for v in row):  # (NaN: not measured)
                persistent += sum(s >= patience for s in streak)
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
        if self.capture is not None:
            # A restore in the middle of a step (a rollback) replays that step from its start:
            # what was counted since the last step end belongs to the abandoned timeline.
            self.capture.reset()


@dataclass
class _Keys:
    """The key strings of one layout, in the order :meth:`LoadBalanceMonitor._values` fills."""

    signature: tuple[Any, ...]
    aggregates: list[str]  # _AGGREGATED x AGGREGATES
    aux_aggregates: list[str]  # AGGREGATES, or none when no layer has an aux loss
    z_aggregates: list[str]  # AGGREGATES, or none when no layer has a z-loss
    z_layer: list[str | None]  # per layer: z-loss key
    utilization_quantiles: list[str]
    expert: list[str]  # by flat index layer_pos * E + expert
    per_layer: list[str]  # LAYER_METRICS x layers (detailed)
    layer: list[tuple[str | None, list[str]]]  # per layer: aux key, tokens-per-expert keys
    skipped: list[str]  # per layer: tokens to its no-compute experts


@dataclass
class _Layout:
    """The layers a report covers: this rank's, or with pipeline parallelism every stage's."""

    labels: list[str]
    has_aux: list[bool]
    num_experts: int  # columns of the loads table
    rows: list[int] | None  # row of each local router in the table of all stages; None: local
    # the first `computed` columns are experts that compute; the others are no-compute experts
    # (ZAYA's skip expert, LongCat-Flash's zero experts), left out of the statistics
    computed: int
    has_z: list[bool] = field(default_factory=list)  # per label: the router reports a z-loss


def _layer_losses(
    sums: list[float],
    counts: list[float],
    aggregate_keys: list[str],
    layer_keys: list[str | None],
    detailed: bool,
) -> dict[str, float]:
    """The across-layer aggregates (and, ``detailed``, the per-layer values) of a per-layer
    loss given as sums and counts over the step's forwards (aux loss, z-loss).

    A layer's loss is known when some forward reported one (count > 0; a NaN count is a step
    not measured). A known value is written as it is, NaN or inf included (a diverged router
    must show, as in MoEMetricsTracker), and a NaN among them makes the aggregates NaN rather
    than the aggregates of the other layers; only layers with no value are left out."""
    means = [s / c if c > 0 else None for s, c in zip(sums, counts, strict=True)]
    values: dict[str, float] = {}
    known = [m for m in means if m is not None]
    if aggregate_keys and known:
        aggregated = (
            [math.nan] * len(AGGREGATES)
            if any(m != m for m in known)
            else aggregate_across_layers_lists(known)
        )
        values.update(zip(aggregate_keys, aggregated, strict=True))
    if detailed:
        for key, mean in zip(layer_keys, means, strict=True):
            if key is not None and mean is not None:
                values[key] = mean
    return values


def _capture_and_layout(
    model: torch.nn.Module, extractors: list[Any], groups: Any
) -> tuple[RouterCapture, _Layout]:
    """The router capture of ``model`` (hooks attached) and the layout of its reports, checked
    at run start so that a configuration error is raised there, on every rank, before any
    training step: no router, routers of different expert counts, an extractor without a
    number of experts (:class:`RouterCapture`), pipeline stages of different expert counts
    (:func:`_layout`), and ranks of ``groups.dp_cp`` whose tables would be summed element by
    element although they hold different layers (:func:`_agree_over_dp_cp`)."""
    model_name = type(model).__name__
    pp, dp_cp = getattr(groups, "pp", None), getattr(groups, "dp_cp", None)
    if group_size(pp) == 1 and group_size(dp_cp) == 1:
        capture = RouterCapture(model, extractors=extractors)
        try:
            return capture, _layout(capture, groups, model_name)
        except BaseException:
            capture.remove()
            raise
    # Several ranks: a configuration error on one rank must reach every rank (they all wait
    # in the same gathers), so it is raised after the ranks agreed.
    # Any exception counts, not only the ValueError/TypeError of a bad configuration: an
    # extractor's num_experts callable may raise anything, and a rank that raised before the
    # gathers would leave its peers waiting in them.
    error: Exception | None = None
    try:
        capture = RouterCapture(model, extractors=extractors)
    except Exception as exc:
        capture, error = RouterCapture(torch.nn.Module()), exc
    layout: _Layout | None = None
    try:
        if group_size(pp) > 1:  # one gather over the stages; raises on every stage alike
            message = None if error is None else f"{type(error).__name__}: {error}"
            layout = _layout(capture, groups, model_name, message)
        elif error is None:
            layout = _layout(capture, groups, model_name)
    except ValueError as exc:
        error = exc
    try:
        _agree_over_dp_cp(layout, error, dp_cp)
    except BaseException:
        capture.remove()
        raise
    assert layout is not None
    return capture, layout


def _agree_over_dp_cp(layout: _Layout | None, error: Exception | None, dp_cp: Any) -> None:
    """Raise ``error`` (this rank's configuration error), or a ``ValueError`` on every rank of
    ``dp_cp`` when one of them had an error or when they do not all have the same layout: their
    ``[layers, experts]`` tables are summed element by element at every logging step, so ranks
    with other layers (e.g. pipeline stages passed in ``dp``/``cp`` instead of ``pp``) would be
    added into the wrong rows, silently when the sizes happen to match, else failing at the
    first logging step. One ``all_gather_object`` over ``dp_cp``, once per run."""
    peers: list[Any] = []
    if group_size(dp_cp) > 1:
        mine = None
        if layout is not None:
            mine = (
                (layout.num_experts, layout.computed),
                layout.labels,
                layout.has_aux,
                layout.rows,
                layout.has_z,
            )
        message = None if error is None else f"{type(error).__name__}: {error}"
        peers = all_gather_objects((mine, message), dp_cp)
    if error is not None and peers and not isinstance(error, ValueError | TypeError):
        # Every rank must raise what run_start lets through (the callback guard disables a
        # callback on other exceptions): the peers raise a ValueError, so does this rank.
        raise ValueError(f"LoadBalanceMonitor: {type(error).__name__}: {error}") from error
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (_, message) in enumerate(peers) if message]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"LoadBalanceMonitor: rank {rank} of ctx.groups.dp_cp: {message}")
    layouts = [mine for mine, _ in peers]
    if any(other != layouts[0] for other in layouts):
        by_layout: dict[str, list[int]] = {}
        for rank, ((num_experts, computed), labels, has_aux, rows, _) in enumerate(layouts):
            text = f"{len(labels)} MoE layers [{', '.join(labels)}] of {num_experts} experts"
            if computed != num_experts:
                text += f" ({num_experts - computed} without compute)"
            if sum(has_aux) != len(has_aux):
                text += f", {sum(has_aux)} with an aux loss"
            if rows is not None:
                text += f", rows {rows} of the pipeline table"
            by_layout.setdefault(text, []).append(rank)
        detail = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
            for text, ranks in by_layout.items()
        )
        raise ValueError(
            "LoadBalanceMonitor: the ranks of ctx.groups.dp_cp, whose expert loads are summed "
            f"element by element, have different routers ({detail}); they must hold the same "
            "MoE layers (pipeline stages belong in groups.pp, not in dp or cp)"
        )


def _layout(
    capture: RouterCapture, groups: Any, model_name: str, error: str | None = None
) -> _Layout:
    labels = capture.layer_labels
    has_aux = [r.has_aux_loss for r in capture.routers]
    has_z = [r.has_z_loss for r in capture.routers]
    pp = getattr(groups, "pp", None)
    if group_size(pp) == 1:
        if not labels:
            raise ValueError(_no_router_message(model_name, capture.fullgraph_routers))
        computed = _computed_experts(capture)
        return _Layout(labels, has_aux, capture.num_experts, None, computed, has_z)
    mine = [(r.label, r.sort_key[:2], r.has_aux_loss, r.has_z_loss) for r in capture.routers]
    sizes_mine = (capture.num_experts, 0)
    if error is None and capture.routers:
        try:
            sizes_mine = (capture.num_experts, _computed_experts(capture))
        except ValueError as exc:
            error = str(exc)
    stages = all_gather_objects((sizes_mine, mine, error), pp)  # once, at run start
    errors = [(stage, err) for stage, (_, _, err) in enumerate(stages) if err]
    if errors:
        raise ValueError(f"LoadBalanceMonitor: pipeline stage {errors[0][0]}: {errors[0][1]}")
    stages = [(e, routers) for e, routers, _ in stages]
    sizes = {e for e, routers in stages if routers}
    if len(sizes) > 1:
        raise ValueError(
            f"LoadBalanceMonitor: the pipeline stages have routers with different numbers of "
            f"experts {sorted(e for e, _ in sizes)} (of which computing "
            f"{sorted(c for _, c in sizes)}); they must all be the same"
        )
    if not sizes:
        raise ValueError(_no_router_message(model_name, capture.fullgraph_routers))
    seen: dict[str, int] = {}
    for _, routers in stages:
        for label, *_ in routers:
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
        for pos, (label, key, aux, z) in enumerate(routers):
            name = f"pp{stage}_{label}" if clash else label
            table.append((tuple(key), stage, pos, name, aux, z))
    # Global layer order. Global numbers (torchtitan's layers.<i>): by number, the stage only
    # breaking ties. Stage-local numbers (every stage from layers.0): stage 0's layers first,
    # then stage 1's, ..., each stage's by number (not pp0_0, pp1_0, pp0_1, ...).
    if clash:
        table.sort(key=lambda row: (row[1], row[0], row[2]))
    else:
        table.sort(key=lambda row: (row[0], row[1], row[2]))
    me = group_rank(pp)
    index = {(stage, pos): i for i, (_, stage, pos, *_) in enumerate(table)}
    num_experts, computed = sizes.pop()
    return _Layout(
        labels=[row[3] for row in table],
        has_aux=[row[4] for row in table],
        num_experts=num_experts,
        rows=[index[(me, pos)] for pos in range(len(capture.routers))],
        computed=computed,
        has_z=[row[5] for row in table],
    )


def _computed_experts(capture: RouterCapture) -> int:
    """How many of the capture's ``E`` columns are experts that compute: all of them, except
    for routers whose last columns are experts without compute
    (:attr:`trainvitals.moe.capture.RouterInfo.computed_experts`: ZAYA's skip expert,
    LongCat-Flash's zero experts). Raises ``ValueError`` when the routers disagree."""
    columns = capture.num_experts
    found = set()
    for router in capture.routers:
        computed = router.computed_experts or columns
        found.add(computed)
    if len(found) > 1:
        raise ValueError(
            f"LoadBalanceMonitor: the routers have {columns} columns but different numbers of "
            f"experts that compute {sorted(found)} (the others being skip or zero experts); "
            "they must all be the same"
        )
    return found.pop() if found else columns


def _no_router_message(model_name: str, compiled: list[str] | None = None) -> str:
    if compiled:  # routers found, but none can be hooked
        return (
            f"LoadBalanceMonitor found {len(compiled)} router(s) in {model_name} (e.g. "
            f"{compiled[0]!r}), all inside modules compiled with torch.compile(fullgraph=True): "
            "a hook there would break the graph and Dynamo refuses, so no layer can be "
            "counted. Compile without fullgraph=True, or leave the routers out of the "
            "fullgraph-compiled regions (e.g. compile the blocks' other children), or leave "
            "LoadBalanceMonitor out"
        )
    return (
        f"LoadBalanceMonitor found no router in {model_name}. It looks for "
        "trainvitals.moe.TopKRouter, the Hugging Face routers "
        f"{', '.join(sorted(HF_ROUTER_CLASSES))} (and transformers classes named *TopKRouter "
        "with num_experts and top_k), torchtitan MoE modules (a tokens_per_expert_E / "
        "tokens_per_expert buffer), and extractors registered with "
        "trainvitals.moe.capture.register_router_extractor or passed as extractors=."
    )


def _packed_positions(rows: Iterable[int], n: int, e: int, has_z: bool) -> list[int]:
    """Where the values of layers ``rows`` stand in a :meth:`RouterCapture.packed` buffer of
    ``n`` layers of ``e`` experts, in the buffer's order: row ``r``'s loads at ``r * e``, then
    per-layer blocks of ``n`` values (aux sums at ``n * e + r``, aux counts after them, and,
    when the buffer has them, the z-loss sums and counts)."""
    rows = list(rows)
    index = [r * e + j for r in rows for j in range(e)]
    for block in range(4 if has_z else 2):
        index += [n * (e + block) + r for r in rows]
    return index
