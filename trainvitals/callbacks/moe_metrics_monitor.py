"""``MoEMetricsMonitor``: reports the MoE metrics tracker (router losses, dropped tokens) once per
logging step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.distributed import all_gather_objects, group_size
from trainvitals.moe.router import TopKRouter
from trainvitals.moe.tracker import (
    MoEMetricsTracker,
    _check_layer_freq,
    _check_percentiles,
    _moe_layer_mask,
    _resolve_names,
    get_moe_metrics_tracker,
)

__all__ = ["MoEMetricsMonitor"]


class MoEMetricsMonitor(VitalsCallback):
    """Writes what the MoE layers recorded in the :class:`~trainvitals.moe.MoEMetricsTracker`.

    The routers (:class:`~trainvitals.moe.TopKRouter`, or any code calling
    ``get_moe_metrics_tracker().record(...)``) add their per-layer values into the tracker in
    every training forward, on the device. This callback:

    * ``run_start``: clears the tracker (drops anything recorded before training) and finds
      the MoE layers from the model's routers; under pipeline parallelism from every stage's
      (one ``all_gather_object`` over ``ctx.groups.pp``, at run start only), raising
      ``ValueError`` on every rank when two stages' recording routers (with their
      ``num_layers``) have the same ``layer_number`` (stage-local numbering: the tracker's
      pipeline SUM would add two layers' values), and when the routers' ``num_layers`` is not
      the monitor's ``num_layers`` (+ ``mtp_num_layers``).
    * ``validation_start`` / ``validation_end``: keeps the training values aside during
      validation, so a model that records in evaluation does not mix into them.
    * ``step_end``: resets the routers' per-step ``global_aux_loss`` token counts. On a
      **non-logging step that is all**: the values and their record counts keep accumulating
      on the device, nothing leaves it, no collective. On a **logging step** it calls
      :meth:`~trainvitals.moe.MoEMetricsTracker.report` with ``mean_over_records=True``
      (``loss_scale=1``), the run's process groups and the writer: one ``all_gather_object``
      over the world (the ranks agree on the metric names), one all-reduce per group and
      reduction kind, one device-to-host transfer; then the tracker is zeroed. A metric that
      nothing recorded in the interval, in any layer on any rank of its reductions (no MoE
      forward: a step whose micro-batches skipped the model, a frozen MoE part, another
      monitor that reported the same tracker first), is not written at that step (no mean,
      percentile or per-layer key; warned once): its 0.0 would be no value of the metric.
      The has-records flags already ride in the all-reduces: no collective is added.
    * ``run_end``: reports the steps since the last logging step, at the last step, with any
      micro-batches run after the last optimizer step (when the last step logged, there is no
      step to report them with: they are not written, rather than replace its values).
    * ``load_state_dict`` (a resume, or the driver's rollback to an earlier checkpoint): drops
      what was recorded since the last report and the routers' ``global_aux_loss`` token
      counts, which belong to the abandoned timeline; the next report covers the steps since.

    So a logged per-layer value is the **mean over that layer's router forwards (its records)
    in every optimizer step since the previous logging step** (step 0 alone at step 0), and
    the logged metric the mean of those over the MoE layers: no step is lost or counted twice.
    With one forward per micro-batch and ``log_every_n_steps=1`` it is each step's mean over
    its micro-batches, Megatron's ``loss_scale = 1/num_microbatches``, whatever the gradient
    accumulation. Megatron divides by the micro-batches instead, which assumes one forward per
    micro-batch: a loop running the model twice per micro-batch (R-Drop, adversarial or
    teacher-student training) would log twice each forward's value (a dropped-token fraction
    above 1); here it logs the mean of the forwards. An activation-checkpoint recompute and a
    forward without gradients record nothing and count for nothing. Each rank divides by its
    own counts before the reductions, so under data parallelism the ranks' means are averaged
    (over the ranks that recorded the layer: a rank whose router got no token in the interval
    counts for nothing, not as a 0) and under pipeline parallelism each layer is divided on its
    own stage. A MoE layer no rank recorded in the interval (its router got no token on any
    rank, or its block was skipped, e.g. by layer-drop) has no value: no per-layer key, and the
    mean is over the MoE layers that have a record (of every stage: the has-records flags ride
    in the reductions); a metric without any record in the interval is not written at all.

    Args:
        per_layer_logging: also write one key per MoE layer.
        percentiles: per metric, quantiles over the layers, e.g.
            ``{"load_balancing_loss": [0.5, 0.95]}``.
        track_names: the metric name(s) to report (default: all recorded ones).
        num_layers: transformer layers without MTP (default: the recorded vector length).
        moe_layer_freq: which layers are MoE (int ``f``: ``i % f == 0``; or a 0/1 list); the
            mean is over these layers and per-layer keys are written for these only. Default:
            the layers that have a recording :class:`~trainvitals.moe.TopKRouter` in the model
            (one that knows its global ``layer_number`` and ``num_layers``; a router without
            them records nothing and is ignored), on any pipeline stage; every layer when no
            router records or the recording routers disagree on ``num_layers``. A given
            pattern that makes a recording router's layer dense raises ``ValueError`` at run
            start (its values would enter the mean over the MoE layers uncounted).
        mtp_num_layers: Multi-Token-Prediction layers after the transformer layers.
        tracker: the tracker to report (default: the global one).
        log_every_n_steps: see :class:`~trainvitals.callbacks.base.VitalsCallback`.
        writer: see :class:`~trainvitals.callbacks.base.VitalsCallback`.

    Attributes:
        last_log_string: the console string of the last report (metrics not ending in
            ``loss``, Megatron's ``" name: value |"`` format).
        last_losses: ``{name: value}`` of the last report's metrics ending in ``loss``.

    Keys written (``name`` is the recorded metric; :class:`~trainvitals.moe.TopKRouter`
    records those of the first five rows its configuration uses: the load-balancing loss of its
    ``aux_loss_type``, ``z_loss`` when ``z_loss_coeff > 0`` and ``dropped_token_fraction`` with
    a capacity). A metric that nothing recorded since the previous report (on any layer and
    rank) writes none of its keys at that step:

    ========================================  ================================================  ======
    key                                       meaning                                           unit
    ========================================  ================================================  ======
    ``moe/load_balancing_loss``               Switch aux loss before its coefficient, mean      1
                                              over MoE layers (1.0 = perfect balance)
    ``moe/seq_load_balancing_loss``           per-sequence variant, same scale                  1
    ``moe/global_load_balancing_loss``        global-batch variant (summed over data parallel)  1
    ``moe/z_loss``                            mean logsumexp(logits)^2 (before its coeff)       logit^2
    ``moe/dropped_token_fraction``            fraction of top-k selections dropped by the       1
                                              capacity limit, mean over MoE layers
    ``moe/{name}``                            any other metric recorded into the tracker        as name
                                              (``record(name, ...)``), mean over MoE layers
    ``moe/{name}_p{100q}``                    quantile q over the layers with positive value    as name
                                              (``_p50`` for 0.5, ``_p99.9`` for 0.999)
    ``moe/{name}_layer_{i}``                  the value of layer ``i`` (0-based module index,   as name
                                              ``layers.{i}``), with ``per_layer_logging``;
                                              none for a layer without record in the interval
    ========================================  ================================================  ======

    Example:
        >>> from trainvitals.callbacks import MoEMetricsMonitor
        >>> monitor = MoEMetricsMonitor(per_layer_logging=True,
        ...                             percentiles={"load_balancing_loss": [0.5, 0.95]})
        >>> # lightning.pytorch.Trainer(callbacks=[monitor])  or  Vitals([monitor])
    """

    def __init__(
        self,
        *,
        per_layer_logging: bool = False,
        percentiles: Mapping[str, Sequence[float]] | None = None,
        track_names: str | Sequence[str] | None = None,
        num_layers: int | None = None,
        moe_layer_freq: int | Sequence[int] | None = None,
        mtp_num_layers: int | None = None,
        tracker: MoEMetricsTracker | None = None,
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        if num_layers is not None and (
            isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0
        ):
            raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
        if mtp_num_layers is not None and (
            isinstance(mtp_num_layers, bool)
            or not isinstance(mtp_num_layers, int)
            or mtp_num_layers < 0
        ):
            raise ValueError(f"mtp_num_layers must be an int >= 0 or None, got {mtp_num_layers!r}")
        if tracker is not None and not isinstance(tracker, MoEMetricsTracker):
            raise TypeError(f"tracker must be a MoEMetricsTracker, got {type(tracker).__name__}")
        self.per_layer_logging = bool(per_layer_logging)
        self.percentiles = _check_percentiles(percentiles)
        self.track_names = _resolve_names(track_names)
        self.num_layers = num_layers
        self.moe_layer_freq = _check_layer_freq(moe_layer_freq, num_layers)
        self.mtp_num_layers = mtp_num_layers
        self._tracker = tracker
        self._routers: list[TopKRouter] = []
        self._global_routers: list[TopKRouter] = []
        self._reset_handle: Any = None  # release()'s optimizer hook resetting global tokens
        self._layer_freq: int | list[int] | None = self.moe_layer_freq
        self._pending_steps = 0
        self._validation_snapshot: Any = None
        self.last_log_string = ""
        self.last_losses: dict[str, float] = {}

    @property
    def tracker(self) -> MoEMetricsTracker:
        return self._tracker if self._tracker is not None else get_moe_metrics_tracker()

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        if self._reset_handle is not None:  # (left by release() in an earlier run)
            self._reset_handle.remove()
            self._reset_handle = None
        self._drop_pending()
        model = ctx.model
        self._routers = (
            [m for m in model.modules() if isinstance(m, TopKRouter)] if model is not None else []
        )
        # Only global_aux_loss routers keep per-step token counts (a buffer registered at
        # construction, None otherwise): find them once, not with a module attribute look-up
        # per router at every step.
        self._global_routers = [r for r in self._routers if r.global_tokens_per_expert is not None]
        # (layer_number, num_layers) of this rank's routers; under pipeline parallelism, of
        # every stage's: each rank holds only its stage's routers, and the mean over the MoE
        # layers needs all of them (one object gather over the pipeline group, at run start).
        layers = [(r.layer_number, r.num_layers) for r in self._routers]
        if group_size(ctx.groups.pp) > 1:
            stages = all_gather_objects(layers, ctx.groups.pp)
            _check_stage_layer_numbers(stages)
            layers = [pair for stage in stages for pair in stage]
        _check_router_sizes(layers, self.num_layers, self.mtp_num_layers)
        self._layer_freq = self.moe_layer_freq
        if self._layer_freq is None:
            self._layer_freq = _pattern_from_routers(layers, self.num_layers, self.mtp_num_layers)
        else:
            _check_routers_in_moe_layers(
                layers, self._layer_freq, self.num_layers, self.mtp_num_layers
            )

    def validation_start(self, ctx: RunContext) -> None:
        self._validation_snapshot = self.tracker._snapshot()

    def validation_end(self, ctx: RunContext) -> None:
        if self._validation_snapshot is not None:
            self.tracker._restore(self._validation_snapshot)
            self._validation_snapshot = None

    def step_end(self, ctx: RunContext) -> None:
        self._pending_steps += 1
        for router in self._global_routers:
            router.reset_global_tokens()
        if self.should_log(ctx):
            self._report(ctx, ctx.step)

    def run_end(self, ctx: RunContext) -> None:
        if self._pending_steps:
            # Micro-batches run after the last optimizer step (a loader whose length is not a
            # multiple of the accumulation) recorded into the tracker too, with their counts:
            # the report is the mean over every forward it holds.
            self._report(ctx, max(ctx.step - 1, 0))

    def release(self, ctx: RunContext) -> None:
        """Disabled by the guard. This monitor installs no hook (the routers record into the
        tracker themselves) and leaves the tracker alone: it may be shared with another
        monitor or read by the user. It drops what it holds: a validation snapshot (device
        copies of the tracker) and its references to the routers.

        One duty stays: ``global_aux_loss`` routers average their token counts over the
        micro-batches since their last reset, which this monitor did at every step end. That
        is training state (the loss's gradient), so a telemetry failure must not change it:
        the resets go on from the first optimizer's post-step hook until the next run."""
        self._validation_snapshot = None
        routers, self._global_routers = self._global_routers, []
        self._routers = []
        if routers and ctx.optimizers:

            def reset_global_tokens(*_: Any) -> None:
                for router in routers:
                    router.reset_global_tokens()

            self._reset_handle = ctx.optimizers[0].register_step_post_hook(reset_global_tokens)

    def _drop_pending(self) -> None:
        """Zero the tracker (values and record counts) and forget the steps not yet reported."""
        self.tracker.clear()
        self._pending_steps = 0

    # ------------------------------------------------------------------ what it writes

    def _report(self, ctx: RunContext, step: int) -> None:
        losses: dict[str, Any] = {}
        # The mean over each layer's records, not the sum over the micro-batches: a loop may
        # run the model more than once per micro-batch (R-Drop, adversarial, teacher-student).
        self.last_log_string = self.tracker.report(
            loss_scale=1.0,
            iteration=step,
            writer=self.writer(ctx),
            per_layer_logging=self.per_layer_logging,
            track_names=self.track_names,
            num_layers=self.num_layers,
            moe_layer_freq=self._layer_freq,
            mtp_num_layers=self.mtp_num_layers,
            total_loss_dict=losses,
            percentiles=self.percentiles,
            groups=ctx.groups,
            mean_over_records=True,
            # A metric nothing recorded in the interval (no router forward: a step whose
            # micro-batches skipped the model, a frozen MoE part, another monitor that reported
            # this tracker first) has no value: its 0.0 is not a possible loss (1.0 is perfect
            # balance), so nothing is written for it at this step.
            skip_unrecorded=True,
            # Likewise a MoE layer nothing recorded in the interval (its router got no token on
            # any rank, a layer skipped by layer-drop): no per-layer key, and out of the mean
            # over the layers (written as 0, four layers at 1.0 with one of them unrecorded
            # gave 0.75).
            skip_unrecorded_layers=True,
        )
        self.last_losses = losses
        self._pending_steps = 0
        unrecorded = self.tracker._last_unrecorded
        if unrecorded and ctx.global_rank == 0:
            self.warn_once(
                "unrecorded",
                f"no router recorded {', '.join(unrecorded)} since the previous report (no MoE "
                f"forward in the logging interval), so nothing is written for that metric at "
                f"step {step} (not 0.0); warned once",
            )
        elif not self.last_log_string and not losses and ctx.global_rank == 0:
            # Nothing written on any rank (the report gathers the names over all ranks): the
            # console string leaves out the losses, which go to total_loss_dict instead.
            self.warn_once(
                "nothing",
                f"nothing was recorded up to step {step}, so nothing is written: no router "
                "records into the MoE metrics tracker (trainvitals.moe.TopKRouter with its "
                "layer_number and num_layers set, or your router calling "
                "get_moe_metrics_tracker().record(...)); for expert loads of other routers "
                "use LoadBalanceMonitor",
            )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        # The values pending since the last logging step live in the tracker on each rank's
        # device, and checkpoints keep one rank's callback state: they are not carried across
        # a resume (the first report after it covers the steps since the resume).
        return {"version": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        # A restore during a run (the driver's rollback to an earlier checkpoint) replays from
        # the restored step: what was recorded since the last report, and the global_aux_loss
        # token counts of a step cut off mid-way, belong to the abandoned timeline. Kept, they
        # would mix into the next report and into the replayed step's loss. Dropped, the next
        # report covers the steps since the restore, as after a resume. No synchronisation:
        # zeroing on the device.
        self._drop_pending()
        self._validation_snapshot = None
        for router in self._global_routers:
            router.reset_global_tokens()


def _check_stage_layer_numbers(stages: list[list[tuple[int | None, int | None]]]) -> None:
    """Raise ``ValueError`` (on every pipeline rank: they all gathered the same list) when two
    stages' routers record into the same layer slot. The tracker SUMs the stages' vectors, so
    stage-local layer numbers (each stage's first MoE layer ``layer_number=1``, as Megatron's
    ``decoder.layers.0`` on every stage) would add two different layers' values into one slot:
    a load-balancing loss near 2 at perfect balance.

    Only the routers that record count, as in :func:`_pattern_from_routers`: a router with a
    ``layer_number`` but no ``num_layers`` records nothing into the tracker (a side router), so
    it shares no slot with another stage's recording router of that number (counting it raised
    this error on a run whose stages record into distinct slots)."""
    owner: dict[int, int] = {}
    for stage, routers in enumerate(stages):
        for number in {n for n, size in routers if n is not None and size is not None}:
            if number in owner:
                raise ValueError(
                    f"MoEMetricsMonitor: pipeline stages {owner[number]} and {stage} both have "
                    f"a TopKRouter with layer_number={number}; the tracker sums the stages' "
                    "per-layer values, so their values would be added together. Give each "
                    "router its global layer number across the stages "
                    "(router.set_layer_number(global_layer + 1, num_layers=total_layers))"
                )
            owner[number] = stage


def _check_router_sizes(
    routers: list[tuple[int | None, int | None]],
    num_layers: int | None,
    mtp_num_layers: int | None,
) -> None:
    """Raise ``ValueError`` at run start when the routers' per-layer vector length (their
    ``num_layers``, MTP slots included) is not the monitor's ``num_layers`` plus
    ``mtp_num_layers``: the tracker would refuse the sizes at the first logging step (the guard
    then disables the monitor), after a logging interval of training time. Routers that do not
    know their size, and a monitor without ``num_layers``, are not checked."""
    if num_layers is None:
        return
    expected = num_layers + (mtp_num_layers or 0)
    sizes = sorted({size for _, size in routers if size is not None and size != expected})
    if sizes:
        raise ValueError(
            f"MoEMetricsMonitor(num_layers={num_layers}, mtp_num_layers={mtp_num_layers}) "
            f"expects per-layer vectors of {expected} entries, but the model's TopKRouters "
            f"record {sizes[0]} (router.set_layer_number(..., num_layers=)); make them agree"
        )


def _check_routers_in_moe_layers(
    routers: list[tuple[int | None, int | None]],
    moe_layer_freq: int | list[int],
    num_layers: int | None,
    mtp_num_layers: int | None,
) -> None:
    """Raise ``ValueError`` at run start when a recording router's layer is a dense layer of
    the given ``moe_layer_freq``. The tracker's mean over the MoE layers sums every layer slot
    and divides by the MoE layers (Megatron's ``v.sum() / num_moe_layers``), so such a router's
    values were added into the mean without being counted in its divisor (a load-balancing loss
    of 2.01 at balance), and the per-layer keys went to the pattern's layers, written as 0.0
    where no router records. The usual cause: an int ``f`` selects the layers ``i % f == 0``
    (Megatron's convention, layers 0, 2, ...), while Qwen-MoE's ``decoder_sparse_step`` makes
    the layers ``(i + 1) % f == 0`` MoE (layers 1, 3, ...). Pattern layers without a router
    are not an error: they have no record and are left out (as a layer skipped by layer-drop).
    Only routers that record and agree on their vector length are checked; a pattern whose
    length does not fit is left to the tracker, which names the sizes."""
    pattern = _pattern_from_routers(routers, num_layers, mtp_num_layers)
    if pattern is None:
        return
    layers = len(pattern)
    if isinstance(moe_layer_freq, list) and len(moe_layer_freq) != layers:
        return
    is_moe = _moe_layer_mask(layers, moe_layer_freq, 0)
    recorded = [i for i, routed in enumerate(pattern) if routed]
    dense = [i for i in recorded if not is_moe[i]]
    if dense:
        raise ValueError(
            f"MoEMetricsMonitor(moe_layer_freq={moe_layer_freq!r}) makes layers {dense} "
            "(0-based, the modules layers.{i}) dense, but the model's TopKRouters record into "
            f"them: their values would be added into the mean over the MoE layers without "
            f"being counted in it. An int f selects the layers i % f == 0 (Megatron's "
            f"convention). The routers record layers {recorded}: pass "
            f"moe_layer_freq={pattern} or leave it out (the default finds it from the routers)"
        )


def _pattern_from_routers(
    routers: list[tuple[int | None, int | None]],
    num_layers: int | None,
    mtp_num_layers: int | None,
) -> list[int] | None:
    """The 0/1 MoE-layer pattern of the model's transformer layers, from its routers'
    ``(layer_number, num_layers)`` (``None`` when they do not say).

    A router's ``num_layers`` is the tracker's vector length, the ``mtp_num_layers``
    Multi-Token-Prediction slots included; the pattern covers the transformer layers before
    them (the tracker counts the MTP slots as MoE layers by itself, as Megatron). A pattern
    that does not fit the monitor's ``num_layers`` is not guessed: ``None`` (every layer), and
    the tracker names the inconsistent sizes.

    Only the routers that record count: a router without its ``layer_number`` or
    ``num_layers`` records nothing into the tracker (a side router, a router of another
    model part). Counting it made every layer slot a MoE layer, so the mean over the MoE
    layers was divided by the dense layers too (0.67 instead of 1.0 with ``[1, 0, 1]``)."""
    routers = [(n, size) for n, size in routers if n is not None and size is not None]
    sizes = {size for _, size in routers}
    if not routers or len(sizes) != 1:
        return None
    (size,) = sizes
    layers = size - (mtp_num_layers or 0)  # type: ignore[operator]
    if layers <= 0 or (num_layers is not None and num_layers != layers):
        return None
    pattern = [0] * layers
    for number, _ in routers:
        if number <= layers:  # type: ignore[operator]
            pattern[number - 1] = 1  # type: ignore[operator]
    return pattern
