"""Floating-point work: peak dense FLOP/s of common accelerators, and measuring a step's flops.

Peak figures are DENSE tensor-core (or vector, for ``fp32``) throughput per GPU, from NVIDIA's
datasheets. Datasheets print tensor-core figures "with sparsity" (2:4 structured sparsity,
which training does not use); the dense figure is half of it. Lightning's table
(``lightning.fabric.utilities.throughput._CUDA_FLOPS``, read 2026-11-21) mixes the two: its H200
entries are the sparse figures (2.0e15 bf16) and its "h100 nvl" entry is the figure of the
two-GPU NVL pair, which halves the MFU it reports on those devices; we use dense per-GPU
figures throughout.

Sources (datasheets, dense = sparse / 2):

* H100 SXM / H100 PCIe / H100 NVL: "NVIDIA H100 Tensor Core GPU" datasheet
  (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet):
  SXM BF16 1,979 TFLOPS sparse; PCIe 1,513; NVL (94 GB, per GPU) 1,671.
* H200 SXM / H200 NVL: "NVIDIA H200 Tensor Core GPU" datasheet
  (https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446):
  SXM BF16 1,979 TFLOPS sparse, NVL 1,671. GH200 has the H100 SXM compute figures.
* A100: "NVIDIA A100 Tensor Core GPU" datasheet: BF16 312 TFLOPS dense (624 sparse), TF32 156,
  FP32 19.5.
* L4, L40S, A10: their product datasheets (L4 BF16 121 dense; L40S BF16 362 dense; A10 BF16 125).
* V100: "NVIDIA V100" datasheet: FP16 tensor 125 (SXM2) / 112 (PCIe) TFLOPS, FP32 15.7 / 14.
* B200: "NVIDIA HGX B200" datasheet: FP8 9 PFLOPS, BF16 4.5 PFLOPS, TF32 2.2 PFLOPS sparse per
  GPU.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "PEAK_FLOPS",
    "PRECISIONS",
    "FlopCounterSession",
    "chip_name",
    "extra_flop_formulas",
    "grouped_mm_flops",
    "measure_flops",
    "peak_flops",
]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")

# chip -> precision -> dense FLOP/s per device.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "b200": {"tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    "h200 sxm": {
        "fp32": 67e12,
        "tf32": 494.7e12,
        "bf16": 989.4e12,
        "fp16": 989.4e12,
        "fp8": 1978.9e12,
    },
    "h200 nvl": {
        "fp32": 60e12,
        "tf32": 417.5e12,
        "bf16": 835.5e12,
        "fp16": 835.5e12,
        "fp8": 1670.5e12,
    },
    "h100 sxm": {
        "fp32": 67e12,
        "tf32": 494.7e12,
        "bf16": 989.4e12,
        "fp16": 989.4e12,
        "fp8": 1978.9e12,
    },
    "h100 nvl": {
        "fp32": 60e12,
        "tf32": 417.5e12,
        "bf16": 835.5e12,
        "fp16": 835.5e12,
        "fp8": 1670.5e12,
    },
    "h100 pcie": {
        "fp32": 51.2e12,
        "tf32": 378e12,
        "bf16": 756.5e12,
        "fp16": 756.5e12,
        "fp8": 1513e12,
    },
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "l40s": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    "l4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
    "a10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "v100 sxm": {"fp32": 15.7e12, "fp16": 125e12},
    "v100 pcie": {"fp32": 14e12, "fp16": 112e12},
}


def chip_name(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` key of a CUDA device name (``torch.cuda.get_device_name()``), e.g.
    ``"NVIDIA H100 80GB HBM3"`` -> ``"h100 sxm"``, ``"NVIDIA H200"`` -> ``"h200 sxm"``."""
    name = device_name.lower()
    if re.search(r"\bmig\b", name):
        # a MIG slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") has a fraction of the GPU's
        # multiprocessors (not simply g/7 of them): the whole GPU's peak would put the MFU
        # several times too low
        return None
    if "gh200" in name:
        return "h100 sxm"
    if "gb200" in name:
        return None  # Grace-Blackwell's GPU peaks higher than the B200 figures below
    if "b200" in name:
        return "b200"
    for chip in ("h200", "h100"):
        if chip in name:
            if "nvl" in name:
                return f"{chip} nvl"
            if "pcie" in name:
                return f"{chip} pcie" if chip == "h100" else None
            return f"{chip} sxm"
    if re.search(r"a100(?!\d)", name):  # not the RTX A1000, a far slower workstation GPU
        return "a100"
    if "l40s" in name:
        return "l40s"
    if "l4" in name.replace("l40", ""):
        return "l4"
    if "a10" in name and "a100" not in name and "a10g" not in name:
        return "a10"
    if "v100s" in name:
        return None  # V100S peaks higher than the V100 figures below
    if "v100" in name:
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    return None


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device of this name at ``precision``; ``None`` if unknown (a
    device not in the table, a MIG slice, a precision the device has no figure for). ``tf32``
    on a device without TF32 tensor cores (V100) is its ``fp32`` figure."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    chip = chip_name(device_name)
    if chip is None:
        return None
    peaks = PEAK_FLOPS[chip]
    if precision == "tf32" and "tf32" not in peaks:
        # no TF32 tensor cores (Volta): fp32 matmuls run at the fp32 rate whatever
        # torch.get_float32_matmul_precision() says (Lightning's get_available_flops asks
        # for tf32 only on Ampere or later)
        precision = "fp32"
    return peaks.get(precision)


def measure_flops(fn: Callable[[], Any]) -> int:
    """Floating-point operations of ``fn()`` as counted by ``torch.utils.flop_counter``.

    ``fn`` should run one forward and backward pass (for example on a model built on the
    ``meta`` device, which costs no memory or time); matrix products, convolutions and
    attention are counted, element-wise work is not. Grouped matmuls (MoE experts) and CPU
    attention, which torch's counter misses, are counted too (:func:`extra_flop_formulas`).
    Recomputation is counted: a forward re-run by activation checkpointing, and the score
    matrix fused attention recomputes in its backward (torch's ``sdpa_backward_flop_count``:
    five matmuls where the PaLM / torchtitan formula ``6 * N + 12 * L * H * Q * T`` per token
    counts four), so this is hardware flops, ``2 * L * H * Q * T`` per token above model flops
    with fused attention even without checkpointing (on the meta device
    ``scaled_dot_product_attention`` runs its math path, plain matmuls: four).

    Example::

        with torch.device("meta"):
            model = MyModel()
            x = torch.randint(0, 1000, (8, 512))
        flops = measure_flops(lambda: model(x).sum().backward())
        ThroughputMonitor(flops_per_sample=flops / 8)
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
        fn()
    return int(counter.get_total_flops())


class FlopCounterSession:
    """A ``FlopCounterMode`` entered in one hook and left in a later one.

    Used to count the flops of the first optimizer step of a run (forward and backward of its
    micro-batches) without wrapping the user's code. :meth:`stop` returns the count, or ``None``
    when the mode could not be left cleanly (another dispatch mode entered after ours is still
    active); it then leaves the mode stack as it is.

    The count is the work this device runs (:func:`device_flop_counter`): DTensor (tensor- or
    sequence-parallel) layers count their local shards, not the whole layer; grouped matmuls
    (MoE experts) and CPU attention are counted (:func:`extra_flop_formulas`).
    """

    def __init__(self) -> None:
        self._mode = device_flop_counter()
        self.active = False
        self._stance: Any = None

    def start(self) -> None:
        self._stance = _force_eager()
        self._mode.__enter__()
        self.active = True

    def flops(self) -> int:
        """The flops counted so far (the mode stays on)."""
        return int(self._mode.get_total_flops())

    def stop(self) -> int | None:
        if not self.active:
            return None
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        try:
            if _get_current_dispatch_mode() is not getattr(self._mode, "mode", self._mode):
                return None
            self.active = False
            self._mode.__exit__(None, None, None)
            return self.flops()
        finally:
            # also when the mode cannot be left: the session ends here, and a force_eager left
            # on would run every compiled model of the process eagerly from now on
            self._restore_stance()

    def _restore_stance(self) -> None:
        """Put back the stance from before :meth:`start`, unless someone changed it since (a
        user's ``with set_stance(...)`` entered after :meth:`start` and left before this:
        ``set_stance``'s own exit restores the stance current when it was built, which would
        bring back a stance the user has left)."""
        stance, self._stance = self._stance, None
        if stance is None:
            return
        from torch._dynamo import eval_frame

        current = getattr(getattr(eval_frame, "_stance", None), "stance", "force_eager")
        if current == "force_eager":
            stance.__exit__(None, None, None)


def _force_eager() -> Any:
    """``torch.compile`` off (``set_stance("force_eager")``) while the flop counter is on, or
    ``None`` where it cannot be set (inside a compiled region, a torch without stances); the
    returned object's ``__exit__`` restores the stance from before.

    Dynamo does not compile a frame under a non-infra dispatch mode, and it marks the skipped
    frame's code object to be skipped for good (``ConvertFrameReturn``'s default
    ``FrameAction.SKIP`` with ``apply_to_code=True``, torch 2.13 ``_dynamo/convert_frame.py``):
    a compiled model whose first step ran under the counter ran eagerly for the whole run
    (measured: 0 compiled calls in 20 steps, 1 per step without ``measure_flops``). Under
    ``force_eager`` Dynamo does not see those frames at all, so nothing is marked, and the
    step is counted eagerly as before (same ops, same count).
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("force_eager")  # set now; its __exit__ puts the prior one back
    except RuntimeError:  # "attempted to set_stance in a torch.compile region"
        return None


def device_flop_counter() -> Any:
    """A ``FlopCounterMode`` that counts the work this device runs.

    The stock mode sees an op on DTensors before DTensor does and counts it at the DTensor's
    global shape: under tensor parallelism every rank would count the whole layer (measured:
    a ``ColwiseParallel``/``RowwiseParallel`` MLP on 2 ranks counts the unsharded model's flops
    on each). This one lets DTensor run the op and counts the local ops it issues instead, and
    leaves out ops on fake or meta tensors (DTensor's sharding propagation runs each op once at
    the global shape on fake tensors), which do no work on a device.
    """
    from torch.utils import flop_counter

    layered = getattr(flop_counter, "_FlopCounterMode", None)
    if layered is None:
        # torch versions where FlopCounterMode is itself the dispatch mode
        class _Counter(_DeviceWorkOnly, flop_counter.FlopCounterMode):
            _dtensor = _dtensor_type()
            _fake = _fake_tensor_type()

        return _global_only(_Counter(display=False, custom_mapping=extra_flop_formulas()))

    class _Mode(_DeviceWorkOnly, layered):
        _dtensor = _dtensor_type()
        _fake = _fake_tensor_type()

    class _LayeredCounter(flop_counter.FlopCounterMode):
        def __enter__(self) -> Any:
            super().__enter__()
            # swap the stock dispatch mode just pushed (the top of the stack) for ours
            self.mode.__exit__(None, None, None)
            self.mode = _Mode(self)
            self.mode.__enter__()
            return self

    return _global_only(_LayeredCounter(display=False, custom_mapping=extra_flop_formulas()))


class _GlobalTotalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every op counts into ``"Global"``
    only, the total that is read. The stock tracker puts forward hooks on every module and
    gradient hooks on their outputs for a per-module breakdown nobody reads here, and those
    hooks broke the user's forward under ``torch.compile(backend="aot_eager")``
    (``AttributeError: 'NoneType' object has no attribute 'next_functions'`` from
    ``register_multi_grad_hook``: the run died)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalTotalOnly:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def _global_only(counter: Any) -> Any:
    if hasattr(counter, "mod_tracker"):
        counter.mod_tracker = _GlobalTotalOnly()
    return counter


class _DeviceWorkOnly:
    """``__torch_dispatch__`` filter of :func:`device_flop_counter` (a mixin before the mode).

    The DTensor and FakeTensor types are looked up when the mode class is made, not per op:
    ``torch.compile`` traces this method when it compiles under the mode, and warns about
    every ``functools.cache`` function it meets there."""

    _dtensor: type | None = None
    _fake: type | tuple[()] = ()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dtensor = self._dtensor
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            # DTensor runs the op; the local ops it issues come back to this mode
            return NotImplemented
        if _on_fake_or_meta(args, kwargs, self._fake):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:  # its name before torch 2.5
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


@functools.cache
def _fake_tensor_type() -> type | tuple[()]:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return ()
    return FakeTensor


def _on_fake_or_meta(args: Any, kwargs: Any, fake: type | tuple[()]) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(
        isinstance(x, torch.Tensor) and (x.is_meta or isinstance(x, fake))
        for x in tree_leaves((args, kwargs or {}))
    )


def extra_flop_formulas() -> dict[Any, Callable[..., int]]:
    """Flop formulas for ops that ``torch.utils.flop_counter`` (torch 2.13) has none for, as
    the ``custom_mapping`` of a ``FlopCounterMode``; ops torch itself counts are left to it.

    * ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``) and ``aten._scaled_grouped_mm``:
      the expert matmuls of a MoE layer in one call, each group (expert) over its own rows.
      transformers 5.x runs its MoE experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS,
      ...) with it by default (``experts_implementation="grouped_mm"``), forward and backward;
      uncounted, a measured step missed every routed expert's work (the test configs: 0.51
      of the analytic count, 0.80 for DeepSeek-V3 with its dense layer and shared expert).
      Only the rows up to ``offs[-1]`` are computed (the kernel skips the rest:
      expert-parallel sentinels), so the formula reads that offset (one host read per call,
      during the measured step only; the whole operand on meta/fake tensors).
    * ``aten._scaled_grouped_mm_v2`` (``torch.nn.functional.scaled_grouped_mm``, the FP8/MX
      grouped matmul; offsets are its argument 8) and ``aten._scaled_mm_v2``
      (``torch.nn.functional.scaled_mm``): ``2 * M * K * N`` from the operands' shapes, as
      torch counts ``aten._scaled_mm`` (its meta function gives ``(M, K) x (K, N) -> (M, N)``
      whatever ``contraction_dim``). Operands packed two to a byte (``float4_e2m1fn_x2``) are
      counted at their stored ``K``, as torch counts ``_scaled_mm``: half the work.
    * ``aten._addmm_activation`` (``addmm`` with a fused ReLU/GELU epilogue), ``aten.addbmm``
      (``sum_b A_b @ B_b``: ``2 * B * M * K * N``), ``aten._foreach_mm`` (one matmul per
      pair of its two lists) and the in-place ``addmm_``, ``baddbmm_``, ``addbmm_``; each has
      its own kernel, so the mode never sees an ``mm`` inside them (counted 0 before).
    * ``transformers::grouped_mm_fallback`` and its backward: transformers' loop of ``mm``
      over experts when ``grouped_mm`` cannot run (a GPU older than SM80, ``torch.compile``
      with weights not in bf16); the mode sees the custom op, not the ``mm`` calls inside it.
    * ``aten._scaled_dot_product_flash_attention_for_cpu`` (the CPU kernel of
      ``scaled_dot_product_attention``), ``aten._scaled_dot_product_fused_attention_overrideable``
      and their backwards, counted as torch counts its CUDA attention kernels
      (``sdpa_flop_count``: both matmuls over the full, unmasked score matrix).
    """
    from torch.utils import flop_counter

    aten = torch.ops.aten
    known = getattr(flop_counter, "flop_registry", {})
    formulas: dict[Any, Callable[..., int]] = {}

    def add(name: str, formula: Callable[..., int], namespace: Any = aten) -> None:
        packet = getattr(namespace, name, None)
        if packet is not None and packet not in known:
            formulas[packet] = formula

    add("_grouped_mm", _grouped_mm_formula(offs_index=2))
    add("_scaled_grouped_mm", _grouped_mm_formula(offs_index=4))
    add("_scaled_grouped_mm_v2", _grouped_mm_formula(offs_index=8))
    add("_scaled_mm_v2", _scaled_mm_v2_flops)
    add("_addmm_activation", _addmm_flops)
    add("addbmm", _batched_mm_flops)
    # the in-place forms (``Tensor.addmm_``, ...): their own ops, which torch counts 0
    add("addmm_", _addmm_flops)
    add("baddbmm_", _batched_mm_flops)
    add("addbmm_", _batched_mm_flops)
    add("_foreach_mm", _foreach_mm_flops)
    add("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward_flops)
    add("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward_flops)
    add("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward_flops)
    add("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward_flops)
    import sys

    if "transformers.integrations.moe" in sys.modules:  # registers its custom ops on import
        try:
            namespace = torch.ops.transformers
            add("grouped_mm_fallback", _grouped_mm_formula(offs_index=2), namespace)
            add("grouped_mm_fallback_backward", _grouped_mm_formula(2, passes=2), namespace)
        except (AttributeError, RuntimeError):
            pass
    return formulas


def _grouped_mm_formula(offs_index: int, passes: int = 1) -> Callable[..., int]:
    """A raw formula (given the tensors, not their shapes) for a grouped matmul whose first two
    arguments are its operands and whose offsets are argument ``offs_index`` (or ``offs=``);
    ``passes``: matmuls of that size it runs (2: the backward's input and weight gradients)."""

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        offs = args[offs_index] if len(args) > offs_index else kwargs.get("offs")
        return passes * grouped_mm_flops(args[0].shape, args[1].shape, _last_offset(offs))

    formula._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode's custom_mapping flag
    return formula


# The matmul variants below count with torch's own formulas of the matmul they compute
# (``mm_flop``, ``bmm_flop``; torch's ``addmm_flop``/``baddbmm_flop`` cannot be reused as they
# are: they are registered already wrapped, and a custom_mapping wraps its formulas again).


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, **kw: Any) -> int:
    """``addmm_(A, B)`` / ``_addmm_activation(self, A, B)``: ``A @ B``, as torch's ``addmm``."""
    from torch.utils.flop_counter import mm_flop

    return mm_flop(a_shape, b_shape)


def _batched_mm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, **kw: Any) -> int:
    """``addbmm(self, A, B)`` / ``baddbmm_(A, B)``, ``A: (B, M, K)``, ``B: (B, K, N)``: the
    batch of products, as torch's ``baddbmm`` (addbmm's sum over the batch is the products'
    accumulation)."""
    from torch.utils.flop_counter import bmm_flop

    return bmm_flop(a_shape, b_shape)


def _scaled_mm_v2_flops(a_shape: Any, b_shape: Any, *args: Any, **kw: Any) -> int:
    """``_scaled_mm_v2(A, B, scales..., recipes...)``: ``A @ B``, as torch counts
    ``_scaled_mm`` (its scales and recipes, positional here, add nothing)."""
    from torch.utils.flop_counter import mm_flop

    return mm_flop(a_shape, b_shape)


def _foreach_mm_flops(
    a_shapes: Any, b_shapes: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    """``_foreach_mm([A_i], [B_i])``: one matrix product per pair."""
    from torch.utils.flop_counter import mm_flop

    return sum(mm_flop(a, b) for a, b in zip(a_shapes, b_shapes, strict=True))


def grouped_mm_flops(a_shape: Any, b_shape: Any, used: int | None = None) -> int:
    """Flops of ``torch._grouped_mm(a, b, offs=offs)`` (shapes as in its meta function, torch
    2.13 ``_create_grouped_mm_output_tensor``), ``used``: ``offs[-1]``, the end of the last
    group along the jagged dimension (``None``: the whole dimension). Every output element is a
    dot product of length K, 2 flops per multiply-add:

    * ``(M, K) x (K, N)``, groups along K: ``(G, M, N)``, ``2 * M * N * K_used``
      (the expert weight gradients: ``x^T @ dy`` per expert);
    * ``(M, K) x (G, K, N)``, groups along M: ``(M, N)``, ``2 * M_used * K * N``
      (each expert's tokens through its weight, forward and input gradient);
    * ``(G, M, K) x (K, N)``, groups along N: ``(M, N)``, ``2 * M * K * N_used``;
    * ``(G, M, K) x (G, K, N)``: a batched matmul, ``2 * G * M * K * N``.
    """
    a, b = tuple(a_shape), tuple(b_shape)
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * b[1] * _clamp(used, a[1])
    if len(a) == 2:
        return 2 * _clamp(used, a[0]) * a[1] * b[-1]
    if len(b) == 2:
        return 2 * a[1] * a[2] * _clamp(used, b[1])
    return 2 * a[0] * a[1] * a[2] * b[-1]


def _clamp(used: int | None, size: int) -> int:
    return size if used is None else max(0, min(int(used), int(size)))


def _last_offset(offs: Any) -> int | None:
    """``offs[-1]`` of a real offsets tensor; ``None`` (count the whole operand) without offsets
    or when the values cannot be read (meta or fake tensors)."""
    if not isinstance(offs, torch.Tensor) or offs.numel() == 0:
        return None
    if offs.is_meta or isinstance(offs, _fake_tensor_type()):
        return None
    try:
        return int(offs[-1])
    except RuntimeError:  # a tensor subclass whose values are not at hand
        return None


def _sdpa_forward_flops(
    q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    """Attention forward on shapes ``[B, Hq, Sq, D]``, ``[B, Hkv, Sk, D]``, ``[B, Hkv, Sk, Dv]``
    (grouped-query heads broadcast): scores ``Q K^T`` and ``P V``, as torch's ``sdpa_flop``."""
    b, h, sq, d = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * sq * sk * (d + dv)


def _sdpa_backward_flops(
    grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    """Attention backward, as torch's ``sdpa_backward_flop``: the scores recomputed
    (``Q K^T``), ``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q``."""
    b, h, sq, d = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * sq * sk * (3 * d + 2 * dv)


def device_name_of(device: torch.device) -> str | None:
    """``torch.cuda.get_device_name`` for CUDA devices, else ``None``."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)
