"""ThroughputMonitor: batches, samples, tokens and flops per second over a rolling window."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from trainvitals.adapters.context import BatchInfo, RunContext, infer_num_tokens
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.distributed import (
    CollectiveCall,
    PeerRankFailed,
    ProcessGroups,
    all_reduce_coalesced,
    group_key,
    group_rank,
    group_size,
    world_group,
)
from trainvitals.stats.flops import (
    PRECISIONS,
    FlopCounterSession,
    chip_name,
    device_name_of,
    peak_flops,
)
from trainvitals.stats.runtime import TrainClock, as_float_state
from trainvitals.stats.throughput import COUNT_FIELDS, RollingWindow, StepCounter, to_vector

__all__ = [
    "ContextParallelTokensCheck",
    "ThroughputMonitor",
    "count_reduction_calls",
    "reduce_counts",
]

# Which group each count of a StepRecord (COUNT_FIELDS[1:]) is summed over. Samples and batches:
# the data-parallel ranks (tensor-, context- and pipeline-parallel peers share their samples).
# Tokens: data- and context-parallel ranks (a context-parallel rank holds its own slice of the
# sequence; tensor-parallel peers hold the same tokens). Flops: every rank (each does its part).
_FIELD_GROUP = {
    "batches": "dp",
    "samples": "dp",
    "tokens": "dp_cp",
    "batches_missing": "dp",
    "samples_missing": "dp",
    "tokens_missing": "dp_cp",
    "flops": "world",
}


def _reduction_plan(groups: ProcessGroups) -> list[tuple[Any, list[int]]]:
    """``(group, columns)`` of each collective :func:`reduce_counts` issues, in issue order:
    the columns of :data:`COUNT_FIELDS` after ``seconds`` summed over one distinct group (groups
    of one member left out). The same on every rank (fields in a fixed order)."""
    group_of = {"dp": groups.dp, "dp_cp": groups.dp_cp, "world": world_group()}
    # keyed by rank set (and backend), as all_reduce_by_groups: a dp group built apart from the
    # world group over the same ranks (a 1-D device mesh) costs no second collective
    plan: dict[Any, tuple[Any, list[int]]] = {}
    memo: dict[int, Any] = {}
    for i, name in enumerate(COUNT_FIELDS[1:]):
        group = group_of[_FIELD_GROUP[name]]
        if group_size(group) > 1:
            plan.setdefault(group_key(group, memo), (group, []))[1].append(i)
    return list(plan.values())


def reduce_counts(matrix: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Sum the columns of ``matrix`` (``[n, 7]``, the :data:`COUNT_FIELDS` after ``seconds``)
    over their groups: one SUM collective per distinct group (one in all under plain DDP)."""
    out = matrix.to(torch.float64, copy=True)
    for group, columns in _reduction_plan(groups):
        out[:, columns] = all_reduce_coalesced([out[:, columns]], "sum", group)[0]
    return out


def count_reduction_calls(rows: int, groups: ProcessGroups) -> tuple[CollectiveCall, ...]:
    """The collectives :func:`reduce_counts` issues for a matrix of ``rows`` rows, known without
    issuing them (the checkpoint guard completes a failed ``state_dict`` with them)."""
    return tuple(
        CollectiveCall("all_reduce", group, rows * len(columns), torch.float64, "sum")
        for group, columns in _reduction_plan(groups)
    )


def _run_precision(ctx: RunContext) -> str | None:
    """The :data:`PRECISIONS` column of the run's matmuls: under Lightning its trainer's
    ``precision`` (as Lightning's own ``ThroughputMonitor`` picks its peak from the precision
    plugin: fp32 matmuls count as tf32 unless ``torch.get_float32_matmul_precision()`` is
    "highest"); under Accelerate its ``mixed_precision`` (``"no"``: fp32 or tf32 alike);
    ``None`` when it has no column (``64-true``); elsewhere (a plain loop) ``bf16``."""
    trainer_precision = getattr(ctx.trainer, "precision", None) if ctx.trainer else None
    if ctx.framework == "accelerate":
        trainer_precision = _accelerate_precision(ctx.accelerator)
    if not isinstance(trainer_precision, str):
        return "bf16"
    name = trainer_precision.lower()
    if name.startswith("bf16"):
        return "bf16"
    if name.startswith("16"):
        return "fp16"
    if name.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if name.startswith("transformer-engine"):
        return "fp8"
    return None


# the counts of the totals that are summed over the ranks (the steps are the same on each)
_TOTAL_COUNTS = ("batches", "samples", "tokens")

# The units measured flops are counted per, coded as numbers (0: nothing measured) for the rows
# of the state_dict's collective that carry every rank's own measurement.
_UNIT_CODES = ("tokens", "samples", "batches")
_FLOPS_COLUMN = COUNT_FIELDS.index("flops") - 1  # (summed over the world group)


def _encode_measured(measured: tuple[str, float] | None, seq: float | None) -> list[float]:
    """``[unit code, flops per unit, tokens per sample or 0]`` of a rank's measurement."""
    if measured is None:
        return [0.0, 0.0, 0.0]
    return [float(_UNIT_CODES.index(measured[0]) + 1), float(measured[1]), float(seq or 0.0)]


def _decode_measured(entry: Any) -> tuple[tuple[str, float] | None, float | None]:
    """The measurement and its tokens per sample of an :func:`_encode_measured` entry."""
    if not entry or not 1 <= int(entry[0]) <= len(_UNIT_CODES):
        return None, None
    seq = float(entry[2]) if entry[2] else None
    return (_UNIT_CODES[int(entry[0]) - 1], float(entry[1])), seq


class ContextParallelTokensCheck:
    """Warns once per run when, with more than one context-parallel rank, the token count of
    the run's first told micro-batch was read off the batch (:func:`infer_num_tokens`): tokens
    are summed over the context-parallel ranks, each counting its own slice, so a count read
    off the whole sequence is ``cp`` times too high. Shared by the monitors that sum tokens
    (``keys``: what such a count makes too high). Host work only (shapes), no device read."""

    def __init__(self, keys: str) -> None:
        self.keys = keys
        self._cp = 0  # context-parallel ranks while the first micro-batch is to be checked

    def arm(self, groups: ProcessGroups, num_tokens_fn: Any) -> None:
        """At run start: check the run's first micro-batch unless the user counts tokens."""
        # ranks that split each data stream's sequences: |dp_cp| / |dp|
        cp = max(group_size(groups.dp_cp) // max(group_size(groups.dp), 1), 1)
        self._cp = cp if cp > 1 and num_tokens_fn is None else 0

    def check(self, callback: VitalsCallback, batch: BatchInfo) -> None:
        """At a micro-batch start: the check, once per run, on a micro-batch told with its
        batch."""
        if not self._cp or batch.batch is None:
            return
        cp, self._cp = self._cp, 0
        if _tokens_read_off_batch(batch):
            callback.warn_once(
                "cp_tokens",
                f"tokens are summed over the {cp} context-parallel ranks of each data stream, "
                "each counting its own slice of the sequence, and this rank's count was read "
                "off the batch it was told (infer_num_tokens). If that batch holds the whole "
                "sequence (vitals.batch() before the context-parallel split, as torchtitan's "
                "and Accelerate's loops hold it; Lightning's training_step batch), "
                f"{self.keys} are {cp}x too high: pass this rank's share as num_tokens= "
                "(driver) or num_tokens_fn, or call vitals.batch() with the split batch "
                "(warned once; ignore it if the batch told is already this rank's slice)",
            )


def _tokens_read_off_batch(batch: BatchInfo) -> bool:
    """Whether ``batch``'s token count is the one :func:`infer_num_tokens` reads off the
    batch told: an ``int`` equal to it (a count given as a 0-d tensor, or as another number,
    is the user's)."""
    n = batch.num_tokens
    if batch.batch is None or isinstance(n, bool) or not isinstance(n, int):
        return False
    try:
        return n == infer_num_tokens(batch.batch)
    except Exception:  # (a check for a warning: never the reason a step fails)
        return False


def _nothing_untrained() -> dict[str, Any]:
    """The micro-batches, samples and tokens of a step that did not train: none yet."""
    return {"batches": 0, "samples": 0, "tokens": 0}


def _accelerate_precision(accelerator: Any) -> str | None:
    """The Accelerator's ``mixed_precision`` as a Lightning precision name (``"no"``:
    ``"32-true"``); ``None`` when it has none."""
    try:
        mixed = str(accelerator.mixed_precision).lower()
    except Exception:
        return None
    names = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed", "fp8": "transformer-engine"}
    return names.get(mixed)


class ThroughputMonitor(VitalsCallback):
    """Training throughput over a rolling window of optimizer steps, global and per device.

    Every training micro-batch is counted (``micro_batch_start``: one batch, its samples and its
    tokens) into the optimizer step it belongs to; at ``step_end`` the step's wall time is taken
    from a clock that stops during validation, and the step enters a window of the last
    ``window_size`` steps. On a logging step the window's counts are summed over the ranks that
    see different data, one SUM collective per process group (samples and batches over the
    data-parallel group, tokens over data- and context-parallel ranks, flops over all ranks; one
    collective in all under DDP/FSDP), so the global figures are measured, not rank 0 times the
    world size: a rank that processed more tokens counts as such. Per-device figures are this
    rank's own (rank 0's in the written values). Non-logging steps read the clock and add a few
    Python numbers: no sync, no transfer, no collective. On CUDA the logging step synchronises
    the device once before reading the clock, so the window ends when the GPU's work ends.
    Window boundaries that fall on non-logging steps are read without a sync; with
    ``window_size`` a multiple of the logging interval (the defaults 100 and 50) every boundary
    is synchronised. The start and end of validation synchronise too (outside training steps),
    so that queued training work is counted as training and validation work is not.

    The first ``warmup_steps`` steps of each run (compilation, allocator and data-loader
    warm-up) are not put in the window, so with the default nothing is written at step 0. A run
    is each start of training: a new process, a restore from a checkpoint, and another fit (or
    driver) with the same instance, whose first step is timed from its own first micro-batch,
    not from the previous run's last step; the window carries over.

    Flops: give ``flops_per_token`` or ``flops_per_sample`` (forward + backward flops of the
    whole model per token or sample, e.g. ``6 * n_params`` per token for a dense transformer),
    or set ``measure_flops=True`` to count the first optimizer step this instance trains (once)
    with ``torch.utils.flop_counter.FlopCounterMode`` (forward and backward of its micro-batches, up
    to the step's last ``before_optimizer_step``, validation inside the step left out, on this
    rank's model as it runs: the whole model under DDP/FSDP, the local shard under tensor
    parallelism, DTensor included; it slows that one step; exact under ``torch.compile`` with
    the eager, aot_eager and inductor backends on CPU). It counts hardware flops, the matmul
    work that runs, not model flops: a forward re-run by activation checkpointing is counted,
    and so is the score matrix that fused attention (``scaled_dot_product_attention``'s flash,
    memory-efficient, cuDNN and CPU kernels) recomputes in its backward (five backward
    matmuls where the PaLM / Megatron-LM / torchtitan model-flops formula
    ``6 * N + 12 * L * H * Q * T`` per token counts four), so the measurement is
    ``2 * L * H * Q * T`` per token above model flops even without checkpointing (``L``
    layers, ``H`` heads of size ``Q``, ``T`` tokens per sequence): the MFU keys are hardware
    flops utilisation in PaLM's terms; give ``flops_per_token`` for model-flops MFU. The count
    is divided by the step's tokens (else samples, else batches), kept in the checkpoint and
    used for every later step: exact for steps doing the same work per token, an
    approximation otherwise (below). Per token it is exact for steps of the measured step's
    sequence length only: attention's flops per token grow with the length, so with
    variable-length batches the flops keys of longer (shorter) steps come out low (high); a
    window whose tokens per sample differ from the measured step's is warned about once (give
    ``flops_per_token`` or ``flops_per_sample`` for such runs). On a MoE model the count is the matmul work that runs:
    the routed top-k experts, each on its own tokens, when the experts compute only their
    tokens (transformers 5.x's ``grouped_mm``, ``batched_mm`` and ``eager`` experts: the
    grouped matmuls, which ``FlopCounterMode`` of torch 2.13 has no formula for, are counted
    by :func:`trainvitals.stats.flops.extra_flop_formulas`), but every expert on every token
    for a layer that runs them all and masks the result (``TinyMoELM``'s dense einsum):
    MFU is then hardware flops utilisation, above Megatron's MFU, which counts the routed
    experts only; give ``flops_per_token`` for that. Expert kernels the mode cannot see (custom
    CUDA kernels: DeepGEMM, SonicMoE) are missing from the count. Every token runs exactly
    ``top_k`` experts in transformers' MoE families (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3),
    so the routed work per token, and the measured step's count, is the same in every step
    however the router splits the tokens (experts that get no token count nothing). Where the
    work per token depends on the routing, the first step's figure is reused for every step
    and is an approximation: zero-computation (identity) experts (LongCat-Flash: a later step
    measured 7% above the first in the test), token dropping under a capacity factor, and,
    under expert parallelism, each rank's own expert share (the device keys; the global sum
    stays exact while each rank's token count is the measured step's). A step restored from a
    checkpoint taken inside its accumulation window before the count was made is not measured
    (its carried micro-batches, told again with ``batch=None``, ran in the earlier process:
    their flops would be missing from the count, not their tokens); the next full step is, and
    the unmeasured step's flops are unknown (no flops key while it is in the window). The
    global flops are,
    given per token (sample), the model's flops times the tokens (samples) of all data streams,
    so ranks that see no tokens (pipeline stages past the first) need not report any; measured,
    every rank's own count summed over all ranks, left out (not written low) while some rank
    lacks the count its flops scale with in a step of the window. A device's own flops, given
    per token, are the model's flops of its tokens split evenly over the devices that hold the
    same tokens (its tensor- and pipeline-parallel peers; a context-parallel rank counts its
    own slice of each sequence, so it is not divided by the context-parallel size); given per
    sample, the model's flops of its samples split evenly over the devices that share them
    (tensor-, pipeline- and context-parallel peers): pipeline stages of unequal cost are each
    off (their sum is not); measured, they are what the device ran. Under context parallelism
    each rank must count its own slice of the sequence as its tokens (the token keys and, per
    token, the flops keys are sums over the context-parallel ranks): a count read off the whole
    sequence (``vitals.batch(batch)`` before the split, as torchtitan's and Accelerate's
    context-parallel loops hold the batch; Lightning's ``training_step`` batch) is ``cp`` times
    too high. Pass this rank's share (``num_tokens=`` to ``vitals.batch()``, or
    ``num_tokens_fn``), or tell the driver the batch after the split; a count read off the
    batch (no count given) with more than one context-parallel rank is warned about once per
    run, at its first micro-batch (shapes only, no device read). MFU needs the device's dense
    peak FLOP/s: ``peak_flops`` (per device) or the table in :mod:`trainvitals.stats.flops`
    for the CUDA device at ``precision`` (``tf32`` on a V100, which has no TF32 tensor cores,
    is its ``fp32`` figure). Without ``peak_flops`` no MFU key is written on a CUDA device
    the table lacks, on a MIG slice or at a precision the device's row lacks (``fp32`` on a
    B200, ``fp8`` on an A100: warned once), nor on a device that is not CUDA (CPU: no
    warning).

    Args:
        window_size: optimizer steps in the rolling window.
        warmup_steps: steps of each run (start, restore, another fit) left out of the window.
        batch_size_fn: ``batch -> samples`` (default: the first dim of the first tensor).
        num_tokens_fn: ``batch -> tokens`` (default: ``input_ids.numel()``, also of a
            ``(features, labels)`` batch's features, else the element count of the batch's 2-d
            ``int64``/``int32`` token ids when they are its first tensor of two or more dims,
            padding included:
            :func:`~trainvitals.adapters.context.infer_num_tokens`). Under the driver, explicit
            ``vitals.batch(batch_size=..., num_tokens=...)`` values win. With ``measure_flops``
            the first step's flops are spread over the tokens counted here: counting only real
            tokens, later steps with another share of padding are off by the ratio of the
            shares (give ``flops_per_token`` instead).
        flops_per_token: model flops (forward + backward) per token (MoE: of the active
            parameters, the routed top-k and shared experts).
        flops_per_sample: model flops (forward + backward) per sample.
        measure_flops: measure the flops of the first step with ``FlopCounterMode``: hardware
            flops, recomputation included (above).
        peak_flops: dense peak FLOP/s of one device (overrides the table).
        precision: the table column for the peak: one of ``fp32``, ``tf32``, ``bf16``,
            ``fp16``, ``fp8``. Default: the run's precision under Lightning (``bf16-*`` is
            ``bf16``, ``16-*`` ``fp16``, ``transformer-engine`` ``fp8``, ``32-true`` ``fp32``
            or, when ``torch.get_float32_matmul_precision()`` is not ``"highest"``, ``tf32``;
            ``64-true`` has no peak); under Accelerate its ``mixed_precision`` the same way
            (``"no"`` as ``32-true``, ``"fp8"`` ``fp8``); else (a plain loop) ``bf16``.
        clock: a callable returning seconds (default ``time.perf_counter``), for tests.
        log_every_n_steps: interval in optimizer steps (default: the run's).
        writer: where values go (default: the run's writer).

    Keys written (on logging steps, once the window holds a step):

    =====================================  =========================================================  =========
    key                                    meaning                                                    unit
    =====================================  =========================================================  =========
    ``throughput/batches_per_sec``         micro-batches of all data-parallel ranks per second (*)    batches/s
    ``throughput/samples_per_sec``         samples of all data-parallel ranks per second              samples/s
    ``throughput/tokens_per_sec``          tokens of all data- and context-parallel ranks per second  tokens/s
    ``throughput/device/batches_per_sec``  this rank's micro-batches per second (*)                   batches/s
    ``throughput/device/samples_per_sec``  this rank's samples per second                             samples/s
    ``throughput/device/tokens_per_sec``   this rank's tokens per second                              tokens/s
    ``throughput/seconds_per_step``        mean training wall time per optimizer step in the window   s
    ``throughput/flops_per_sec``           flops of all ranks' work per second (flops known; below)   FLOP/s
    ``throughput/device/flops_per_sec``    this device's flops per second (flops known; below)        FLOP/s
    ``throughput/mfu``                     ``flops_per_sec / (world_size * peak)`` (peak known)       fraction
    ``throughput/device/mfu``              ``device/flops_per_sec / peak`` (peak known)               fraction
    =====================================  =========================================================  =========

    (*) A batch here is a micro-batch, as in Lightning's ``ThroughputMonitor`` (one per
    ``on_train_batch_end``); in Composer's ``SpeedMonitor`` and Megatron-Bridge's
    ``report_throughput`` a batch is one optimizer step over the global batch, so their
    ``batches_per_sec`` is optimizer steps per second (``1 / throughput/seconds_per_step``
    here), data-parallel size times accumulation steps below ours.

    Which flops: given (``flops_per_token``/``flops_per_sample``), model flops, as Megatron-LM's
    and torchtitan's MFU count them (activation recomputation not counted): ``throughput/mfu``
    is Megatron-LM's throughput per GPU over the peak (the model flops of all data streams
    over all devices' peak), ``throughput/device/mfu`` torchtitan's (the flops of this rank's
    tokens split over its tensor- and pipeline-parallel peers, of its samples over its
    tensor-, pipeline- and context-parallel peers); measured
    (``measure_flops``), the flops this rank's matmuls ran, summed over every rank for the
    global keys: hardware flops (a forward re-run by activation checkpointing and the scores
    fused attention recomputes in its backward counted, so hardware flops utilisation in
    PaLM's terms). The global keys are the same on every rank
    that has the counts (a pipeline stage without tokens has none when flops are given per
    token); ``throughput/mfu`` divides the window's flops by its device-seconds times the peak:
    ``world_size * peak`` per second, and window entries restored from a run on another number
    of devices at that run's. Each rank keeps its own measured flops across a checkpoint (the
    one copy a checkpoint keeps gathers every rank's).

    Rates are counts summed over the window divided by the window's training time (validation
    excluded). An optimizer step is one ``optimizer.step()`` as Lightning's ``global_step`` and
    ``max_steps`` count them: under manual optimization a batch stepping two optimizers (a GAN)
    is two steps, and ``seconds_per_step`` half its time, as ``time/seconds_per_step`` of
    :class:`RuntimeMonitor`. A micro-batch whose ``training_step`` returned ``None`` under
    Lightning's automatic optimization (no backward; Lightning still advances ``global_step``)
    counts in the batch, sample and token rates and its time in the window (data read, as
    Lightning's ``ThroughputMonitor`` and Composer's ``SpeedMonitor`` count every batch), but
    adds no flops: the flops and MFU keys cover trained micro-batches only (also after a
    checkpoint, which makes the window's entries global, and after a resume: the state keeps
    each entry's untrained samples and tokens, ``untrained``; a checkpoint without them takes
    its entries as trained), and a step holding one is not the step ``measure_flops``
    measures. Under the driver every micro-batch told with
    ``vitals.batch()`` counts as trained: call it only for micro-batches that run a backward.
    A rate whose count some rank could not provide (a batch without a
    tensor, no ``input_ids``) is not written. Names follow Composer's ``SpeedMonitor`` and
    Megatron-Bridge's ``report_throughput``; ``throughput/mfu`` (global) and
    ``throughput/seconds_per_step`` are ours. Deviations: ``batches`` are micro-batches (the
    table's note); the global rates are counts summed over the ranks (Lightning's are rank
    0's times the world size, Megatron-Bridge's the configured global batch size per
    iteration); ``throughput/device/*`` are this rank's own counts, Lightning's per-device
    meaning, where Composer (``composer/callbacks/speed_monitor.py``:
    ``dev_samples_per_sec = samples_per_sec / world_size``, likewise batches, tokens and
    flops) and Megatron-Bridge divide the global rate by the world size, which differs when
    ranks see different counts and under tensor, pipeline or context parallelism (peers share
    their samples).

    Example::

        import lightning.pytorch as pl
        from trainvitals import ThroughputMonitor

        monitor = ThroughputMonitor(flops_per_token=6 * 25e6, window_size=100)
        trainer = pl.Trainer(callbacks=[monitor], log_every_n_steps=50)

        # plain / Accelerate loop
        from trainvitals.adapters.loop import Vitals

        vitals = Vitals([monitor]).attach(model, optimizer)
        for batch in loader:
            vitals.batch(batch, num_tokens=batch["attention_mask"].sum())  # 0-d: no device wait
            ...
    """

    def __init__(
        self,
        *,
        window_size: int = 100,
        warmup_steps: int = 1,
        batch_size_fn: Callable[[Any], Any] | None = None,
        num_tokens_fn: Callable[[Any], Any] | None = None,
        flops_per_token: float | None = None,
        flops_per_sample: float | None = None,
        measure_flops: bool = False,
        peak_flops: float | None = None,
        precision: str | None = None,
        clock: Callable[[], float] | None = None,
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        for name, fn in (("batch_size_fn", batch_size_fn), ("num_tokens_fn", num_tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable batch -> int, got {fn!r}")
        for name, value in (
            ("flops_per_token", flops_per_token),
            ("flops_per_sample", flops_per_sample),
            ("peak_flops", peak_flops),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        given = [
            n
            for n, v in (
                ("flops_per_token", flops_per_token),
                ("flops_per_sample", flops_per_sample),
                ("measure_flops", measure_flops or None),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of flops_per_token, flops_per_sample, measure_flops; got {given}"
            )
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
        self.window_size = window_size
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.num_tokens_fn = num_tokens_fn
        self.flops_per_token = flops_per_token
        self.flops_per_sample = flops_per_sample
        self.measure_flops = bool(measure_flops)
        self.peak_flops = peak_flops
        self.precision = precision
        self._clock = TrainClock(clock)
        self._counter = StepCounter()
        self._window = RollingWindow(window_size)
        # Parallel to the window's entries: (samples, tokens) of each step's micro-batches that
        # did not train (see on_train_batch_end), which the global flops leave out. Non-zero
        # only in a single-process run (Lightning refuses a None training_step on several
        # ranks), so they are global counts as they stand: no collective.
        self._untrained_window: deque[tuple[Any, Any]] = deque(maxlen=window_size)
        self._last_end: float | None = None  # train-clock reading at the previous step end
        self._steps_this_run = 0
        # Steps, and micro-batches, samples and tokens summed over the ranks that see different
        # data (as the global rates), as of the last state_dict or restore; the counts of this
        # rank since then wait in _pending_totals for the next state_dict's collective. A
        # checkpoint keeps one copy (rank 0's) and restores it on every rank, so the totals
        # it holds must be the global ones: per-rank totals became rank 0's on every rank.
        self._totals = {"steps": 0, "batches": 0, "samples": 0.0, "tokens": 0.0}
        self._pending_totals: dict[str, Any] = dict.fromkeys(_TOTAL_COUNTS, 0)
        self._measured: tuple[str, float] | None = None  # (unit, flops per unit), measured
        # tokens per sample of the measured step (its sequence length): flops per token are
        # exact for steps of that length only (attention grows with the length)
        self._measured_seq: float | None = None
        self._session: FlopCounterSession | None = None
        # a session whose step ended while another dispatch mode entered after its counter was
        # still on top of it: left as soon as it is on top again (_leave_left_on)
        self._left_on: FlopCounterSession | None = None
        self._flops_before_optimizer: int | None = None  # the session's count at the last one
        # Flops the session counted during validation inside the measured step (validation
        # every few batches under gradient accumulation), and its count when validation began.
        self._validation_flops = 0
        self._flops_at_validation_start: int | None = None
        # The step in progress has micro-batches a restored checkpoint carried from inside an
        # accumulation window (told again by the driver, not run by this process): its flops
        # cannot be measured against its counts, so the measurement waits for the next step.
        self._carried_in_step = False
        # Sizes of the last training micro-batch, and the samples and tokens of the step's
        # micro-batches that did not train (Lightning: training_step returned None, so no
        # backward): read, so in the counts, but no model flops (see on_train_batch_end).
        self._last_sizes: tuple[Any, Any] | None = None
        self._untrained: dict[str, Any] = _nothing_untrained()
        self._groups = ProcessGroups()
        # A checkpoint's measured flops by rank and the model-parallel sizes they were measured
        # under, restored before the run's groups are known (Lightning, the driver): each rank
        # picks its own at run_start (_own_measurement). _running: the groups are this run's.
        self._restored_by_rank: tuple[list[Any], Any] | None = None
        self._running = False
        self._peak: float | None = None
        self._mp = {"tokens": 1, "samples": 1}
        self._cuda: torch.device | None = None
        self._cp_tokens = ContextParallelTokensCheck(
            "the token rates and, with flops_per_token, the flops and MFU keys"
        )

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        # A run is a (re)start, also on an instance that ran before (another fit on the same
        # trainer, a retry after a failure): its first step is timed from its own first
        # micro-batch, not from the previous run's last step end (which would put the time
        # between the runs into one step of the window), the micro-batches of a step the
        # previous run left unfinished are not counted into it, and its warm-up applies.
        self._restart()
        self._groups = ctx.groups
        self._running = True
        if self._restored_by_rank is not None:
            self._measured, self._measured_seq = self._own_measurement(*self._restored_by_rank)
            self._restored_by_rank = None
        device = ctx.device
        self._cuda = device if device.type == "cuda" else None
        self._clock.sync_fn = (
            None if self._cuda is None else partial(torch.cuda.synchronize, device)
        )
        self._peak = self.peak_flops
        if self._peak is None and self._cuda is not None:
            name = device_name_of(device) or ""
            precision = self.precision or _run_precision(ctx)
            self._peak = None if precision is None else peak_flops(name, precision)
            if self._peak is None:
                # the device may be known, only not at this precision (V100 at bf16)
                known = chip_name(name) is not None
                run_precision = precision or getattr(ctx.trainer, "precision", None)
                what = f"{name!r} at precision={run_precision!r}" if known else repr(name)
                self.warn_once("peak", f"no peak FLOP/s known for {what}; pass peak_flops= for MFU")
        world = ctx.world_size
        # Devices that share one token (sample) stream and split its model flops between them.
        self._mp = {
            "tokens": max(world // group_size(ctx.groups.dp_cp), 1),
            "samples": max(world // group_size(ctx.groups.dp), 1),
        }
        self._cp_tokens.arm(ctx.groups, self.num_tokens_fn)

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        self._leave_left_on()
        if ctx.in_validation:
            return
        self._clock.start()
        if ctx.micro_batches_in_step == 0 and batch.batch is None:
            # A micro-batch the step's count of started micro-batches leaves out: one a
            # restored checkpoint carried from inside an accumulation window, consumed before
            # the checkpoint and told again by the driver (``batch=None``, its saved sizes).
            # Its forward and backward ran in the earlier process: a flop count of this step
            # would miss them while the step's samples and tokens hold them.
            self._carried_in_step = True
        if (
            self.measure_flops
            and self._measured is None
            and self._session is None
            and not self._carried_in_step
        ):
            self._session = FlopCounterSession()
            self._session.start()
        self._counter.add(batch.batch_size, batch.num_tokens)
        self._last_sizes = (batch.batch_size, batch.num_tokens)
        self._cp_tokens.check(self, batch)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning's automatic optimization hands ``{}`` for a training_step that returned
        # None: no backward (single process only; Lightning refuses it with several). The
        # batch was read (its samples and tokens count, as Lightning's ThroughputMonitor counts
        # every batch) and global_step still advances, but it adds no model flops.
        if (
            getattr(pl_module, "automatic_optimization", True)
            and isinstance(outputs, dict)
            and not outputs
            and self._last_sizes is not None
        ):
            samples, tokens = self._last_sizes
            u = self._untrained
            u["batches"] += 1
            # (``is None``, not ``or``: a 0-d device tensor's truth value is a device sync)
            u["samples"] = u["samples"] + (0 if samples is None else samples)
            u["tokens"] = u["tokens"] + (0 if tokens is None else tokens)
        self._last_sizes = None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def before_optimizer_step(self, ctx: RunContext) -> None:
        if self._session is not None and self._session.active:
            # The step's forward and backward so far, without the optimizer's own math. The
            # mode stays on until step_end: under Lightning's manual optimization a batch may
            # step several optimizers (a GAN), each after its own forward and backward.
            self._flops_before_optimizer = self._session.flops() - self._validation_flops

    def validation_start(self, ctx: RunContext) -> None:
        self._clock.pause()  # waits for the device's queued work first (sync_fn)
        if self._session is not None and self._session.active:
            self._flops_at_validation_start = self._session.flops()

    def validation_end(self, ctx: RunContext) -> None:
        self._clock.resume()
        start, self._flops_at_validation_start = self._flops_at_validation_start, None
        if start is not None and self._session is not None and self._session.active:
            # validation's forward passes are not the step's training work
            self._validation_flops += self._session.flops() - start

    def step_end(self, ctx: RunContext) -> None:
        self._leave_left_on()
        log = self.should_log(ctx)
        if log:
            self._clock.sync()  # the window ends when the GPU's work ends
        self._finish_flop_measurement()
        self._clock.start()  # no-op unless no micro-batch was reported
        now = self._clock.train_seconds()
        seconds = now - (self._last_end or 0.0)
        self._last_end = now
        # ctx.step_increment: optimizer steps of this step_end (several when one batch steps
        # several optimizers under Lightning's manual optimization)
        record = self._counter.take(seconds, steps=ctx.step_increment)
        record.flops = self._device_flops(record)
        untrained = (self._untrained["samples"], self._untrained["tokens"])
        self._untrained = _nothing_untrained()
        if self._carried_in_step:
            self._carried_in_step = False
            if self.measure_flops and self._measured is None:
                # to be measured in a later step: this one's flops are not known (left out
                # of the flops keys while it is in the window, not counted as 0)
                record.flops = math.nan
        self._count_totals(record)
        self._steps_this_run += 1
        if record.batches_missing:
            self.warn_once(
                "nobatch",
                "no micro-batch reported in a step: call vitals.batch() "
                "once per micro-batch; counts of such steps are not reported",
            )
        if self._steps_this_run > self.warmup_steps:
            self._window.append(record)
            self._untrained_window.append(untrained)
        if log:
            self.write(ctx, self._rates(ctx))

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._finish_flop_measurement(complete=False)
        self._leave_left_on()
        self._running = False

    def run_end(self, ctx: RunContext) -> None:
        self._finish_flop_measurement(complete=False)
        self._leave_left_on()
        self._running = False

    def release(self, ctx: RunContext) -> None:
        # disabled by the guard: its step_end will not come to leave the FlopCounterMode,
        # which would otherwise stay on (every op through Python) for the rest of the process
        self._finish_flop_measurement(complete=False)
        self._leave_left_on()

    # ------------------------------------------------------------------ what it measures

    def _leave_left_on(self) -> None:
        """Leave a flop counter that could not be left when its step ended (a dispatch mode
        entered after it, a user's profiler around backward and the optimizer step, was still
        on top) once it is on top again: kept on, it would route every op of the process
        through Python for good."""
        session = self._left_on
        if session is not None:
            session.stop()
            if not session.active:
                self._left_on = None

    def _finish_flop_measurement(self, complete: bool = True) -> None:
        """Leave the flop-counting mode, if on. ``complete``: the measured step ended (its
        ``step_end``), so its count is kept; otherwise (the run failed or ended inside its first
        step, the callback was disabled) the count covers only part of the step, a forward
        without its backward, and is dropped: the next step of this instance measures again."""
        session, self._session = self._session, None
        before_optimizer, self._flops_before_optimizer = self._flops_before_optimizer, None
        validation_flops, self._validation_flops = self._validation_flops, 0
        self._flops_at_validation_start = None
        if session is None or not session.active:
            return
        flops = session.stop()
        if session.active:  # another dispatch mode is still on top of the counter
            self._left_on = session
        if not complete or self._untrained["batches"]:
            # (a step with a micro-batch that did not train: its forward is in the count, its
            # backward is not; the next step of this instance measures again)
            return
        if flops is not None:
            flops = before_optimizer if before_optimizer is not None else flops - validation_flops
        c = self._counter
        if flops is None:
            self.warn_once(
                "flops",
                "could not leave FlopCounterMode cleanly (another dispatch "
                "mode is active); flops not measured",
            )
            self.measure_flops = False
            return
        if flops == 0:
            # FlopCounterMode saw no matmul/conv/attention (e.g. all in custom kernels): a
            # training step does work, so 0 FLOP/s and MFU 0 would be wrong numbers
            self.warn_once(
                "flops",
                "FlopCounterMode counted no flops in the first step; "
                "flops not measured, pass flops_per_token=",
            )
            self.measure_flops = False
            return
        for unit, count, missing in (
            ("tokens", c.tokens, c.tokens_missing),
            ("samples", c.samples, c.samples_missing),
            ("batches", c.batches, int(c.batches == 0)),
        ):
            if not missing and float(count) > 0:
                self._measured = (unit, flops / float(count))
                self._measured_seq = None
                if unit == "tokens" and not c.samples_missing and float(c.samples) > 0:
                    self._measured_seq = float(c.tokens) / float(c.samples)
                return

    def _flops_unit(self) -> tuple[str, float] | None:
        """``(unit, flops)``: the count (``tokens``, ``samples`` or ``batches``) this device's
        flops scale with and its flops per unit of it; ``None`` when no flops are known."""
        if self.flops_per_token is not None:
            return "tokens", self.flops_per_token / self._mp["tokens"]
        if self.flops_per_sample is not None:
            return "samples", self.flops_per_sample / self._mp["samples"]
        return self._measured

    def _device_flops(self, record: Any) -> Any:
        """This device's flops in the step: 0 when no flops are known, NaN when they are but
        this rank lacks the step's count they scale with. A rank reporting no tokens (a later
        pipeline stage) would otherwise add 0 to the sum over all ranks, which is summed over
        ranks other than those whose missing counts rank 0 sees: a low sum, not flagged."""
        unit = self._flops_unit()
        if unit is None:
            return 0.0
        name, per_unit = unit
        if getattr(record, f"{name}_missing"):
            return math.nan
        trained = getattr(record, name) - self._untrained[name]
        return trained * per_unit

    def _global_flops(self, g: dict[str, float]) -> float | None:
        """Flops of all ranks in the window (``g``: its counts summed over ranks), or ``None``
        when some count is missing. Given per token (sample), the model's flops per token times
        the trained tokens of every data stream (those of micro-batches that did not train left
        out, on every path: live entries and entries restored from a checkpoint alike): exact
        however the model is split over devices, and not reliant on ranks that see no data
        (pipeline stages past the first) reporting tokens. Measured (each rank its own part of
        the model): the sum of every rank's, each of trained micro-batches only."""
        unit = self._flops_unit()
        if unit is None:
            return None
        name = unit[0]
        if g[f"{name}_missing"]:
            return None
        model_flops = self.flops_per_token or self.flops_per_sample
        if model_flops is not None:
            return (g[name] - self._untrained_sums()[name]) * model_flops
        return None if math.isnan(g["flops"]) else g["flops"]

    def _untrained_sums(self) -> dict[str, float]:
        """Samples and tokens of the window's micro-batches that did not train (host numbers:
        read on a logging step only)."""
        samples: Any = 0
        tokens: Any = 0
        for s, t in self._untrained_window:
            samples, tokens = samples + s, tokens + t
        return dict(zip(("samples", "tokens"), to_vector([samples, tokens]).tolist(), strict=True))

    def _count_totals(self, record: Any) -> None:
        self._totals["steps"] += 1
        p = self._pending_totals
        p["batches"] += record.batches
        p["samples"] = p["samples"] + record.samples
        p["tokens"] = p["tokens"] + record.tokens

    def _rates(self, ctx: RunContext) -> dict[str, Any]:
        local_sums = self._window.sums()
        live, restored = self._window.split_sums()
        live_vec = to_vector(live.counts()).unsqueeze(0)
        # Host values from here on (the collective's result is on the CPU). Reduced on every
        # logging step, the window empty (warm-up) or not: the guard completes a rank's failed
        # step_end with the collectives of the last logging step_end, which must be the same.
        summed = reduce_counts(live_vec, self._groups)[0].tolist()
        if not len(self._window):
            return {}
        g = dict(
            zip(
                COUNT_FIELDS[1:],
                (a + b for a, b in zip(summed, restored, strict=True)),
                strict=True,
            )
        )
        loc = dict(zip(COUNT_FIELDS[1:], to_vector(local_sums.counts()).tolist(), strict=True))
        seconds = float(local_sums.seconds)
        if seconds <= 0:
            return {}
        out: dict[str, Any] = {"throughput/seconds_per_step": seconds / local_sums.steps}
        for unit in ("batches", "samples", "tokens"):
            if g[f"{unit}_missing"] == 0:
                out[f"throughput/{unit}_per_sec"] = g[unit] / seconds
            if loc[f"{unit}_missing"] == 0:
                out[f"throughput/device/{unit}_per_sec"] = loc[unit] / seconds
        global_flops = self._global_flops(g)
        if global_flops is not None:
            flops_per_sec = global_flops / seconds
            out["throughput/flops_per_sec"] = flops_per_sec
            if self._peak:
                # the window's flops over its devices' capacity: peak times device-seconds,
                # entries restored from a run on another number of devices at their own
                # (a resume from 2 devices onto 1 wrote twice the MFU for a window)
                devices = self._window.device_seconds(ctx.world_size)
                out["throughput/mfu"] = global_flops / (devices * self._peak)
        self._check_sequence_length(loc)
        unit = self._flops_unit()
        if unit is not None and not loc[f"{unit[0]}_missing"] and not math.isnan(loc["flops"]):
            device_flops = loc["flops"] / seconds
            out["throughput/device/flops_per_sec"] = device_flops
            if self._peak:
                out["throughput/device/mfu"] = device_flops / self._peak
        return out

    def _check_sequence_length(self, loc: dict[str, float]) -> None:
        """Warn once when measured flops per token meet a window whose tokens per sample differ
        from the measured step's: a transformer's attention flops per token grow with the
        sequence length, so the measured figure is exact for steps of that length only."""
        seq = self._measured_seq
        if seq is None or self._measured is None or self._measured[0] != "tokens":
            return
        if loc["samples_missing"] or loc["tokens_missing"] or loc["samples"] <= 0:
            return
        window_seq = loc["tokens"] / loc["samples"]
        if not math.isclose(window_seq, seq, rel_tol=1e-6):
            self.warn_once(
                "seqlen",
                f"flops were measured on a step of {seq:g} tokens per sample, the window's "
                f"steps have {window_seq:g}: flops per token that depend on the sequence "
                "length (attention) make the flops and MFU keys inexact; pass "
                "flops_per_token= for variable-length batches",
            )

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Window, untrained counts of its entries, totals and measured flops. On a multi-rank
        run this is collective (the window's counts and the totals are summed over the ranks so
        that rank 0's copy restores exact global rates and totals): call it on every rank, as
        Lightning's and Accelerate's checkpointing do. ``totals``: optimizer steps, and
        micro-batches, samples and tokens summed over the ranks as the global rates are
        (samples and batches over data-parallel ranks, tokens over data- and context-parallel
        ranks). ``untrained``: ``[samples, tokens]`` of each window entry's micro-batches that
        did not train (single-process runs only, so already global), which the global flops
        leave out. ``measured_by_rank``: every rank's own measured flops per unit (``[unit
        code, flops, tokens per sample]``, ranks in world order, gathered in the same
        collective), so that each rank restores its own: pipeline stages and
        tensor/expert-parallel ranks of uneven work measure different figures. ``measured`` is
        this rank's (rank 0's in a checkpoint)."""
        idx, live = self._window.live_matrix()
        # window_size + 3 * slots + 2 rows on every rank, however many entries are live here:
        # the collective's size follows from the configuration alone, so the checkpoint guard
        # can complete it for a rank whose state_dict failed before it
        # (state_dict_collectives), and ranks whose windows differ (a step_end that failed on
        # one rank) still pair up. After the window, three rows per rank of the world carry
        # that rank's measured flops in the flops column (summed over the world group, zeros
        # elsewhere: an all-gather in the same collective). The row before the last holds this
        # rank's totals since the last state_dict (no extra collective). The last row is 0 on
        # every rank: NaN there is a rank's "missing" mark (accelerators).
        size, slots = self._window.size, self._measured_slots()
        matrix = torch.zeros(size + 3 * slots + 2, len(COUNT_FIELDS) - 1, dtype=torch.float64)
        matrix[: len(idx)] = live
        if slots:
            mine = size + 3 * group_rank(world_group())
            matrix[mine : mine + 3, _FLOPS_COLUMN] = torch.tensor(
                _encode_measured(self._measured, self._measured_seq), dtype=torch.float64
            )
        columns = [COUNT_FIELDS.index(name) - 1 for name in _TOTAL_COUNTS]
        matrix[-2, columns] = to_vector([self._pending_totals[n] for n in _TOTAL_COUNTS])
        summed = reduce_counts(matrix, self._groups)
        if bool(summed[-1].isnan().any()):
            raise PeerRankFailed("another rank's window counts are missing from this checkpoint")
        if idx:
            self._window.set_globals(idx, summed[: len(idx)], group_size(world_group()))
        for name, value in zip(_TOTAL_COUNTS, summed[-2, columns].tolist(), strict=True):
            self._totals[name] += int(value) if name == "batches" else value
        self._pending_totals = dict.fromkeys(_TOTAL_COUNTS, 0)
        by_rank = summed[size : size + 3 * slots, _FLOPS_COLUMN].view(slots, 3).tolist()
        return {
            "window": self._window.state_dict(),
            # (samples, tokens) that did not train, per window entry: global counts (above)
            "untrained": [
                [as_float_state(s), as_float_state(t)] for s, t in self._untrained_window
            ],
            "totals": {k: float(v) for k, v in self._totals.items()},
            "measured": list(self._measured) if self._measured is not None else None,
            "measured_tokens_per_sample": self._measured_seq,
            "measured_by_rank": by_rank if slots else None,
            "measured_layout": self._model_parallel_sizes() if slots else None,
        }

    def _model_parallel_sizes(self) -> list[int]:
        """Sizes of this run's tensor-, pipeline-, context- and expert-parallel groups: a
        rank's share of the model's work, which its measured flops per unit depend on."""
        g = self._groups
        return [group_size(group) for group in (g.tp, g.pp, g.cp, g.ep)]

    def _measured_slots(self) -> int:
        """Ranks whose measured flops the state_dict's collective carries: every rank of the
        world unless flops are given (known from the configuration, the same on every rank)."""
        if self.flops_per_token is not None or self.flops_per_sample is not None:
            return 0
        return group_size(world_group())

    def state_dict_collectives(self) -> tuple[CollectiveCall, ...]:
        rows = self._window.size + 3 * self._measured_slots() + 2
        return count_reduction_calls(rows, self._groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._window.load_state_dict(state_dict.get("window", {}))
        # the window keeps the last entries of the saved ones: so does the parallel list. A
        # state saved before it existed (or not matching the window) loads as all trained.
        untrained = state_dict.get("untrained") or []
        saved = len(state_dict.get("window", {}).get("records", []))
        kept = len(self._window)
        self._untrained_window.clear()
        if len(untrained) == saved:
            self._untrained_window.extend(
                (float(s), float(t)) for s, t in untrained[saved - kept :]
            )
        else:
            self._untrained_window.extend([(0.0, 0.0)] * kept)
        totals = state_dict.get("totals", {})
        self._totals = {k: totals.get(k, 0) for k in self._totals}
        self._totals["steps"] = int(self._totals["steps"])
        self._totals["batches"] = int(self._totals["batches"])
        self._pending_totals = dict.fromkeys(_TOTAL_COUNTS, 0)  # (the restored ones are global)
        measured = state_dict.get("measured")
        self._measured = (str(measured[0]), float(measured[1])) if measured else None
        seq = state_dict.get("measured_tokens_per_sample")
        self._measured_seq = None if seq is None or self._measured is None else float(seq)
        by_rank = state_dict.get("measured_by_rank")
        self._restored_by_rank = None
        if by_rank:
            layout = state_dict.get("measured_layout")
            # Before a run its groups are not known yet (the model-parallel sizes are checked
            # at run_start, which picks again); during one (a rollback) they are.
            self._measured, self._measured_seq = self._own_measurement(
                by_rank, layout if self._running else None
            )
            if not self._running:
                self._restored_by_rank = (by_rank, layout)
        # A restore is a restart, also on an instance that has already trained (a rollback,
        # fit(ckpt_path=) with the same callbacks): its own clock and warm-up, as RuntimeMonitor,
        # so the time before the restore is not timed as the next step; micro-batches of a step
        # in progress at the restore are dropped (the restored run replays it).
        self._restart()

    def _own_measurement(
        self, by_rank: list[Any], layout: Any = None
    ) -> tuple[tuple[str, float] | None, float | None]:
        """This rank's measured flops from a checkpoint's ``measured_by_rank``: none when it
        was measured under other model-parallel sizes (``layout``, ``measured_layout``: a
        data-parallel run resumed under tensor parallelism runs half of each matmul per rank,
        and kept its whole-model figure: twice the flops); else its own entry when the world
        has the checkpoint's size; on another world size, the one figure all ranks measured,
        else none (measured again when ``measure_flops``: a rank of the new layout may do
        another rank's share of the work)."""
        world = group_size(world_group())
        mine = self._model_parallel_sizes()
        if layout is not None and [int(n) for n in layout] != mine:
            self.warn_once(
                "flops_layout",
                f"the checkpoint's measured flops were measured under tensor/pipeline/context/"
                f"expert-parallel sizes {list(layout)}, this run has {mine}: they are not "
                "restored" + (" (measured again)" if self.measure_flops else ""),
            )
            return None, None
        if len(by_rank) == world:
            return _decode_measured(by_rank[group_rank(world_group())])
        decoded = [_decode_measured(entry) for entry in by_rank]
        if all(m == decoded[0][0] for m, _ in decoded):
            return decoded[0]
        self.warn_once(
            "flops_layout",
            f"the checkpoint's measured flops differ between its {len(by_rank)} ranks and this "
            f"run has {world}: they are not restored"
            + (" (measured again)" if self.measure_flops else ""),
        )
        return None, None

    def _restart(self) -> None:
        """Start timing afresh: a new clock, no previous step end, the warm-up again, and no
        micro-batch of a step in progress. The window, the totals and the measured flops stay."""
        self._clock = self._clock.fresh()
        self._last_end = None
        self._steps_this_run = 0
        self._counter.reset()
        self._carried_in_step = False
        self._last_sizes = None
        self._untrained = _nothing_untrained()
