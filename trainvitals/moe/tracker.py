"""Per-layer MoE metrics: recorded in the router's forward, reduced and reported once per step.

:class:`MoEMetricsTracker` has the API and the semantics of Megatron-LM's tracker
(``megatron/core/transformer/moe/moe_logging.py``, read 2026-11, see
``/work/shared/reference/nvidia-references.md``), with the reference's failure modes fixed:

* **No hang on pipeline ranks without MoE layers, no flag.** Before reducing, the ranks exchange
  (one ``all_gather_object`` over the world per report) the names, sizes and groups of their
  metrics and reduce over the union: a rank that recorded nothing contributes zeros. Megatron
  needs ``report(force_initialize=True)`` there and hangs without it (Megatron-LM #1444, #3400).
* **A mismatched configuration is an error on every rank, not a hang.** The same metric with
  different sizes (``num_layers``), different ``needs_dp_avg``, or a reduce/avg group whose
  members disagree raises the same ``ValueError`` on every rank, before any tensor collective.
* **One collective per group and reduction kind**, whatever the number of metrics and layers:
  the pipeline SUM, each distinct ``reduce_group`` SUM, each distinct ``avg_group`` AVG and the
  data (x context) parallel AVG are each one coalesced collective (Megatron issues one per
  metric per stage).
* **One host transfer per report**: after the reductions, the per-layer vectors of every
  metric are concatenated (float64) and read back with one ``.tolist()``; the scaling, the
  means over the MoE layers (``math.fsum``, correctly rounded), the percentiles and the
  per-layer values are then computed on the host in float64 (no kernel per metric, no boolean
  indexing on the device). Masks and key strings are cached per layout.
* **``total_loss_dict`` does not grow**: each loss key receives this report's value, replacing
  the previous one (Megatron-Bridge #2989: the dict accumulated without bound). A report is
  already an average over the micro-batches (under :class:`MoEMetricsMonitor`, over the router
  forwards of the optimizer steps) it covers, so summing reports is never needed to get a mean.
* **A mean over the records, not over the micro-batches** (``mean_over_records=True``, what
  :class:`MoEMetricsMonitor` uses): each layer's sum is divided by the number of values
  recorded into it (counted on the device), so a loop that runs the model twice per
  micro-batch (R-Drop, adversarial or teacher-student training) logs the mean of its router
  forwards, not twice it. Megatron's ``loss_scale = 1/num_microbatches`` assumes one forward
  per micro-batch; ``loss_scale`` alone still behaves as Megatron's. The data-parallel
  average is over the ranks that recorded the layer (a per-layer flag rides in the same
  all-reduce): a rank without a record for it, e.g. no token in its forwards, is left out
  instead of averaged in as 0. With ``skip_unrecorded=True`` as well (the monitor's), a metric
  no rank recorded in any layer since the last report writes no key at all, rather than 0.0;
  with ``skip_unrecorded_layers=True`` (the monitor's too), a MoE layer no rank recorded gets
  no per-layer key and is left out of the mean over the layers, rather than counted as 0.

Keys written (``name`` is the recorded metric name, e.g. ``load_balancing_loss``):

==================================  ===========================================================
key                                 meaning
==================================  ===========================================================
``moe/{name}``                      mean over the MoE layers of the per-layer value (the
                                    layer's sum of records, or with ``mean_over_records`` their
                                    mean), times ``loss_scale`` (Megatron writes the bare
                                    ``{name}``; the ``moe/`` prefix follows the project's
                                    ``area/metric`` keys)
``moe/{name}_p{100q}``              quantile ``q`` over the layers with a positive value (``_p50``
                                    for 0.5, ``_p99.9`` for 0.999; :func:`percentile_key`)
``moe/{name}_layer_{i}``            the value of layer slot ``i`` (0-based, so the module
                                    ``layers.{i}`` of the model), with ``per_layer_logging``;
                                    only MoE layers when ``moe_layer_freq`` is given, and with
                                    ``skip_unrecorded_layers`` only layers with a record
==================================  ===========================================================

Units are those of the recorded metric (the router's load-balancing losses are dimensionless,
1.0 at perfect balance; ``z_loss`` is in logit^2). A NaN value (e.g. a diverged router) is
written as NaN; only a percentile with no positive layer is left out (Megatron's ``v[v > 0]``:
a layer whose value is 0, or negative, or NaN, is not one of the quantile's layers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from trainvitals.adapters.sinks.base import takes_main_tag
from trainvitals.distributed import (
    ProcessGroups,
    all_gather_objects,
    all_reduce_coalesced,
    group_size,
    is_distributed,
    world_group,
)
from trainvitals.moe._math import quantiles_of_positive_host

__all__ = [
    "MetricEntry",
    "MoEMetricsTracker",
    "destroy_moe_metrics_tracker",
    "get_moe_metrics_tracker",
    "set_moe_metrics_tracker",
]


@dataclass
class MetricEntry:
    """One metric: a per-layer vector and how to reduce it across ranks.

    ``counts`` holds, per layer, how many values were added into ``values`` since the last
    report (on the same device, zeros when not given): the divisor of
    ``report(mean_over_records=True)``. ``one`` is a ``[1]`` tensor of ones on that device, the
    increment of a count (made once, not in every record).
    """

    values: torch.Tensor
    reduce_group: Any = None
    avg_group: Any = None
    needs_dp_avg: bool = True
    counts: torch.Tensor | None = None
    one: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros_like(self.values)
        if self.one is None or self.one.device != self.counts.device:
            self.one = torch.ones(1, dtype=self.counts.dtype, device=self.counts.device)

    def _set_groups(self, reduce_group: Any, avg_group: Any, needs_dp_avg: bool) -> None:
        """The reduction settings of the last record (the last call wins, as Megatron)."""
        self.reduce_group = reduce_group
        self.avg_group = avg_group
        self.needs_dp_avg = bool(needs_dp_avg)


@dataclass
class _Plan:
    """How one metric of a report is aggregated: its MoE layer slots and per-layer keys."""

    name: str
    size: int
    num_moe_layers: int
    moe_slots: list[int]
    layer_keys: list[str]


def _digest(ranks: tuple[int, ...]) -> str:
    return hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()


def _group_id(group: Any) -> tuple[int, str] | None:
    """``(size, digest of the member ranks)``: a compact, rank-independent name of a group."""
    ranks = _group_ranks(group)
    return None if ranks is None else (len(ranks), _digest(ranks))


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of ``group`` (``None`` for a trivial group: nothing to reduce over)."""
    if group is None or group_size(group) <= 1:
        return None
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MoEMetricsTracker:
    """Tracker for per-layer MoE metrics (router losses, dropped-token fractions, ...).

    Lifecycle: :meth:`record` per layer in the forward pass -> :meth:`report` at the end of the
    step (agree, reduce, aggregate, write, clear) -> repeat. :meth:`report` is collective over
    the world when ``torch.distributed`` is initialised: every rank must call it, including
    pipeline ranks without MoE layers (they need no flag).

    Example:
        >>> import torch
        >>> tracker = MoEMetricsTracker()
        >>> for layer in (1, 2):
        ...     tracker.record("load_balancing_loss", torch.tensor(1.5), layer, num_layers=2)
        >>> tracker.report(loss_scale=1.0, iteration=0, total_loss_dict=(d := {}))
        ''
        >>> d
        {'load_balancing_loss': 1.5}
    """

    def __init__(self) -> None:
        self._metrics: dict[str, MetricEntry] = {}
        # Caches of the report's layout-dependent work (masks, key strings): they only change
        # when the metrics, the layer layout or the percentiles change.
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._pct_keys: dict[tuple[str, tuple[float, ...]], list[str]] = {}
        self._keys: dict[str, str] = {}
        # The metrics the last report left out for want of any record (``skip_unrecorded``).
        self._last_unrecorded: list[str] = []

    # ------------------------------------------------------------------ recording

    @property
    def metrics(self) -> Mapping[str, MetricEntry]:
        """Read-only view of the metric entries, by name."""
        return MappingProxyType(self._metrics)

    def record(
        self,
        name: str,
        value: torch.Tensor | float,
        layer_number: int | None,
        num_layers: int,
        reduce_group: Any = None,
        avg_group: Any = None,
        needs_dp_avg: bool = True,
    ) -> None:
        """Add ``value`` (detached) to slot ``layer_number - 1`` of metric ``name``.

        Args:
            name: metric name, e.g. ``"load_balancing_loss"``.
            value: a scalar tensor (stays on its device: no synchronisation) or a number.
            layer_number: 1-based layer number; ``None`` skips the record (as Megatron).
            num_layers: length of the per-layer vector (all layers, MTP layers included).
            reduce_group: process group to SUM over (e.g. ranks that split the tokens).
            avg_group: process group to AVG over (with ``report(mean_over_records=True)``:
                over the members that recorded the layer, see :meth:`_reduce`).
            needs_dp_avg: AVG over the data x context parallel group (``groups.dp_cp`` of
                :meth:`report`) after the other reductions.

        The group settings of the last call win (as Megatron).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if layer_number is None:
            return
        if not _is_int(num_layers) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not _is_int(layer_number) or not 1 <= layer_number <= num_layers:
            raise ValueError(
                f"layer_number must be an int in [1, num_layers={num_layers}], got {layer_number!r}"
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"value must be a scalar tensor, got shape {tuple(value.shape)}")
            value = value.detach().reshape(())
        elif isinstance(value, int | float) and not isinstance(value, bool):
            value = torch.tensor(float(value))
        else:
            raise TypeError(f"value must be a tensor or a number, got {type(value).__name__}")
        entry = self._entry(name, num_layers, value.device)
        entry.values[layer_number - 1] += value.to(entry.values.dtype)
        # Counted on the device with the value (no host counter): whatever replays the value's
        # addition (a CUDA graph, a compiled region) replays the count with it.
        entry.counts[layer_number - 1] += 1
        entry._set_groups(reduce_group, avg_group, needs_dp_avg)

    def _record_at(
        self,
        name: str,
        value: torch.Tensor,
        slot: torch.Tensor,
        num_layers: int,
        reduce_group: Any = None,
        needs_dp_avg: bool = True,
    ) -> None:
        """:meth:`record` of a scalar tensor into the layer ``slot`` holds (a checked 0-based
        index, an int64 tensor ``[1]`` on the value's device), for :class:`TopKRouter`.

        ``torch.compile`` specialises an int attribute of a module and guards on its value: a
        router forward reading its int layer number compiled once per layer and, past
        Dynamo's recompile limit (8), ran the remaining layers uncompiled. A tensor index
        is a graph input instead: one compiled forward serves every layer."""
        entry = self._entry(name, num_layers, value.device)
        value = value.detach().reshape(1).to(entry.values.dtype)
        entry.values.index_add_(0, slot, value)
        entry.counts.index_add_(0, slot, entry.one)  # (a cached one: no fill kernel per record)
        entry._set_groups(reduce_group, None, needs_dp_avg)

    def _entry(self, name: str, num_layers: int, device: torch.device) -> MetricEntry:
        """Metric ``name``'s entry on ``device`` (created with ``num_layers`` zeros)."""
        entry = self._metrics.get(name)
        if entry is None:
            entry = MetricEntry(torch.zeros(num_layers, dtype=torch.float32, device=device))
            self._metrics[name] = entry
        elif entry.values.numel() != num_layers:
            raise ValueError(
                f"metric {name!r} was recorded with num_layers={entry.values.numel()}, "
                f"now with num_layers={num_layers}"
            )
        if entry.values.device != device:
            entry.values = entry.values.to(device)
            entry.counts = entry.counts.to(device)
            entry.one = entry.one.to(device)
        return entry

    def ensure_initialized(
        self, name: str, num_layers: int, device: str | torch.device | int | None = None
    ) -> None:
        """Create metric ``name`` with ``num_layers`` zeros if it does not exist yet.

        Not needed for pipeline ranks without MoE layers (:meth:`report` agrees on the names
        across ranks); kept for API compatibility and to pre-allocate on a chosen device
        (default: the device of an existing metric, else the current CUDA device, else CPU).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not _is_int(num_layers) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        entry = self._metrics.get(name)
        if entry is not None:
            if entry.values.numel() != num_layers:
                raise ValueError(
                    f"metric {name!r} exists with num_layers={entry.values.numel()}, "
                    f"not {num_layers}"
                )
            return
        if device is None:
            device = self._default_device()
        elif _is_int(device):
            device = torch.device("cuda", device)
        self._metrics[name] = MetricEntry(torch.zeros(num_layers, device=device))

    def _default_device(self) -> torch.device:
        for entry in self._metrics.values():
            return entry.values.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def clear(self) -> None:
        """Zero every metric's values and record counts (the entries are kept for reuse)."""
        for entry in self._metrics.values():
            entry.values.zero_()
            entry.counts.zero_()

    # ------------------------------------------------------------------ snapshots (private)

    def _snapshot(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Device copies of the values and record counts (no synchronisation)."""
        return {name: (e.values.clone(), e.counts.clone()) for name, e in self._metrics.items()}

    def _restore(self, snapshot: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put the values and counts of :meth:`_snapshot` back; metrics created since are
        zeroed."""
        for name, entry in self._metrics.items():
            if name in snapshot:
                values, counts = snapshot[name]
                entry.values = values.to(entry.values.device).clone()
                entry.counts = counts.to(entry.values.device).clone()
            else:
                entry.values.zero_()
                entry.counts.zero_()

    # ------------------------------------------------------------------ reporting

    def report(
        self,
        loss_scale: float,
        iteration: int,
        writer: Any = None,
        per_layer_logging: bool = False,
        track_names: str | Sequence[str] | None = None,
        num_layers: int | None = None,
        moe_layer_freq: int | Sequence[int] | None = None,
        mtp_num_layers: int | None = None,
        total_loss_dict: dict[str, Any] | None = None,
        percentiles: Mapping[str, Sequence[float]] | None = None,
        groups: ProcessGroups | None = None,
        *,
        mean_over_records: bool = False,
        skip_unrecorded: bool = False,
        skip_unrecorded_layers: bool = False,
    ) -> str:
        """Reduce across ranks, aggregate, write, and clear. Returns the console string.

        Args:
            loss_scale: multiplies every value, usually ``1 / micro-batches`` covered (``1.0``
                with ``mean_over_records``).
            iteration: the step the values are written at.
            writer: an object with ``add_scalars(mapping, step)`` (trainvitals'
                ``FanoutWriter``) or ``add_scalar(tag, value, step)`` (a TensorBoard
                ``SummaryWriter``); ``None`` writes nothing.
            per_layer_logging: also write ``moe/{name}_layer_{i}``.
            track_names: the metric name(s) to report; ``None`` reports every metric any rank
                recorded. Every rank must pass the same.
            num_layers: transformer layers (without MTP); default: the metric's length minus
                ``mtp_num_layers``.
            moe_layer_freq: which layers are MoE: an int ``f`` (layers ``i % f == 0``) or a 0/1
                list of length ``num_layers``; default: every layer. A layer it calls dense
                that holds a record is a ``ValueError`` naming the layers (its value would be
                summed into the mean over the MoE layers and its per-layer key left out),
                raised after the collectives from the reduced values (on every rank alike
                when ``groups`` reduces them over the ranks; with trivial groups each rank
                checks its own); the values are kept, as for any refused argument, so a
                corrected call reports them.
            mtp_num_layers: Multi-Token-Prediction layers, counted as MoE layers after the
                ``num_layers`` transformer layers.
            total_loss_dict: keys ending in ``loss`` get this report's value (a float),
                replacing any previous value; they are left out of the console string.
            percentiles: per metric, quantiles in ``[0, 1]`` over the positive layers, e.g.
                ``{"load_balancing_loss": [0.5, 0.95]}`` -> ``load_balancing_loss_p50``, ``_p95``.
            groups: the run's :class:`~trainvitals.distributed.ProcessGroups`; ``pp`` is
                summed over, ``dp_cp`` (data x context parallel: every rank that sees other
                tokens) averaged over (for ``needs_dp_avg`` metrics). ``None``: no pipeline or
                data-parallel reduction.
            mean_over_records: divide each layer's sum by the number of values recorded into
                it since the last report, on each rank before the reductions: a layer's value
                is then the mean over its records (one per router forward, however many
                forwards a micro-batch runs), then averaged over the data-parallel ranks
                that recorded it (a rank whose router recorded nothing for the layer, e.g.
                no token in any of its forwards, counts for nothing, not as a 0). A layer no
                rank recorded stays 0. Every rank must pass the same.
            skip_unrecorded: with ``mean_over_records``, a metric that nothing recorded since
                the last report, in any layer slot on any rank of its reductions (pipeline,
                ``reduce_group``, ``avg_group``, data x context parallel), writes nothing: no
                ``moe/{name}``, percentile or per-layer key, no ``total_loss_dict`` entry
                (a previous one is removed) and nothing in the console string. Its 0.0 would
                be no value of the metric (a load-balancing loss is 1.0 at perfect balance).
                The has-records flags that ``mean_over_records`` carries through the
                reductions decide it: no collective is added, only the flags join the one host
                transfer. A metric with a record anywhere is written as without it (its
                layers without records stay 0, unless ``skip_unrecorded_layers``).
            skip_unrecorded_layers: with ``mean_over_records``, a MoE layer slot that nothing
                recorded since the last report (on any rank of the metric's reductions, by
                the same reduced has-records flags) has no value: no ``moe/{name}_layer_{i}``
                key, and the mean over the MoE layers is over the layers with a record (a
                router that got no token in the interval, a layer skipped by layer-drop or
                by a modality's routing). Without it such a layer is 0 in the per-layer key
                and in the mean (Megatron's: every layer routes in its loop), e.g. 0.75 for
                four layers at 1.0, one without a record. Percentiles already leave it out
                (it is not positive). When no MoE slot has a record, the mean is Megatron's.

        The values and record counts of every metric (tracked or not) are zeroed afterwards;
        a report that raises keeps them.
        """
        # 1. Arguments: checked before any collective, so no rank is left waiting.
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
            raise TypeError(f"loss_scale must be a number, got {loss_scale!r}")
        if not math.isfinite(loss_scale):
            raise ValueError(f"loss_scale must be finite, got {loss_scale!r}")
        if not _is_int(iteration):
            raise TypeError(f"iteration must be an int, got {iteration!r}")
        names_filter = _resolve_names(track_names)
        if num_layers is not None and (not _is_int(num_layers) or num_layers <= 0):
            raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
        if mtp_num_layers is not None and (not _is_int(mtp_num_layers) or mtp_num_layers < 0):
            raise ValueError(f"mtp_num_layers must be an int >= 0 or None, got {mtp_num_layers!r}")
        pattern_arg = _check_layer_freq(moe_layer_freq, num_layers)
        pct = _check_percentiles(percentiles)
        if groups is None:
            groups = ProcessGroups()
        elif not isinstance(groups, ProcessGroups):
            raise TypeError(f"groups must be a ProcessGroups or None, got {type(groups).__name__}")
        if total_loss_dict is not None and not isinstance(total_loss_dict, dict):
            raise TypeError(f"total_loss_dict must be a dict or None, got {total_loss_dict!r}")
        if not isinstance(mean_over_records, bool):
            raise TypeError(f"mean_over_records must be a bool, got {mean_over_records!r}")
        if not isinstance(skip_unrecorded, bool):
            raise TypeError(f"skip_unrecorded must be a bool, got {skip_unrecorded!r}")
        if not isinstance(skip_unrecorded_layers, bool):
            raise TypeError(
                f"skip_unrecorded_layers must be a bool, got {skip_unrecorded_layers!r}"
            )
        if (skip_unrecorded or skip_unrecorded_layers) and not mean_over_records:
            # (the has-records flags travel through the reductions with mean_over_records only)
            which = "skip_unrecorded" if skip_unrecorded else "skip_unrecorded_layers"
            raise ValueError(f"{which}=True needs mean_over_records=True")

        # 2. Agree on the metrics across ranks (one all_gather_object), then reduce.
        names = [n for n in self._metrics if names_filter is None or n in names_filter]
        schema = self._agree(names, names_filter, groups, mean_over_records)
        reduced, divisors, flags = self._reduce(schema, groups, mean_over_records)

        # 3. One host transfer for everything (the reduced per-layer vectors, float64, and in a
        #    single process the record counts to divide by), then divide, scale, average over
        #    the MoE layers, percentiles and per-layer values on the host in float64: a handful
        #    of Python operations instead of several kernels per metric.
        plans = [
            self._plan(name, size, num_layers, mtp_num_layers, pattern_arg, moe_layer_freq)
            for name, (size, _) in schema.items()
        ]
        vectors = [reduced[name] for name in schema]
        # After the values, per layer slot: the record counts (single process: the divisors)
        # or, with skip_unrecorded(_layers), the reduced has-records flags (> 0: some rank
        # recorded).
        skipping = skip_unrecorded or skip_unrecorded_layers
        marks = divisors if divisors is not None else flags if skipping else None
        if marks is not None:
            vectors += [marks[name] for name in schema]
        host = torch.cat(vectors).tolist() if schema else []
        if moe_layer_freq is not None:
            # (refused, the values stay, as for any refused argument: a corrected call
            # reports this interval)
            _check_dense_slots(_plan_slices(plans, host, marks is not None))
        scale = float(loss_scale)
        keys: list[str] = []
        numbers: list[float] = []
        unrecorded: list[str] = []
        for plan, v, counts in _plan_slices(plans, host, marks is not None):
            if counts is not None:
                if skip_unrecorded and not any(c > 0 for c in counts):
                    unrecorded.append(plan.name)  # no record anywhere: no value to write
                    continue
                if divisors is not None:
                    v = [x / c if c > 0 else x for x, c in zip(v, counts, strict=True)]
            v = [x * scale for x in v]
            slots, layer_keys, num_moe_layers = plan.moe_slots, plan.layer_keys, plan.num_moe_layers
            if skip_unrecorded_layers and counts is not None:
                recorded = [j for j, i in enumerate(slots) if counts[i] > 0]
                if recorded and len(recorded) < len(slots):
                    # the MoE layers without any record have no value: out of the mean's
                    # divisor (their 0 in the sum adds nothing) and without a per-layer key
                    num_moe_layers -= len(slots) - len(recorded)
                    slots = [slots[j] for j in recorded]
                    layer_keys = [layer_keys[j] for j in recorded]
            keys.append(plan.name)
            numbers.append(_fsum(v) / num_moe_layers)
            qs = pct.get(plan.name)
            if qs:
                # NaN = no positive layer: that percentile is not written. Only here: a NaN
                # mean or layer value (a diverged router) must reach the writer, not vanish.
                for key, x in zip(
                    self._percentile_keys(plan.name, qs),
                    quantiles_of_positive_host(v, qs),
                    strict=True,
                ):
                    if not math.isnan(x):
                        keys.append(key)
                        numbers.append(x)
            if per_layer_logging:
                keys.extend(layer_keys)
                numbers.extend(v[i] for i in slots)
        scalars = dict(zip(keys, numbers, strict=True))
        loss_names = [plan.name for plan in plans if plan.name.endswith("loss")]

        # 4. Write, hand losses to total_loss_dict, build the console string, clear.
        if writer is not None and scalars:
            prefixed = self._prefixed
            _write(writer, {prefixed(k): x for k, x in scalars.items()}, iteration)
        if total_loss_dict is not None:
            for name in loss_names:
                if name in scalars:
                    total_loss_dict[name] = scalars[name]
                elif name in unrecorded:  # (no value in this report: not the previous one)
                    total_loss_dict.pop(name, None)
        self._last_unrecorded = unrecorded
        self.clear()
        return "".join(
            f" {k}: {x:.2f} |"
            for k, x in scalars.items()
            if not k.endswith("loss") and "_layer_" not in k
        )

    # ------------------------------------------------------------------ report helpers (cached)

    def _plan(
        self,
        name: str,
        size: int,
        num_layers: int | None,
        mtp_num_layers: int | None,
        pattern: int | list[int] | None,
        moe_layer_freq: Any,
    ) -> _Plan:
        """How metric ``name`` is aggregated (MoE slots, per-layer keys), cached per layout."""
        mtp = mtp_num_layers or 0
        cache_key = (
            name,
            size,
            num_layers,
            mtp,
            tuple(pattern) if isinstance(pattern, list) else pattern,
        )
        plan = self._plans.get(cache_key)
        if plan is not None:
            return plan
        layers = num_layers if num_layers is not None else size - mtp
        if layers <= 0 or layers + mtp != size:
            raise ValueError(
                f"metric {name!r} has {size} layer slots but num_layers={num_layers} and "
                f"mtp_num_layers={mtp_num_layers} describe {max(layers, 0) + mtp}"
            )
        is_moe = _moe_layer_mask(layers, pattern, mtp)
        num_moe_layers = sum(is_moe)
        if num_moe_layers <= 0:
            raise ValueError(
                f"no MoE layers for num_layers={layers}, moe_layer_freq={moe_layer_freq}"
            )
        slots = [i for i, m in enumerate(is_moe) if m]
        plan = _Plan(name, size, num_moe_layers, slots, [f"{name}_layer_{i}" for i in slots])
        if len(self._plans) > 1024:  # layouts change rarely; never grow without bound
            self._plans.clear()
        self._plans[cache_key] = plan
        return plan

    def _percentile_keys(self, name: str, qs: list[float]) -> list[str]:
        cache_key = (name, tuple(qs))
        out = self._pct_keys.get(cache_key)
        if out is None:
            if len(self._pct_keys) > 1024:
                self._pct_keys.clear()
            out = self._pct_keys[cache_key] = [percentile_key(name, q) for q in qs]
        return out

    def _prefixed(self, key: str) -> str:
        out = self._keys.get(key)
        if out is None:
            if len(self._keys) > 65536:
                self._keys.clear()
            out = self._keys[key] = f"moe/{key}"
        return out

    # ------------------------------------------------------------------ agreement & reduction

    def _agree(
        self,
        names: list[str],
        names_filter: list[str] | None,
        groups: ProcessGroups,
        mean_over_records: bool = False,
    ) -> dict[str, tuple[int, bool]]:
        """The metrics every rank reduces: ``{name: (size, needs_dp_avg)}``, sorted by name.

        Single process: the local metrics. Distributed: one ``all_gather_object`` over the world
        of each rank's description, and checks that raise the same ``ValueError`` on every rank
        when ranks disagree (so no rank waits on a collective the others never issue).
        """
        if not is_distributed() or group_size(world_group()) <= 1:
            # Single process: nothing to agree on, no group to describe.
            return {
                n: (self._metrics[n].values.numel(), self._metrics[n].needs_dp_avg)
                for n in sorted(names)
            }
        local = {
            name: (
                self._metrics[name].values.numel(),
                self._metrics[name].needs_dp_avg,
                _group_id(self._metrics[name].reduce_group),
                _group_id(self._metrics[name].avg_group),
            )
            for name in names
        }
        mine = {
            "metrics": local,
            "pp": _group_id(groups.pp),
            "dp": _group_id(groups.dp_cp),
            "track_names": names_filter,
            "mean_over_records": mean_over_records,
        }
        gathered = all_gather_objects(mine, world_group())
        _check_agreement(gathered)
        schema: dict[str, tuple[int, bool]] = {}
        for info in gathered:
            for name, (size, needs_dp_avg, _, _) in info["metrics"].items():
                schema.setdefault(name, (size, needs_dp_avg))
        return dict(sorted(schema.items()))

    def _reduce(
        self,
        schema: Mapping[str, tuple[int, bool]],
        groups: ProcessGroups,
        mean_over_records: bool = False,
    ) -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None
    ]:
        """PP SUM -> reduce_group SUM -> avg_group AVG -> DP(xCP) AVG, one collective per group
        and stage; returns float64 vectors (new tensors, the entries are not modified), ``None``
        and, with ``mean_over_records``, the reduced per-layer has-records flags (float64, > 0
        where any rank of the metric's reductions recorded the layer; else ``None``). In a
        single process it returns the entries' vectors themselves (their own dtype, exactly
        converted to float64 on the host): do not modify them; and with ``mean_over_records``
        their record counts, for the caller to divide by on the host, and ``None``.

        ``mean_over_records`` divides each rank's sums by its own counts before the first
        collective, so no count travels: a layer's count is on the pipeline stage that holds
        it (the others add zeros), the ranks of a ``reduce_group`` each hold a share of the
        same forwards (summing their counts would multiply the divisor by the group size), and
        the data-parallel step averages the ranks' means as it averages their sums, over the
        ranks that recorded the layer: a per-layer has-records flag (0/1) rides with the values
        in the same collectives (the vector is ``[values, flags]``), is OR-ed by the pipeline
        SUM and the ``reduce_group`` SUM (a flag > 0 is a record), and the ``avg_group`` step
        and the data-parallel step are each a SUM of values and 0/1 flags, the values then
        divided by the number of ranks that recorded (at least 1). Without it, a rank whose
        router recorded nothing for a layer (no token in any of its forwards) entered the AVG
        as 0 and halved the layer's value on 2 ranks. When every rank recorded, the same number
        as the AVG (the sum divided by the group size, in float64); a layer no rank recorded
        stays 0.

        Megatron-LM's ``avg_group`` step is an all-reduce AVG, a division by the group size
        (moe_logging.py; /work/shared/reference/nvidia-references.md, "sync order per name").
        There every member of the group records every forward (the tensor/context-parallel
        ranks of one router), so the two divisions agree; where a member recorded nothing its 0
        is not a value of the metric, so ``mean_over_records`` leaves it out, as it does for the
        data-parallel average. Without ``mean_over_records`` the AVG stays Megatron's."""
        device = self._default_device()
        values: dict[str, torch.Tensor] = {}
        if not is_distributed() or group_size(world_group()) <= 1:
            # Single process: every group is trivial, nothing to reduce. The entries' own
            # vectors (the caller concatenates them into a new tensor before it clears them).
            sums = {name: self._metrics[name].values.to(device) for name in schema}
            if not mean_over_records:
                return sums, None, None
            return sums, {name: self._metrics[name].counts.to(device) for name in schema}, None
        dp_ranks = _group_ranks(groups.dp_cp)
        # The metrics whose avg_group and data-parallel steps divide by the ranks that
        # recorded: their vectors carry [values, has-records flags] through every collective.
        # Every metric under mean_over_records (the vector lengths depend on the gathered
        # schema only, so all ranks agree on them whatever groups their own entries have).
        flagged = set(schema) if mean_over_records else set()
        for name, (size, _) in schema.items():
            entry = self._metrics.get(name)
            length = 2 * size if name in flagged else size
            if entry is None:  # (nothing recorded here: zeros, flags 0)
                values[name] = torch.zeros(length, dtype=torch.float64, device=device)
                continue
            v = entry.values.to(device=device, dtype=torch.float64, copy=True)
            if mean_over_records:  # (a layer without records: 0 / 1)
                counts = entry.counts.to(device)
                v.div_(counts.clamp(min=1))
                if name in flagged:
                    v = torch.cat([v, (counts > 0).to(torch.float64)])
            values[name] = v
        names = list(values)
        recorded: dict[str, torch.Tensor] = {}  # the reduced flags, per flagged metric

        def reduce(subset: list[str], op: str, group: Any) -> None:
            if subset and group is not None:
                out = all_reduce_coalesced([values[n] for n in subset], op, group)  # type: ignore[arg-type]
                for n, t in zip(subset, out, strict=True):
                    values[n] = t.to(device)

        reduce(names, "sum", groups.pp if _group_ranks(groups.pp) else None)
        for attr, op in (("reduce_group", "sum"), ("avg_group", "avg")):
            by_ranks: dict[tuple[int, ...], tuple[Any, list[str]]] = {}
            for name in names:
                entry = self._metrics.get(name)
                group = getattr(entry, attr) if entry is not None else None
                ranks = _group_ranks(group)
                if ranks is not None:
                    by_ranks.setdefault(ranks, (group, []))[1].append(name)
            # A fixed order (by member ranks) that every rank shares, so collectives on
            # overlapping groups are issued in the same sequence everywhere.
            for ranks in sorted(by_ranks):
                group, subset = by_ranks[ranks]
                if op == "avg" and flagged:
                    # the mean over the members that recorded the layer: SUM of the values and
                    # of the 0/1 flags, in the same one collective, then divide
                    for n in subset:
                        flags = values[n][schema[n][0] :]
                        flags.copy_(flags > 0)
                    reduce(subset, "sum", group)
                    for n in subset:
                        size = schema[n][0]
                        v = values[n]
                        values[n] = torch.cat([v[:size] / v[size:].clamp(min=1), v[size:]])
                else:
                    reduce(subset, op, group)
        # Over dp x cp, not dp alone: a context-parallel rank routes other tokens of the same
        # sequences, so a metric computed on its own tokens differs across cp and its mean is
        # over cp too (averaging over dp only left each cp rank with its own shard's value,
        # and rank 0 wrote that). A metric already summed over cp by its reduce_group is equal
        # on every cp rank by then, so this average leaves it unchanged.
        if dp_ranks:
            dp_names = [n for n in names if schema[n][1]]
            if not flagged:
                reduce(dp_names, "avg", groups.dp_cp)
                return values, None, None
            for n in dp_names:  # the flags OR-ed so far (sums, counts) as 0/1 per rank
                flags = values[n][schema[n][0] :]
                flags.copy_(flags > 0)
            reduce(dp_names, "sum", groups.dp_cp)  # the same one collective, SUM not AVG
            for n in dp_names:
                size = schema[n][0]
                # over the ranks that recorded the layer; a layer none recorded: 0 / 1
                recorded[n] = values[n][size:]
                values[n] = values[n][:size] / recorded[n].clamp(min=1)
        for n in flagged:  # (the flags of the metrics without a data-parallel step)
            if n not in recorded:
                recorded[n] = values[n][schema[n][0] :]
                values[n] = values[n][: schema[n][0]]
        return values, None, (recorded if flagged else None)


def _fsum(values: list[float]) -> float:
    """``math.fsum`` (correctly rounded), or the plain sum where fsum raises: ``+inf`` and
    ``-inf`` layers (NaN, as the device's sum; fsum raised ValueError and the report died) or
    an intermediate overflow (``inf``)."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):
        return sum(values)


# ---------------------------------------------------------------------- argument helpers


def _resolve_names(track_names: str | Sequence[str] | None) -> list[str] | None:
    if track_names is None:
        return None
    if isinstance(track_names, str):
        return [track_names]
    if isinstance(track_names, Sequence) and all(isinstance(n, str) for n in track_names):
        return list(track_names)
    raise TypeError(f"track_names must be a str, a list of str or None, got {track_names!r}")


def _check_layer_freq(
    moe_layer_freq: int | Sequence[int] | None, num_layers: int | None
) -> int | list[int] | None:
    if moe_layer_freq is None:
        return None
    if _is_int(moe_layer_freq):
        if moe_layer_freq <= 0:
            raise ValueError(f"moe_layer_freq must be positive, got {moe_layer_freq}")
        return moe_layer_freq
    if isinstance(moe_layer_freq, Sequence) and all(
        _is_int(x) and x in (0, 1) for x in moe_layer_freq
    ):
        pattern = list(moe_layer_freq)
        if num_layers is not None and len(pattern) != num_layers:
            raise ValueError(
                f"moe_layer_freq list has {len(pattern)} entries, num_layers is {num_layers}"
            )
        return pattern
    raise TypeError(
        f"moe_layer_freq must be a positive int, a 0/1 list or None, got {moe_layer_freq!r}"
    )


def _moe_layer_mask(num_layers: int, freq: int | list[int] | None, mtp: int) -> list[bool]:
    """Which layer slots are MoE layers (Megatron's ``_count_moe_layers`` as a mask)."""
    if freq is None:
        mask = [True] * num_layers
    elif isinstance(freq, int):
        mask = [i % freq == 0 for i in range(num_layers)]
    else:
        if len(freq) != num_layers:
            raise ValueError(f"moe_layer_freq list has {len(freq)} entries, not {num_layers}")
        mask = [bool(x) for x in freq]
    return mask + [True] * mtp


def _plan_slices(
    plans: list[_Plan], host: list[float], with_counts: bool
) -> Iterator[tuple[_Plan, list[float], list[float] | None]]:
    """Per plan, its slice of the host vector's values and (``with_counts``) of the record
    counts or flags that follow all the values, in the plans' order."""
    offset, count_offset = 0, sum(plan.size for plan in plans)
    for plan in plans:
        counts = host[count_offset : count_offset + plan.size] if with_counts else None
        yield plan, host[offset : offset + plan.size], counts
        offset += plan.size
        count_offset += plan.size


def _check_dense_slots(slices: Iterable[tuple[_Plan, list[float], list[float] | None]]) -> None:
    """``moe_layer_freq`` against what was recorded: a layer it calls dense that holds a
    record would be summed into the mean over the MoE layers (Megatron's ``v.sum() /
    num_moe_layers``), while its per-layer key is not written: a wrong number. Read from the
    reduced vectors (and record counts or flags, when reduced along) already on the host, the
    same on every rank: every rank raises alike, after the report's collectives, none waits."""
    problems = []
    for plan, v, counts in slices:
        moe = set(plan.moe_slots)
        dense = [
            i
            for i in range(plan.size)
            if i not in moe and (v[i] != 0 or (counts is not None and counts[i] > 0))
        ]
        if dense:
            problems.append(f"{plan.name!r} at layers {dense}")
    if problems:
        raise ValueError(
            "moe_layer_freq calls layers dense that recorded values: "
            f"{'; '.join(problems)} (their values would be summed into the mean over the MoE "
            "layers, and their per-layer keys left out); pass the moe_layer_freq that matches "
            "the layers that record (None: every layer)"
        )


def percentile_key(name: str, q: float) -> str:
    """The key suffix of quantile ``q`` of metric ``name``: ``{name}_p{percent}``.

    A whole percent is written as an integer, as Megatron-LM does (``0.5`` -> ``_p50``,
    ``0.95`` -> ``_p95``); any other as its shortest decimal (``0.999`` -> ``_p99.9``).
    Megatron writes ``int(q * 100)``, which truncates the float product: ``0.29`` becomes
    ``_p28`` and ``0.999`` collides with ``0.99`` as ``_p99``."""
    percent = round(q * 100.0, 9)  # drop the product's rounding (0.29 * 100 = 28.999999999999996)
    if percent == int(percent):
        return f"{name}_p{int(percent)}"
    return f"{name}_p{percent!r}"


def _check_percentiles(percentiles: Mapping[str, Sequence[float]] | None) -> dict[str, list[float]]:
    if percentiles is None:
        return {}
    if not isinstance(percentiles, Mapping):
        raise TypeError(
            f"percentiles must be a mapping name -> list of quantiles, got {percentiles!r}"
        )
    out: dict[str, list[float]] = {}
    for name, qs in percentiles.items():
        if isinstance(qs, int | float):
            qs = [qs]
        if not isinstance(name, str) or not all(
            isinstance(q, int | float) and not isinstance(q, bool) and 0.0 <= q <= 1.0 for q in qs
        ):
            raise ValueError(f"percentiles[{name!r}] must be quantiles in [0, 1], got {qs!r}")
        unique = list(dict.fromkeys(float(q) for q in qs))  # a repeated quantile once
        keys = [percentile_key(name, q) for q in unique]
        if len(set(keys)) != len(keys):
            raise ValueError(
                f"percentiles[{name!r}] has quantiles that share a key ({keys}); they differ by "
                "less than 1e-11"
            )
        out[name] = unique
    return out


def _check_agreement(gathered: list[dict[str, Any]]) -> None:
    """Raise the same ValueError on every rank when the ranks' metrics cannot be reduced
    together. Deterministic: every rank runs it on the same gathered list.

    Groups travel as ``(size, digest of the member ranks)`` so that the gathered payload stays
    small with large data-parallel groups; a group is consistent when the ranks claiming it
    are exactly its members (their count and digest match). Linear in the world size.
    """
    problems: list[str] = []
    filters = {repr(info["track_names"]) for info in gathered}
    if len(filters) > 1:
        problems.append(f"ranks passed different track_names: {sorted(filters)}")
    if len({info.get("mean_over_records", False) for info in gathered}) > 1:
        problems.append("ranks passed different mean_over_records")
    for kind in ("pp", "dp"):
        claims: dict[tuple[int, str], list[int]] = {}
        for rank, info in enumerate(gathered):
            if info[kind] is not None:
                claims.setdefault(info[kind], []).append(rank)
        problems.extend(_claim_problems(claims, f"the {kind} group"))
    first: dict[str, tuple[int, int, bool]] = {}
    group_claims: dict[tuple[str, str], dict[tuple[int, str], list[int]]] = {}
    for rank, info in enumerate(gathered):
        for name, (size, needs_dp_avg, reduce_id, avg_id) in info["metrics"].items():
            seen = first.setdefault(name, (rank, size, needs_dp_avg))
            if seen[1] != size:
                problems.append(
                    f"metric {name!r} has {seen[1]} layer slots on rank {seen[0]} but {size} on "
                    f"rank {rank} (different num_layers)"
                )
            if seen[2] != needs_dp_avg:
                problems.append(
                    f"metric {name!r} has needs_dp_avg={seen[2]} on rank {seen[0]} but "
                    f"{needs_dp_avg} on rank {rank}"
                )
            for label, gid in (("reduce_group", reduce_id), ("avg_group", avg_id)):
                if gid is not None:
                    group_claims.setdefault((name, label), {}).setdefault(gid, []).append(rank)
    for (name, label), claims in sorted(group_claims.items()):
        problems.extend(_claim_problems(claims, f"metric {name!r}: the {label}"))
    if problems:
        raise ValueError("MoEMetricsTracker.report: ranks disagree: " + "; ".join(problems[:8]))


def _claim_problems(claims: Mapping[tuple[int, str], list[int]], what: str) -> list[str]:
    out = []
    for (size, digest), ranks in sorted(claims.items()):
        if len(ranks) != size or _digest(tuple(sorted(ranks))) != digest:
            shown = ranks if len(ranks) <= 16 else [*ranks[:16], "..."]
            out.append(
                f"{what} of {size} ranks is used by ranks {shown} only: its other members did "
                "not record the metric with that group or use another group"
            )
    return out


def _write(writer: Any, scalars: dict[str, float], step: int) -> None:
    add_scalars = getattr(writer, "add_scalars", None)
    # not TensorBoard's add_scalars(main_tag, dict, step): one call with every key
    if add_scalars is not None and not takes_main_tag(add_scalars):
        add_scalars(scalars, step)
        return
    for key, value in scalars.items():
        writer.add_scalar(key, value, step)


# ---------------------------------------------------------------------- the global tracker

_MOE_METRICS_TRACKER: MoEMetricsTracker | None = None


def get_moe_metrics_tracker() -> MoEMetricsTracker:
    """The global tracker, created on first use."""
    global _MOE_METRICS_TRACKER
    if _MOE_METRICS_TRACKER is None:
        _MOE_METRICS_TRACKER = MoEMetricsTracker()
    return _MOE_METRICS_TRACKER


def set_moe_metrics_tracker(tracker: MoEMetricsTracker) -> None:
    """Replace the global tracker."""
    if not isinstance(tracker, MoEMetricsTracker):
        raise TypeError(f"tracker must be a MoEMetricsTracker, got {type(tracker).__name__}")
    global _MOE_METRICS_TRACKER
    _MOE_METRICS_TRACKER = tracker


def destroy_moe_metrics_tracker() -> None:
    """Drop the global tracker (the next :func:`get_moe_metrics_tracker` makes a new one)."""
    global _MOE_METRICS_TRACKER
    _MOE_METRICS_TRACKER = None
