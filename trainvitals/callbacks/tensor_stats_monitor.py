"""TensorStatsMonitor: exact per-tensor moments of parameters, gradients, activations and
activation-gradients, written to a queryable JSONL file."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainvitals._device import host_to_device, index_on
from trainvitals._hooks import FullgraphRegions, eager_hook
from trainvitals.adapters.context import BatchInfo, RunContext
from trainvitals.adapters.jsonl import _drop_steps_from, drop_steps_from, move_aside
from trainvitals.callbacks.base import VitalsCallback, compile_one_group, flat_sharding
from trainvitals.distributed import (
    all_gather_coalesced,
    all_gather_objects,
    all_reduce_by_groups,
    group_key,
    group_rank,
    group_size,
    groups_by_placement,
    local_tensor,
    partial_groups,
    replicate_groups,
    shard_groups,
)
from trainvitals.stats.moments import (
    FIELDS,
    MomentAccumulator,
    combine_moments,
    derive,
    empty_moments,
    moments_to_rows,
    partial_moments,
)
from trainvitals.stats.norms import (
    canonical_name,
    canonical_named_parameters,
    dedupe_named_tensors,
    has_no_values,
    keep_sharded_parameters,
    optimized_ids,
    stored_values,
    unwrap_model,
)

_log = logging.getLogger(__name__)

__all__ = ["SCHEMA_VERSION", "TensorStatsMonitor"]

#: Version of the ``tensor_stats.jsonl`` line format (see docs/tensor_stats.md).
SCHEMA_VERSION = 1
KINDS = ("param", "grad", "activation", "dgrad")
_SITE_SUFFIXES = ("input0", "output0")
# Activations and dgrads are reduced in batches of this many tensors (or sooner, once they
# hold this many elements): a compiled or eager kernel called right after the model's own
# forward/backward work runs from cold CPU caches and costs ~3x its warm time (measured: a
# 512K-element call 600 us cold, 170 us warm), so the hooks hold references and reduce a
# batch back to back. Memory held: at most this many tensors, which are mostly alive anyway
# (saved for backward, or about to be consumed).
_DEFER_TENSORS = 8
_DEFER_ELEMENTS = 1 << 26
# On an accelerator a batch goes through one compiled call per bucket
# (MomentAccumulator.add_many), and each call costs ~120-170 us of host time (H100): batches of
# up to 32 tensors, within the same element bound.
_DEFER_TENSORS_DEVICE = 32
# The accumulator of activations seen under no_grad at sites not yet known to train with
# autograd on (see _merged_sites).
_UNSURE = "activation_unsure"


@dataclass
class _Kind:
    """One kind's tensors on this step: names, local moments, and how to combine them."""

    names: list[str]
    moments: torch.Tensor  # [T, NUM_FIELDS] float64, rank-local until combined
    groups: list[tuple[Any, ...]]  # per tensor: groups its moments are merged over
    expert: list[bool] = field(default_factory=list)  # per tensor: named by a local expert index


class TensorStatsMonitor(VitalsCallback):
    """Per-tensor count, mean, central moments M2..M4, min, max and non-finite count.

    The monitor records the shape of the numbers flowing through a model, tensor by tensor, so
    that one can later ask "what was the kurtosis of the MLP gradients of layers 10 to 20
    between steps 1000 and 2000" (``trainvitals query``, :func:`trainvitals.report.query`).
    Moments are central and merge exactly (:mod:`trainvitals.stats.moments`), so any group of
    tensors, micro-batches or ranks combines without the cancellation of raw power sums.

    What happens when:

    * ``micro_batch_start`` of an activation logging step: forward hooks are installed on the
      sites (the first input and the output of every ``nn.Linear``, ``nn.Embedding``, MoE
      router and fused experts module, by default). A forward hook folds the site's tensors
      into per-row moments on the device (a tensor seen at several sites is reduced once) and,
      for ``dgrad``, puts a gradient hook on the same tensors. Integer inputs (token ids) are passed over for the
      first floating-point one. Forwards re-run inside backward (activation checkpointing) are
      not counted twice; under a reentrant checkpoint, whose first run has autograd off, the
      re-run is where the gradient hooks go. A ``no_grad`` forward of a site that trains with
      autograd on (generation, old log-probs, a teacher pass) is not counted, also before the
      site's first training forward; a reentrant checkpoint's first run is told from one by
      its autograd ``Function`` being recorded in the graph (:func:`_in_recorded_function`), also
      when the same module runs outside a checkpoint elsewhere in the step.
    * ``before_optimizer_step`` of a param/grad logging step: the moments of every trainable
      parameter and its gradient (after AMP unscaling, before clipping), in one fused call each.
      The parameters are those the optimizer updates: FSDP2's unsharded ones, left registered
      under ``set_reshard_after_backward(False)``, are not taken for the sharded ones (see
      :func:`~trainvitals.stats.norms.keep_sharded_parameters`).
    * ``step_end``: hooks are removed; the micro-batches of the step are merged exactly; the
      moments are combined over ranks (below); rank 0 appends one JSONL line per kind to
      ``<run_dir>/tensor_stats.jsonl`` and writes scalar summaries.
    * ``exception_raised``: hooks are removed, so a raising step leaves nothing behind; so
      they are when one of this callback's own hooks raised and the guard disabled it (one
      process), since its ``step_end`` and ``run_end`` then no longer run.

    Several optimizers stepped apart (a GAN stepping ``opt_g`` and ``opt_d`` in one batch:
    Lightning's manual optimization, with or without ``toggle_optimizer``, or the driver with
    both attached): the step is the batch, under Lightning keyed by ``trainer.global_step`` at
    its start (which counts every ``optimizer.step()``: 0, 2, 4, ... with two optimizers, so
    the intervals count those steps too), in the driver by the batch count. Each optimizer's
    parameters are measured right before its own ``step()`` (its
    gradients as it uses them, its weights before its update; trainable parameters in no
    optimizer with the batch's first ``step()``), each parameter once per step, and the step's
    ``param`` and ``grad`` records hold every parameter once. With one optimizer, or when every
    gradient is shown at once (the driver's unscaling or clipping of every optimizer's
    parameters before any steps), every parameter is measured at once, as above.

    Hooks exist only during an activation logging step (a ``torch.compile``'d model keeps its
    forward hooks from run start to run end, off between logging steps: see
    :meth:`_register_site_hooks`); other steps run no code of this class beyond two integer
    comparisons (and, for a compiled model, a flag check per site call, whose hooks also split
    the compiled graph at every site on every step: measured 24 graph pieces for 1 on a
    6-block model), and nothing leaves the device on them. The hooks keep
    references and reduce 8 tensors at a time (warm caches), and what waits right before each
    optimizer step (which changes parameters in place: a parameter fed to a site, such as
    learned latent queries); a tensor changed in place before its batch leaves its site out of
    that one step, with a warning, and that site is reduced inside its hook from then on (see
    ``docs/tensor_stats.md``). Under ``torch.compile`` the hooks run eagerly (excluded from the
    graph), so this holds from a compiled model's first step; sites inside a module compiled
    with ``fullgraph=True``, where Dynamo refuses that graph break, get no hook and are left out
    with a warning (see :class:`trainvitals._hooks.FullgraphRegions`). A model compiled and run
    before the monitor attached never calls its hooks (empty activation and dgrad records):
    the first such logging step warns once (see :meth:`_warn_no_site_ran`). A module called
    several times in a step (a block applied in a loop) merges every call into its one site, as
    micro-batches are. A failure inside the hooks (e.g. out of memory) never reaches the
    model's forward or backward: that step's activations and dgrads are left out, on every
    rank, with a warning.

    Distributed: a ``DTensor`` parameter or gradient (FSDP2, tensor parallel) is merged over the
    groups of its ``Shard`` mesh dims only; ``Replicate`` dims and plain tensors (DDP replicas)
    are not merged, so no element counts twice (a ``Partial`` gradient is first summed
    elementwise over its partial groups). FSDP1 and DeepSpeed keep parameters and gradients
    as flat plain-tensor shards, which would pass for whole replicated tensors: under them the
    ``param`` and ``grad`` kinds are left out, with one warning naming FSDP2 as the fix
    (activations and dgrads are kept; see :meth:`_refuse_flat_shards`).
    Activations and dgrads are merged over
    ``groups.dp_cp`` (each data/context-parallel rank sees different tokens); a tensor-parallel
    site is observed while it is still a ``DTensor`` (a prepended forward hook runs before the
    parallel style's own) and is also merged over its ``Shard`` dims, a ``Partial`` output is
    taken after the style reduced it, and a ``Partial`` dgrad (the gradient of the replicated
    input of a column-parallel layer) is summed elementwise over its group in the gradient hook
    (an extra collective, logging steps only). A plain tensor handed out by ``to_local()``
    (``RowwiseParallel(output_layouts=Shard(1))`` under sequence parallelism: each rank's part
    of the sequence) is merged over the ``Shard`` dims of its ``DTensor`` (see
    :func:`_local_layout`). Every distinct piece of data counts once, also when a
    tensor-parallel mesh dim lies inside ``dp_cp`` (Megatron-style sequence parallelism, whose
    dim is named ``sp``): a ``Shard`` group inside ``dp_cp`` (``edp`` for expert sites) is left
    to the ``dp_cp`` merge, and over a group inside it where the site's tensor is a replica (a
    ``Replicate`` dim of the ``DTensor`` or of the one ``to_local()`` came from, a ``Partial``
    dgrad once summed) only the lowest rank's copy counts (see :func:`_count_once`; no extra
    collective). Other plain activation tensors are taken to be replicated over tensor-parallel
    ranks outside ``dp_cp`` and different on the ranks of ``dp_cp`` (not so the partial sums a
    fused experts module returns when the sum is done after it: such a module is no default
    site when its weights are sharded over a tensor-parallel mesh dim, see ``module_types``). Moments need a
    merge, not a sum: each group gets one ``all_gather`` of all per-rank moments that need it,
    merged on every rank (one collective per distinct group per logging step; a two-collective
    shared-shift scheme would need a second round trip for the same result). Min and max ride
    in the same gather.

    Expert parallelism: names matching ``expert_pattern`` (a regex whose one group captures the
    local expert index, default ``experts.<i>.``) get the global expert index
    ``ep_rank * num_local_experts + i`` when ``groups.ep`` has more than one rank, and rank 0
    gathers every expert's moments over ``groups.ep`` so the file holds all experts. Expert
    activations and dgrads are then merged over ``groups.edp`` instead of ``dp_cp``: an expert
    receives the tokens of its EP group's ranks only, and the ranks holding the same experts
    (expert data parallel, set by :meth:`ProcessGroups.from_device_mesh` for a mesh with an
    ``ep`` dim) see the other token streams. With ``dp_cp`` larger than ``ep`` and no ``edp``
    (a hand-built ``ProcessGroups``) the monitor warns once that expert sites cover only this
    EP group's tokens (pass ``edp=``). Under pipeline parallelism every stage's moments are
    gathered to rank 0 over ``groups.pp`` (one object gather).

    Non-finite elements are counted in ``nonfinite`` and excluded from all other moments.
    ``dgrad`` values are the gradients autograd computes, so they include a loss scale (AMP
    ``GradScaler``) and any ``1/accumulation`` factor the loop applies to the loss: kurtosis
    and skewness do not depend on it, scale-dependent statistics do. The dgrad of
    ``<module>/input0`` is the gradient of the loss with respect to the tensor that entered the
    module, summed over all its consumers (q/k/v projections sharing one input see the same
    value); it is observed with tensor hooks, which never alter the autograd graph (full
    backward hooks break in-place ops such as ``ReLU(inplace=True)`` after a ``Linear``; a
    ``Linear`` output that is a view, changed in place later, is hooked through its base, see
    :func:`_grad_target`). A forward that gets several backward passes (a loss per head, each
    ``backward(retain_graph=True)``; a gradient penalty's ``torch.autograd.grad`` before
    ``backward``) gives a site on several passes' paths one piece of its gradient per pass,
    never the gradient of the total loss: such a site's dgrad is left out of that step on every
    rank, with one warning per run (see :meth:`_several_backward_passes`).

    Args:
        kinds: which of ``"param"``, ``"grad"``, ``"activation"``, ``"dgrad"`` to record (a
            list of them, or one as a string).
        log_every_n_steps: interval of ``param``/``grad`` in optimizer steps (default: the run's).
        activation_every_n_steps: interval of ``activation``/``dgrad`` (default: the same).
        module_types: module classes (one, or a sequence) whose inputs/outputs are sites
            (default ``nn.Linear``, ``nn.Embedding``, MoE routers:
            :class:`trainvitals.moe.TopKRouter` and any class whose name ends in ``Router``,
            and fused experts modules: any class whose name ends in ``Experts`` that has
            parameters and holds no ``nn.Linear``, ``nn.Embedding`` or router, such as
            transformers' ``MixtralExperts`` or ``Qwen3MoeExperts`` with their 3-d
            ``gate_up_proj [E, 2F, H]``; their ``input0`` is the hidden states entering the
            experts, ``output0`` their combined output, see :func:`_is_fused_experts`; not
            one whose weights are DTensors sharded over a tensor-parallel mesh dim, where
            ``forward`` may return one rank's partial sums: left out with a warning, see
            :func:`_tensor_parallel_weights`). Classes given replace the whole default set
            (routers and fused experts included); a class named so is a site whatever its
            layout (transformers' ``moe_tp_experts`` sums inside ``forward``: name its class).
        include: globs (``fnmatch``) over tensor names (``layers.0.mlp.fc1.weight``,
            ``layers.0.mlp.fc1/input0``); only matching tensors are recorded. Default: all.
        exclude: globs of tensor names to leave out (e.g. ``["*lm_head/*"]`` for the logits; the
            leading ``*`` also matches ``model.lm_head/output0`` under a LightningModule).
            A glob of ``include`` or ``exclude`` that matches no name is warned about once, at
            run start (rank 0).
        layer_pattern: regex with one capture group that captures a layer number (e.g.
            ``r"layers\\.(\\d+)\\."``); when set, per-layer summaries merge the tensors of each
            layer number, keyed and ordered by the number. Names it matches whose capture is
            no number (``r"^(encoder|decoder)"``) are in no layer: warned once.
        expert_pattern: regex with one capture group for the local expert index.
        kernel: ``"auto"``, ``"compile"`` or ``"eager"`` (see
            :func:`trainvitals.stats.moments.fused_moments`).
        filename: JSONL file name inside the run folder. One file per monitor: a second
            monitor of the same run given the same file raises a ValueError at run start (a
            configuration error, raised to the caller on every rank; give it another
            ``filename``).
        summaries: write the scalar summaries below through the writer.
        writer: where summaries go (default: the run's writer).

    Example:
        >>> import lightning
        >>> from trainvitals.callbacks import TensorStatsMonitor
        >>> monitor = TensorStatsMonitor(activation_every_n_steps=100, exclude=["*lm_head/*"])
        >>> trainer = lightning.pytorch.Trainer(callbacks=[monitor], log_every_n_steps=10)
        >>> # later: trainvitals query RUN_DIR --kind grad --group 'layers.*.mlp.*' --stat kurtosis

    Keys written through the writer (on logging steps of each kind; ``<kind>`` is ``param``,
    ``grad``, ``activation`` or ``dgrad``):

    ==========================================  ==========================================  =====
    key                                         meaning                                     unit
    ==========================================  ==========================================  =====
    ``tensor_stats/<kind>/rms_mean``            mean over tensors of each tensor's RMS      value
    ``tensor_stats/<kind>/rms_max``             largest per-tensor RMS                      value
    ``tensor_stats/<kind>/abs_max``             largest absolute finite element             value
    ``tensor_stats/<kind>/kurtosis_mean``       mean per-tensor Pearson kurtosis (3 =       1
                                                normal; tensors of zero variance skipped)
    ``tensor_stats/<kind>/kurtosis_max``        largest per-tensor Pearson kurtosis         1
    ``tensor_stats/<kind>/nonfinite``           NaN/Inf elements over all tensors           count
    ``tensor_stats/<kind>/layer_<i>/rms``       RMS of all tensors of layer ``i`` merged    value
                                                (``layer_pattern`` only)
    ``tensor_stats/<kind>/layer_<i>/kurtosis``  kurtosis of layer ``i``'s tensors merged    1
    ==========================================  ==========================================  =====

    "value" is the unit of the tensor itself (parameter units, gradient units, ...). The full
    per-tensor moments go to ``tensor_stats.jsonl`` (format in ``docs/tensor_stats.md``).
    """

    def __init__(
        self,
        *,
        kinds: Sequence[str] = KINDS,
        log_every_n_steps: int | None = None,
        activation_every_n_steps: int | None = None,
        module_types: type | Sequence[type] | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        layer_pattern: str | None = None,
        expert_pattern: str = r"(?:^|\.)experts\.(\d+)(?:\.|/|$)",
        kernel: str = "auto",
        filename: str = "tensor_stats.jsonl",
        summaries: bool = True,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        if isinstance(kinds, str):
            kinds = (kinds,)  # one kind, as MemoryMonitor's reduce and NormMonitor take one
        if not all(isinstance(k, str) and k in KINDS for k in kinds) or not kinds:
            raise ValueError(
                f"kinds must be one of {KINDS} or a non-empty list of them, got {kinds!r}"
            )
        self.kinds = tuple(k for k in KINDS if k in kinds)
        if activation_every_n_steps is not None and (
            isinstance(activation_every_n_steps, bool)
            or not isinstance(activation_every_n_steps, int)
            or activation_every_n_steps <= 0
        ):
            raise ValueError(
                "activation_every_n_steps must be a positive int or None, "
                f"got {activation_every_n_steps!r}"
            )
        self.activation_every_n_steps = activation_every_n_steps
        if isinstance(module_types, type):
            module_types = (module_types,)
        if module_types is not None and not all(
            isinstance(t, type) and issubclass(t, nn.Module) for t in module_types
        ):
            raise TypeError(
                "module_types must be an nn.Module class or a sequence of them, "
                f"got {module_types!r}"
            )
        self.module_types = tuple(module_types) if module_types is not None else None
        for name, globs in (("include", include), ("exclude", exclude)):
            if globs is not None and (
                isinstance(globs, str) or not all(isinstance(g, str) for g in globs)
            ):
                raise TypeError(f"{name} must be a list of glob strings, got {globs!r}")
        self.include = list(include) if include is not None else None
        self.exclude = list(exclude or [])
        self.layer_pattern = compile_one_group("layer_pattern", layer_pattern)
        self.expert_pattern = compile_one_group("expert_pattern", expert_pattern)
        if kernel not in ("auto", "compile", "eager"):
            raise ValueError(f"kernel must be 'auto', 'compile' or 'eager', got {kernel!r}")
        self.kernel = kernel
        if not isinstance(filename, str) or not filename or os.sep in filename:
            raise ValueError(f"filename must be a plain file name, got {filename!r}")
        self.filename = filename
        self.summaries = bool(summaries)
        # run state
        self._path: Path | None = None
        self._claimed: Path | None = None  # the resolved file claimed in _CLAIMS (rank 0)
        self._cut_line = False  # a failed append may have left part of a line in the file
        # The highest step the file may hold a line of (written by this instance, or left by
        # run_start's cleanup). Deliberately not in state_dict: after a rollback in the same
        # process (load_state_dict of an earlier checkpoint) it still says how far the
        # abandoned timeline wrote, see _drop_abandoned_steps.
        self._file_high_step = -1
        self._sites: list[str] = []  # "<module>/input0", "<module>/output0" in model order
        self._site_expert: list[bool] = []
        self._site_index: dict[str, int] = {}
        self._modules: list[tuple[str, nn.Module]] = []
        # id of a site's module -> the module its hooks go on (a torch.compile wrapper)
        self._targets: dict[int, nn.Module] = {}
        self._handles: list[Any] = []  # this step's hooks (gradient hooks; forward hooks too)
        # A compiled model's forward hooks stay from run start to run end (see _install);
        # ``_collecting`` tells them whether this step is an activation logging step.
        self._site_handles: list[Any] = []
        self._persistent = False
        self._collecting = False
        self._acc: dict[str, MomentAccumulator] = {}
        self._pending: dict[str, _Kind] = {}
        self._ep_info: tuple[int, dict[str, int]] | None = None
        # (kind, site) -> shard groups of the DTensor seen there (tensor parallel), fixed at
        # its first observation so every step and rank merges the same way
        self._site_groups: dict[tuple[str, int], tuple[Any, ...]] = {}
        # (kind, site) -> groups over which the tensor seen there is a replica (its Replicate
        # mesh dims; a Partial dgrad's groups once summed), fixed alike: see _count_once
        self._site_replicas: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._hook_step: int | None = None
        self._hook_ctx: RunContext | None = None
        self._names: dict[str, tuple[str, bool, bool]] = {}  # see _name_info
        # the trainable parameters (deduplicated, canonical names), kept while the model's
        # parameter objects stay the same: (their ids and requires_grad, the list)
        self._params: tuple[tuple[tuple[int, bool], ...], list[tuple[str, Any]]] | None = None
        # canonical name -> the parameter measured under it (found at run start, then at each
        # rebuild of _params): FSDP2 registers other tensors under the same names, see
        # trainvitals.stats.norms.keep_sharded_parameters
        self._found: dict[str, Any] = {}
        # activations/dgrads waiting for their batched reduction: (kind, site, local, key,
        # local's version when seen); sites whose tensor was changed in place before its
        # reduction are reduced in the hook from then on
        self._deferred: list[tuple[str, int, torch.Tensor, torch.Tensor, int, str]] = []
        self._deferred_elements = 0
        self._immediate: set[tuple[str, int]] = set()
        self._dropped: set[tuple[str, int]] = set()  # left out of the current step
        # sites whose dgrad this step got from several backward passes (left out)
        self._refired: set[int] = set()
        self._hooks_failed = False  # hook work raised this step: no more moments this step
        self._fired = False  # a site's forward hook ran in this activation logging step
        # per site: tensors seen with autograd off that a reentrant activation checkpoint will
        # re-run in the backward pass, where their gradient hook goes; and the sites seen with
        # autograd on (or a tensor needing a gradient) outside the backward pass, which no
        # reentrant checkpoint hides (their no_grad forwards, e.g. generation, re-run nothing)
        self._held_back: dict[int, int] = {}
        # per site: the same, for first runs known to be inside a reentrant checkpoint
        # (_in_recorded_function), which a call of the site with autograd on (the same
        # module used outside the checkpoint too) does not cancel
        self._ckpt_held: dict[int, int] = {}
        self._grad_sites: set[int] = set()
        # sites whose gradient hook went on a reentrant checkpoint's re-run this step
        self._rerun_hooked: set[int] = set()
        # Several optimizers stepped apart: the step whose param/grad parts are being
        # collected, and the ids of the parameters measured in it
        self._parts_step: int | None = None
        self._measured: set[int] = set()
        # The run's parameters are flat plain-tensor shards (FSDP1, DeepSpeed): no param/grad
        # lines (see _refuse_flat_shards); the layout's name, set at run start
        self._flat: str | None = None

    # ------------------------------------------------------------------ intervals

    def _param_step(self, ctx: RunContext) -> bool:
        if self._flat is not None:
            return False
        return any(k in self.kinds for k in ("param", "grad")) and self.should_log(ctx)

    def _act_step(self, ctx: RunContext) -> bool:
        if not any(k in self.kinds for k in ("activation", "dgrad")):
            return False
        # (the same rule as param/grad: a batch of several steps logs when they pass a multiple)
        return self.should_log(ctx, every=self.activation_every_n_steps or self.interval(ctx))

    def collective_key(self, hook: str, ctx: RunContext) -> Hashable:
        # two intervals: which kinds are due (and, at step end, collected) decide the
        # collectives of a hook; with several optimizers stepped apart, also which optimizer
        # steps and whether it is the step's first (which parameters a call measures)
        key = (hook, self._param_step(ctx), self._collecting, tuple(self._pending))
        if hook == "before_optimizer_step" and ctx.stepping_apart:
            return (*key, ctx.stepping_index, self._parts_step != ctx.step)
        return key

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        if ctx.model is None:
            raise ValueError("TensorStatsMonitor needs the model (ctx.model is None)")
        model = unwrap_model(ctx.model)
        self._refuse_flat_shards(model, ctx)
        types = self.module_types or _default_site_types()
        self._modules, left_out = [], []
        members: dict[int, frozenset[int]] = {}
        for n, m in model.named_modules():
            if not n:
                continue
            if isinstance(m, types) or (self.module_types is None and _is_router(m)):
                self._modules.append((canonical_name(n), m))
            elif self.module_types is None and _is_fused_experts(m, types):
                # (the model's layout alone decides: the same on every rank, so every rank
                # has the same sites and issues the same collectives)
                if _tensor_parallel_weights(m, ctx.groups, members):
                    left_out.append(canonical_name(n))
                else:
                    self._modules.append((canonical_name(n), m))
        # Sites inside code compiled with fullgraph=True get no hook (Dynamo refuses the graph
        # break of one); a compiled region's root is hooked on its wrapper, outside the graph
        regions = FullgraphRegions(ctx.model)
        self._targets = {}
        compiled_out, kept = [], []
        for name, m in self._modules:
            target = regions.target(m)
            if target is None:
                compiled_out.append(name)
                continue
            kept.append((name, m))
            if target is not m:
                self._targets[id(m)] = target
        self._modules = kept
        self._ep_info = self._expert_offsets(ctx, [n for n, _ in model.named_parameters()])
        self._names = {}
        self._params = None
        self._found = dict(canonical_named_parameters(model))
        self._parts_step, self._measured = None, set()
        # What was learned about the sites, kept by their index in the list rebuilt below, is
        # this run's only: an instance reused for a new run of another model read the earlier
        # model's as this one's (a site index that trained with autograd on there made this
        # model's frozen site under no_grad look like a generation pass: left out, silently)
        self._remove_hooks()
        self._remove_site_hooks()
        self._persistent = _is_compiled(ctx.model)
        self._grad_sites, self._immediate, self._held_back = set(), set(), {}
        self._ckpt_held, self._rerun_hooked = {}, set()
        self._site_groups, self._site_replicas = {}, {}
        self._sites, self._site_expert = [], []
        every_site = [
            self._global_name(f"{name}/{suffix}")
            for name, _ in self._modules
            for suffix in _SITE_SUFFIXES
        ]
        for site in every_site:
            if self._wanted(site):
                self._sites.append(site)
                self._site_expert.append(self._is_expert(site))
        self._site_index = {s: i for i, s in enumerate(self._sites)}
        self._warn_missing_edp(ctx)
        if self._persistent and any(k in self.kinds for k in ("activation", "dgrad")):
            self._register_site_hooks(self._site_handles)
        if ctx.global_rank == 0:
            params = [self._global_name(canonical_name(n)) for n, _ in model.named_parameters()]
            # the left-out experts' names are the model's still: a glob naming them matches
            dropped = [
                f"{name}/{suffix}" for name in left_out + compiled_out for suffix in _SITE_SUFFIXES
            ]
            self._warn_unmatched_globs(params + every_site + dropped)
            self._warn_tensor_parallel_experts(left_out)
            self._warn_fullgraph_sites(compiled_out)
        self._path = Path(ctx.run_dir) / self.filename
        if ctx.trainer is not None and getattr(ctx.trainer, "fast_dev_run", False):
            # Lightning's debug run: its loggers and checkpoints are off; so is this file (it
            # would land in default_root_dir, the working directory by default)
            self._path = None
        elif ctx.global_rank == 0:
            self._claim_file(self._path, ctx)  # before _prepare_jsonl moves another's file aside
            _prepare_jsonl(self._path, first_step=ctx.step)
        self._file_high_step = ctx.step - 1  # the file holds steps below this run's first only

    def _refuse_flat_shards(self, model: nn.Module, ctx: RunContext) -> None:
        """Leave the param and grad kinds out of a run whose parameters are flat plain-tensor
        shards (FSDP1, DeepSpeed: :func:`~trainvitals.callbacks.base.flat_sharding`), warned
        once (rank 0). Their tensors look like whole replicated ones: each line held one
        rank's shard of a parameter (measured under FSDP1 on 2 ranks: ``2.weight`` 14 of its
        30 elements, RMS 0.258 for 0.248; another's 0 elements) or of a ``_flat_param``
        concatenating several. Activations and dgrads are per-rank data that parameter
        sharding does not touch: kept. The same layout on every rank, so every rank skips the
        same collectives."""
        self._flat = None
        if not any(k in self.kinds for k in ("param", "grad")):
            return
        self._flat = flat_sharding(model, ctx)
        if self._flat is not None and ctx.global_rank == 0:
            self.warn_once(
                "flat-sharding",
                f"{self._flat}: the param and grad lines are left out, their tensors being one "
                "rank's flat shard and not whole parameters (activation and dgrad lines are "
                "kept). Shard with FSDP2 for them: torch.distributed.fsdp.fully_shard, "
                "Lightning's ModelParallelStrategy, or Accelerate's FSDP plugin with "
                "fsdp_version=2",
            )

    def _claim_file(self, path: Path, ctx: RunContext) -> None:
        """Claim ``path`` for this instance until its run ends; a ValueError (raised out of
        ``run_start``: a configuration error, which the callback guard raises to the caller)
        when another TensorStatsMonitor of the same run (``ctx``: one trainer's, one driver's)
        claimed the same file. Two monitors appending to one file would write each (step,
        kind) twice, the second's run start would move the first's file aside (step 0) or cut
        it (a resume), and readers would keep only one of the two lines of a step. A claim of
        another run (one that never ended: a notebook cell that raised before ``close()``) is
        taken over, not an error. Rank 0 only, the one rank that writes."""
        resolved = path.resolve()
        with _CLAIMS_LOCK:
            owner = _CLAIMS.get(resolved)
            holder = owner() if owner is not None else None
            if holder is not None and holder is not self and holder._ctx is ctx:
                raise ValueError(
                    f"TensorStatsMonitor: {path} is already written by another "
                    "TensorStatsMonitor of this run; two monitors would append the same steps "
                    "to one file. Give one of them another filename= (e.g. "
                    "filename='tensor_stats_acts.jsonl') or use one monitor"
                )
            self._unclaim_file()
            _CLAIMS[resolved] = weakref.ref(self)
            self._claimed = resolved

    def _unclaim_file(self) -> None:
        """Give up this instance's claim (its run ended, raised, or it was disabled)."""
        claimed = self._claimed
        if claimed is None:
            return
        with _CLAIMS_LOCK:
            owner = _CLAIMS.get(claimed)
            if owner is not None and owner() in (self, None):
                del _CLAIMS[claimed]
            self._claimed = None

    def _drop_abandoned_steps(self, ctx: RunContext) -> None:
        """After a rollback in the same process (the driver's ``load_state_dict`` of an earlier
        checkpoint, ``accelerator.load_state`` after a loss spike) the run is back at a step the
        file already holds: drop the abandoned timeline's lines of that step and later ones, as
        the driver's writer does with ``metrics.jsonl`` (``FanoutWriter.resume_at``), so that a
        step never appears twice per kind and no abandoned step is read back as true. Rank 0
        only; costs one comparison when there was no rollback."""
        if ctx.step > self._file_high_step or ctx.global_rank != 0 or self._path is None:
            return
        self._file_high_step = ctx.step - 1
        if not self._path.is_file():
            return  # deleted, or a pipe: nothing that can be cut back
        try:
            dropped = drop_steps_from(self._path, ctx.step, line_step=_line_step)
        except OSError as exc:
            self.tolerate_failure(
                "rollback",
                f"dropping the abandoned steps >= {ctx.step} from {self._path}",
                exc,
                "the file may hold steps of the abandoned timeline next to the replayed ones "
                "(readers let the later line win)",
            )
            return
        self._cut_line = False  # drop_steps_from removed a cut last line and ends on a newline
        if dropped:
            warnings.warn(
                f"TensorStatsMonitor: {self._path}: the run went back to step {ctx.step} (a "
                f"rollback to an earlier checkpoint); dropped {dropped} line(s) of steps >= "
                f"{ctx.step} written by the abandoned timeline",
                RuntimeWarning,
                stacklevel=2,
            )

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        self._drop_abandoned_steps(ctx)
        if self._collecting and self._hook_step != ctx.step:
            # a step that never ended (an epoch cut mid-accumulation): drop its partial data
            self._remove_hooks()
        if not self._collecting and self._act_step(ctx):
            self._hook_step = ctx.step
            self._install(ctx)

    def before_optimizer_step(self, ctx: RunContext) -> None:
        if self._param_step(ctx):
            self._measure_parameters(ctx)
        if self._deferred:
            # The optimizer is about to change the parameters in place: a parameter that is a
            # site's input (learned latent queries fed to a Linear) would look changed since
            # its hook at step end and leave its site out of the step. Reduce what waits now.
            try:
                self._reduce_deferred()
            except Exception as exc:
                self._hook_failure(exc)

    def _measure_parameters(self, ctx: RunContext) -> None:
        """The moments of the parameters (and gradients) this optimizer step measures."""
        named = self._trainable_parameters(ctx)
        several = ctx.stepping_apart
        if several:
            named = self._stepped_part(ctx, named)
        wanted: dict[str, list[tuple[str, torch.Tensor | None, torch.Tensor]]] = {}
        if "param" in self.kinds:
            wanted["param"] = [(n, p, p) for n, p in named]
        if "grad" in self.kinds:
            # Also the parameters without a gradient on this rank (an expert no token reached,
            # skipped by the MoE loop): every rank must send the same rows through the step's
            # collectives (expert gather, shard merges); such a row is "not measured" (NaN)
            # and left out of the file, as a parameter without a gradient always was.
            wanted["grad"] = [(n, p.grad, p) for n, p in named]
        measured = self._local_kinds(wanted)
        if not several:
            # One optimizer, or every gradient shown at once: every parameter at once.
            self._pending.update(measured)
            return
        # Several optimizers stepped apart: this part joins the step's earlier ones (each
        # parameter is in one part only, so their moments concatenate).
        for kind, part in measured.items():
            earlier = self._pending.get(kind)
            self._pending[kind] = part if earlier is None else _concat_kinds(earlier, part)

    def step_end(self, ctx: RunContext) -> None:
        if self._collecting:
            try:
                self._reduce_deferred()
            except Exception as exc:
                self._hook_failure(exc)
            finally:
                self._remove_hooks()
            for kind in ("activation", "dgrad"):
                if kind in self.kinds:
                    self._pending[kind] = self._merged_sites(ctx, kind)
            if not self._fired and self._sites and ctx.micro_batches_in_step > 0:
                self._warn_no_site_ran(ctx)
            if self._refired:
                self._warn_several_backward_passes(ctx)
        self._parts_step, self._measured = None, set()
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._emit(ctx, pending)

    def _warn_no_site_ran(self, ctx: RunContext) -> None:
        """An activation logging step ran micro-batches, yet no site's forward hook ran: its
        activation and dgrad records are empty. Almost always code compiled before the hooks
        existed: Dynamo does not guard on module hooks
        (``torch._dynamo.config.skip_nnmodule_hook_guards``), so it never calls hooks added
        later. Said once, with the cause and the fix (one host flag; no device work)."""
        head = (
            f"no activation/dgrad site hook ran in logging step {ctx.step} "
            f"({ctx.micro_batches_in_step} micro-batch(es)): its activation and dgrad records "
            "are empty"
        )
        if self._persistent:
            cause = (
                "the compiled model was run before this monitor added its hooks (at run "
                "start), and code compiled then never calls hooks added later (torch.compile "
                "does not guard on module hooks: torch._dynamo.config."
                "skip_nnmodule_hook_guards). Attach the monitor before the compiled model's "
                "first forward, or call torch.compiler.reset() after attaching (the next "
                "forward recompiles with the hooks)"
            )
        else:
            cause = (
                "none of the site modules ran a forward hook. The model given to the monitor "
                "may not be the one trained, or the forward runs in code compiled before the "
                "hooks were added (torch.compile of a function calling the model), which never "
                "calls them (torch._dynamo.config.skip_nnmodule_hook_guards): compile the "
                "model itself (torch.compile(model)) and attach the monitor before its first "
                "forward"
            )
        self.warn_once("no-site-ran", f"{head}; {cause}")

    def _warn_several_backward_passes(self, ctx: RunContext) -> None:
        """Say once per run which sites' dgrads were left out for several backward passes
        through one forward (see :meth:`_several_backward_passes`)."""
        names = [self._sites[s] for s in sorted(self._refired)]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        self.warn_once(
            "several-backward-passes",
            f"the dgrad at {shown} got several backward passes through one forward in logging "
            f"step {ctx.step} (backward(retain_graph=True) per loss, or torch.autograd.grad "
            "before backward, as in a gradient penalty): each pass gives a piece of the "
            "gradient, and the gradient of the total loss is not available per pass. Such "
            "sites' dgrads are left out of their steps (activation, param and grad are kept; "
            "warned once). Several losses summed into one backward() are recorded",
        )

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._drop_abandoned_steps(ctx)  # a rollback, then a crash before the next batch
        self._discard_step()
        self._unclaim_file()

    def release(self, ctx: RunContext) -> None:
        # Disabled by the guard: step_end and run_end no longer run, so the forward and
        # gradient hooks of this step would stay on the model, measuring and holding tensors.
        self._discard_step()
        self._unclaim_file()  # it writes no more in this run

    def run_end(self, ctx: RunContext) -> None:
        self._drop_abandoned_steps(ctx)  # a rollback, then the end before the next batch
        self._discard_step()
        self._unclaim_file()

    def _discard_step(self) -> None:
        """Remove the step's hooks and drop everything it collected so far."""
        self._remove_hooks()
        self._remove_site_hooks()
        self._pending, self._acc = {}, {}
        self._parts_step, self._measured = None, set()

    # No state_dict: a resumed run needs only its step (run start drops the file's lines from
    # it on). Checkpoints of earlier versions hold {"version", "logged_steps"}, which nothing
    # read; the base class's load_state_dict ignores them.

    # ------------------------------------------------------------------ param / grad moments

    def _name_info(self, name: str) -> tuple[str, bool, bool]:
        """(global name, wanted, expert) of a parameter name; cached: a logging step asks
        for every parameter twice (values and gradients) and the answers never change."""
        info = self._names.get(name)
        if info is None:
            global_name = self._global_name(name)
            info = (global_name, self._wanted(global_name), self._is_expert(global_name))
            self._names[name] = info
        return info

    def _trainable_parameters(self, ctx: RunContext) -> list[tuple[str, Any]]:
        """(canonical name, parameter) of the trainable parameters, each tensor once; rebuilt
        only when the model's parameter objects or their ``requires_grad`` change (a quarter
        of the cost: the names and the memory-aliasing check are not redone every step)."""
        raw = list(unwrap_model(ctx.model).named_parameters(remove_duplicate=False))
        # (a parameter with no values: left out; warned if on the meta device, not if lazy)
        key = tuple((id(p), p.requires_grad and not has_no_values(p)) for _, p in raw)
        if self._params is None or self._params[0] != key:
            found = keep_sharded_parameters(
                [(canonical_name(n), p) for n, p in raw],
                self._found,
                optimized_ids(ctx.optimizers),
            )
            self._found = dict(found)
            named = dedupe_named_tensors(found)
            self.warn_meta_parameters(
                [n for n, p in named if p.requires_grad and p.is_meta],
                "the param and grad lines",
            )
            self._params = (
                key,
                [(n, p) for n, p in named if p.requires_grad and not has_no_values(p)],
            )
        return self._params[1]

    def _stepped_part(self, ctx: RunContext, named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The parameters measured at this ``optimizer.step()``: the stepping optimizer's
        (its gradients as it uses them, its weights before its update), and at the step's first
        ``step()`` also those of no optimizer; each parameter once per step (an optimizer
        stepped twice in a batch is measured at its first ``step()``)."""
        first = self._parts_step != ctx.step
        if first:
            # (param/grad parts of a step that never ended are dropped)
            for kind in ("param", "grad"):
                self._pending.pop(kind, None)
            self._parts_step, self._measured = ctx.step, set()
        _, here = ctx.stepped_parameters((p for _, p in named), first)
        part = [(n, p) for n, p in named if id(p) in here and id(p) not in self._measured]
        self._measured.update(id(p) for _, p in part)
        return part

    def _local_kinds(
        self, wanted: dict[str, list[tuple[str, torch.Tensor | None, torch.Tensor]]]
    ) -> dict[str, _Kind]:
        """Local moments of each kind's (name, tensor, parameter) triples; a tensor that is
        ``None`` (no gradient) gets a NaN row ("not measured"), its name and merge groups taken
        from the parameter so that they are the same on every rank. All kinds go through one
        :func:`partial_moments` call per device (its fixed cost, the batched small tensors and
        the merge, is paid once for parameters and gradients together)."""
        kinds: dict[str, tuple[list[str], int, list[bool], list[tuple]]] = {}
        everything: list[torch.Tensor] = []
        present: list[int] = []  # the row of each tensor of ``everything``, over all kinds
        rows = 0
        for kind, named in wanted.items():
            infos = [(self._name_info(n), t, like) for n, t, like in named]
            infos = [x for x in infos if x[0][1] and x[2].is_floating_point()]
            tensors = [t for _, t, _ in infos if t is not None]
            locals_ = [local_tensor(t).detach() for t in tensors]
            _sum_partials(tensors, locals_)
            kinds[kind] = (
                [info[0] for info, _, _ in infos],
                len(infos),
                [info[2] for info, _, _ in infos],
                [
                    shard_groups(like if t is None else t, include_partial=False)
                    for _, t, like in infos
                ],
            )
            present += [rows + i for i, (_, t, _) in enumerate(infos) if t is not None]
            everything += locals_
            rows += len(infos)
        # A sparse gradient (nn.Embedding(sparse=True)) has no dense kernel: its moments are
        # those of its stored values merged with the implicit zeros (exact, no densifying).
        zeros: dict[int, int] = {}
        for i, t in enumerate(everything):
            if t.layout != torch.strided:
                values = stored_values(t)
                zeros[i] = t.numel() - values.numel()
                everything[i] = values
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(everything):
            by_device.setdefault(t.device, []).append(i)
        if everything:
            device = everything[0].device
        else:  # no gradient here: NaN rows on the parameters' device (that of the collectives)
            likes = [local_tensor(like) for named in wanted.values() for _, _, like in named]
            device = likes[0].device if likes else torch.device("cpu")
        moments = empty_moments(len(everything), device=device)
        # (indices from host lists: index_on, pinned and non-blocking; a pageable copy would
        # hold the host until the backward queued before it has run, before the optimizer step)
        try:
            for idx in by_device.values():
                parts, owner = partial_moments([everything[i] for i in idx], kernel=self.kernel)
                sub = combine_moments(parts, owner, len(idx)).to(device)
                if len(idx) == len(everything):  # one device (the usual case): no index
                    moments = sub
                else:
                    moments[index_on(idx, device)] = sub
            if zeros:
                at = index_on(list(zeros), device)
                zero_part = empty_moments(len(zeros))
                for j, count in enumerate(zeros.values()):
                    if count:  # k zeros: count k; mean, M2..M4, min and max all 0
                        zero_part[j, :7] = 0.0
                        zero_part[j, 0] = count
                zero_part = host_to_device(zero_part, device)
                moments[at] = combine_moments(torch.stack([moments[at], zero_part]), dim=0)
        except Exception as exc:
            # Rank-local (say, out of memory in the kernel): send NaN rows through the step's
            # collectives like any other, so every rank stays in step and the merge leaves
            # these tensors out everywhere (raising here would skip this rank's collectives).
            self.tolerate_failure(
                "kernel-failure",
                f"the moments of {'/'.join(wanted)}",
                exc,
                "they are missing from this logging step",
            )
            moments.fill_(math.nan)
        if len(present) < rows:
            measured = moments
            moments = torch.full((rows, len(FIELDS)), math.nan, dtype=torch.float64, device=device)
            moments[index_on(present, device)] = measured
        out: dict[str, _Kind] = {}
        start = 0
        for kind, (names, count, expert, groups) in kinds.items():
            end = start + count
            out[kind] = _Kind(names=names, moments=moments[start:end], groups=groups, expert=expert)
            start = end
        return out

    # ------------------------------------------------------------------ activation / dgrad sites

    def _install(self, ctx: RunContext) -> None:
        n = len(self._sites)
        self._acc = {
            k: MomentAccumulator(n, kernel=self.kernel) for k in ("activation", "dgrad", _UNSURE)
        }
        self._dropped, self._refired = set(), set()
        self._hooks_failed = False
        self._fired = False
        self._held_back, self._ckpt_held, self._rerun_hooked = {}, {}, set()
        self._hook_ctx = ctx
        self._collecting = True
        if not self._persistent:  # (a compiled model's are on since run_start)
            self._register_site_hooks(self._handles)

    def _register_site_hooks(self, handles: list[Any]) -> None:
        """The forward hooks of every site, their handles appended to ``handles``.

        A compiled model gets them at run start and keeps them to run end; ``_collecting`` (a
        host flag) turns them off outside activation logging steps. Dynamo does not guard on
        a module's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default):
        code compiled without them never calls hooks added later (a model compiled at a step
        that did not log got empty activation and dgrad records at every logging step,
        silently), and code compiled with them calls whatever the hook dicts hold. Installed
        before the first compiled forward and kept, they are the same objects at every step:
        no recompilation, and no site missed.
        """
        for name, module in self._modules:
            idx = [self._site_index.get(self._global_name(f"{name}/{s}")) for s in _SITE_SUFFIXES]
            if idx == [None, None]:
                continue
            # Two hooks: the first (prepended) sees a tensor-parallel module's output while it is
            # still a sharded DTensor, before the parallel style turns it into a local tensor;
            # the last sees everything else (plain tensors, and Partial outputs once reduced).
            # ``reduced``: per slot, what the first hook saw of a Partial output (its shape and
            # the groups it is sharded over if the style reduce-scatters it) for the last.
            taken = [False, False]
            reduced: list[tuple[tuple[int, ...], tuple[Any, ...]] | None] = [None, None]
            target = self._targets.get(id(module), module)  # (a compiled region's wrapper)
            for early in (True, False):
                hook = self._make_forward_hook(target, idx, taken, reduced, early, module)
                handles.append(target.register_forward_hook(hook, with_kwargs=True, prepend=early))

    def _make_forward_hook(
        self,
        owner: nn.Module,
        idx: list[int | None],
        taken: list[bool],
        reduced: list[tuple[tuple[int, ...], tuple[Any, ...]] | None],
        early: bool,
        site_module: nn.Module,
    ) -> Any:
        """The forward hook of ``site_module``, registered on ``owner`` (the module itself, or
        the ``torch.compile`` wrapper around it: see
        :class:`trainvitals._hooks.FullgraphRegions`)."""
        want_act = "activation" in self.kinds
        want_dgrad = "dgrad" in self.kinds

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # (a compiled model's hooks stay between logging steps; a copy of the model, a
            # deepcopy for EMA or a float64 reference, carries them too: not our site)
            if not self._collecting or module is not owner:
                return
            self._fired = True
            # a forward re-run inside backward (activation checkpointing): only for the
            # gradient hooks of a reentrant checkpoint's first run, which had autograd off
            rerun = torch._C._current_graph_task_id() != -1
            if rerun and not (
                want_dgrad and (self._held_back or self._ckpt_held or self._rerun_hooked)
            ):
                return
            if self._hook_ctx is not None and self._hook_ctx.in_validation:
                return
            grad_on = torch.is_grad_enabled()
            try:
                # Under inference_mode (generation, a frozen encoder) the tensors made here
                # (kept copies, the kernel's reused work buffers) would be inference tensors,
                # which no later step could update in place: make them outside it (this also
                # turns autograd on, hence grad_on read before).
                inference = torch.is_inference_mode_enabled()
                with torch.inference_mode(False) if inference else contextlib.nullcontext():
                    observe(site_module, args, kwargs, output, rerun, grad_on)
            except Exception as exc:  # never let telemetry break the user's forward
                self._hook_failure(exc)

        def observe(
            module: nn.Module, args: tuple, kwargs: dict, output: Any, rerun: bool, grad_on: bool
        ) -> None:
            checkpointed: bool | None = None  # (looked up once, for a no_grad call only)
            first_in = _first_float(args)
            if first_in is None and not args:
                first_in = _first_float(tuple(kwargs.values()))
            for slot, (site, x) in enumerate(
                zip(idx, (first_in, _first_float(output)), strict=True)
            ):
                if site is None or x is None:
                    continue
                if early:
                    if not _is_dtensor(x):
                        continue
                    if partial_groups(x):
                        # the style reduces it next (all-reduce, or reduce-scatter under
                        # sequence parallelism); the last hook takes the result
                        reduced[slot] = (tuple(x.shape), shard_groups(x))
                        continue
                    taken[slot] = True
                elif taken[slot]:
                    taken[slot] = False
                    continue
                elif partial_groups(x):
                    reduced[slot] = None
                    self.warn_once("partial", "skipped a Partial DTensor activation")
                    continue
                elif not _is_dtensor(x):
                    seen, reduced[slot] = reduced[slot], None
                    layout = _local_layout(x, seen)
                    if layout is None:
                        self.warn_once(
                            f"unknown-layout-{site}",
                            f"skipped the activation at {self._sites[site]}: a DTensor's local "
                            "part that is Partial, or whose layout (replicated or sharded) "
                            "neither autograd nor its shape tells",
                        )
                        continue
                    shards, replicas = layout
                    if shards or replicas:  # a shard (e.g. sequence parallel) or a replica
                        for kind in ("activation", "dgrad"):
                            self._site_groups.setdefault((kind, site), shards)
                            self._site_replicas.setdefault((kind, site), replicas)
                else:
                    reduced[slot] = None
                if rerun:  # the activation was measured in the first run
                    held = next(
                        (h for h in (self._ckpt_held, self._held_back) if h.get(site, 0) > 0),
                        None,
                    )
                    # (a non-reentrant checkpoint's recomputation is no such re-run: its
                    # tensors only feed the saved values of the first run's graph, which got
                    # its hooks then; taking a count there left the reentrant re-run out)
                    if held is not None and x.requires_grad and _in_function_backward():
                        held[site] -= 1
                        target = _grad_target(module, slot, x)
                        self._handles.append(target.register_hook(self._make_grad_hook(site)))
                        self._rerun_hooked.add(site)
                    elif site in self._rerun_hooked and x.requires_grad and _in_function_backward():
                        # one re-run more than the first runs counted: a second backward pass
                        # (retain_graph) re-ran the checkpoint, whose gradients would go
                        # unseen beside the first pass's (no second hook call tells it here)
                        self._several_backward_passes(site)
                    continue
                # The gradient hook first, and even after a failure: it may hold a collective
                # (Partial gradients) that every rank must reach.
                unsure = False
                if checkpointed is None and not grad_on and not x.requires_grad:
                    checkpointed = _in_recorded_function()
                if grad_on or x.requires_grad or checkpointed:
                    # (a reentrant checkpoint's first run is part of the training step also
                    # when the same module runs with autograd on elsewhere in it: a shared
                    # block checkpointed in some of its calls only, whose checkpointed calls
                    # were taken for no_grad passes and left out, activation and dgrad)
                    self._grad_sites.add(site)
                elif site in self._grad_sites:
                    # a no_grad forward of a site that trains with autograd on (generation, a
                    # teacher pass): not part of the training step, and re-run by nothing
                    continue
                else:
                    # not known yet (the run's first logging step: old log-probs or a teacher
                    # pass before the training forward, or a reentrant checkpoint's first run):
                    # kept apart, and counted at step end only if the site never ran with
                    # autograd on (see _merged_sites)
                    unsure = True
                if want_dgrad and x.requires_grad:
                    target = _grad_target(module, slot, x)
                    self._handles.append(target.register_hook(self._make_grad_hook(site)))
                    self._held_back.pop(site, None)  # hooked here: nothing to re-run for
                elif want_dgrad and checkpointed:
                    # its re-run in the backward pass gets the hook
                    self._ckpt_held[site] = self._ckpt_held.get(site, 0) + 1
                elif want_dgrad and not grad_on and site not in self._grad_sites:
                    # a reentrant checkpoint's first run: its re-run gets the hook
                    self._held_back[site] = self._held_back.get(site, 0) + 1
                if want_act and not self._hooks_failed:
                    self._add_parts("activation", site, x, _UNSURE if unsure else "activation")

        return eager_hook(hook)

    def _make_grad_hook(self, site: int) -> Any:
        # One hook per forward's tensor, and autograd calls a tensor hook once per backward
        # pass (with the gradient summed over the tensor's consumers): a second call is a
        # second backward pass through the same forward (see _several_backward_passes).
        fired = False

        def hook(grad: torch.Tensor) -> None:
            nonlocal fired
            if grad is None or not grad.is_floating_point():
                return
            again, fired = fired, True
            try:
                observe(grad, again)
            except Exception as exc:  # never let telemetry break the user's backward
                self._hook_failure(exc)

        def observe(grad: torch.Tensor, again: bool) -> None:
            groups = partial_groups(grad)
            if groups:
                # e.g. the gradient of a replicated input of a column-parallel Linear: each
                # tensor-parallel rank holds a partial sum. Its moments do not merge; sum the
                # elements first (a collective per partial group, on logging steps only; every
                # rank of the group runs the same backward, so they meet here in order, also
                # after this rank's hook work failed, and at every call of the hook: a second
                # backward pass is only told apart after it, as skipping it on some ranks
                # only would leave the others waiting).
                local = all_reduce_by_groups([(local_tensor(grad).detach(), groups)], "sum")[0]
                self._site_groups.setdefault(
                    ("dgrad", site), shard_groups(grad, include_partial=False)
                )
                # summed, every rank of the partial groups holds the same gradient: a replica
                self._site_replicas.setdefault(("dgrad", site), groups + replicate_groups(grad))
                if again:
                    self._several_backward_passes(site)
                elif not self._hooks_failed:
                    self._add_parts("dgrad", site, local.to(grad.dtype))
                return
            if again:
                self._several_backward_passes(site)
            elif not self._hooks_failed:
                self._add_parts("dgrad", site, grad)

        return eager_hook(hook)

    def _several_backward_passes(self, site: int) -> None:
        """A site's gradient hook was called a second time, or a reentrant checkpoint re-ran
        the site once more than its first runs counted: one forward got several backward
        passes (several losses each with ``backward(retain_graph=True)``; a gradient penalty's
        ``torch.autograd.grad(..., create_graph=True)`` before ``loss.backward()``). Each pass
        brings its own piece (of one loss; of a quantity that is no loss at all), and the
        gradient of the total loss, their elementwise sum, is never seen as one tensor: folded
        in side by side they doubled the count and gave the statistics of the pieces (measured:
        kurtosis 1.95 for 4.64). The site's dgrad is left out of this step, the pieces already
        taken too (a NaN row: merged over ranks, it comes out missing on every rank, also when
        this rank alone ran the passes; no collective added), and warned about at step end."""
        self._dropped.add(("dgrad", site))
        self._refired.add(site)

    def _add_parts(self, kind: str, site: int, x: torch.Tensor, into: str | None = None) -> None:
        """Fold ``x`` into ``kind``'s site (accumulator ``into``, default ``kind``), deferred."""
        into = into or kind
        if (kind, site) not in self._site_groups:
            self._site_groups[(kind, site)] = shard_groups(x, include_partial=False)
            self._site_replicas.setdefault((kind, site), replicate_groups(x))
        if (kind, site) in self._dropped:
            return
        local = local_tensor(x).detach()
        if x.is_inference():
            # no version counter to tell a later in-place change by: reduced now (and an
            # inference tensor can change only inside inference_mode, i.e. no training code)
            self._acc[into].add(site, local)
            return
        if (kind, site) in self._immediate:
            self._acc[into].add(site, local, key=x)
            return
        self._deferred.append((kind, site, local, x, local._version, into))
        self._deferred_elements += local.numel()
        limit = _DEFER_TENSORS if local.device.type == "cpu" else _DEFER_TENSORS_DEVICE
        if len(self._deferred) >= limit or self._deferred_elements >= _DEFER_ELEMENTS:
            self._reduce_deferred()

    def _reduce_deferred(self) -> None:
        deferred, self._deferred, self._deferred_elements = self._deferred, [], 0
        # per accumulator, in order: one add_many (on an accelerator, one compiled call per
        # bucket of tensors instead of one per site)
        batches: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for kind, site, local, key, version, into in deferred:
            if (kind, site) in self._dropped:
                continue
            if local._version != version:  # shared with x: detach() keeps the counter
                # Changed in place after the hook saw it (an in-place activation, a residual
                # added in place): its values at the hook are gone. Leave the site out of this
                # step (all its micro-batches: a partial merge would be a wrong number) and
                # reduce it in the hook from now on.
                self._immediate.add((kind, site))
                self._dropped.add((kind, site))
                self.warn_once(
                    f"inplace-{kind}-{site}",
                    f"the {kind} at {self._sites[site]} was modified in place after its hook; "
                    "it is missing from this step and reduced in the hook from the next one",
                )
                continue
            if into in self._acc:
                batches.setdefault(into, []).append((site, local, key))
        for into, items in batches.items():
            self._acc[into].add_many(items)

    def _hook_failure(self, exc: Exception) -> None:
        """Work inside a forward/gradient hook (or the step's last batched reduction) raised:
        activations and dgrads are left out of this step on this rank (their sites are
        poisoned, so that the merge over ranks leaves them out everywhere instead of writing
        a partial number), the step itself goes on, and so do this rank's collectives."""
        self.tolerate_failure(
            "hook-failure",
            "collecting activations/dgrads",
            exc,
            "they are missing from this logging step",
        )
        self._hooks_failed = True
        self._deferred, self._deferred_elements = [], 0
        self._dropped.update(
            (k, s) for k in ("activation", "dgrad") for s in range(len(self._sites))
        )

    def _remove_hooks(self) -> None:
        """Remove the step's hooks and drop what they hold (tensors waiting for their batched
        reduction live exactly as long as the hooks that saw them)."""
        handles, self._handles = self._handles, []
        self._collecting = False
        for h in handles:
            h.remove()
        self._deferred, self._deferred_elements = [], 0

    def _remove_site_hooks(self) -> None:
        """Remove a compiled model's forward hooks, kept from step to step (run end)."""
        handles, self._site_handles = self._site_handles, []
        for h in handles:
            h.remove()

    def _merged_sites(self, ctx: RunContext, kind: str) -> _Kind:
        """All micro-batches' parts of one kind merged into one row per site (exact)."""
        acc = self._acc.pop(kind, None)
        unsure = self._acc.pop(_UNSURE, None) if kind == "activation" else None
        n = len(self._sites)
        moments = empty_moments(n, device=ctx.device)
        if acc is not None:
            try:
                moments = acc.result()
                # no_grad forwards of sites that never ran with autograd on (a frozen part
                # under no_grad, a reentrant checkpoint's first run) are part of the step
                keep = [i for i in range(n) if i not in self._grad_sites]
                if unsure is not None and keep and not unsure.empty:
                    at = index_on(keep, moments.device)
                    extra = unsure.result().to(moments.device)[at]
                    moments[at] = combine_moments(torch.stack([moments[at], extra]), dim=0)
            except Exception as exc:
                self._hook_failure(exc)
        dropped = [site for k, site in self._dropped if k == kind]
        if dropped:
            # NaN, not "no elements": merged over ranks, a site one rank could not measure
            # must come out missing (left out of the output), not as the other ranks' part
            moments[dropped] = math.nan
        dp_cp = ctx.groups.dp_cp
        ep_active = group_size(ctx.groups.ep) > 1
        data_groups = () if group_size(dp_cp) == 1 else (dp_cp,)
        # An expert's tokens come from the token streams of its EP group only; the ranks
        # holding the same experts (expert data parallel) see the other streams' tokens.
        edp = ctx.groups.edp
        expert_groups = () if group_size(edp) == 1 else (edp,)
        ranks: dict[int, frozenset[int]] = {}  # group members by id(group), this call only
        groups, copies = [], []
        for i, expert in enumerate(self._site_expert):
            data = expert_groups if (expert and ep_active) else data_groups
            site_groups, counted = _count_once(
                self._site_groups.get((kind, i), ()),
                self._site_replicas.get((kind, i), ()),
                data,
                ranks,
            )
            groups.append(site_groups)
            if not counted:
                copies.append(i)
        if copies:
            # Another rank of the data group holds the same values: this rank's copy counts as
            # no elements. A NaN row stays NaN (a site one rank could not measure comes out
            # missing everywhere); chosen on the device, nothing leaves it.
            at = index_on(copies, moments.device)
            rows = moments[at]
            moments[at] = torch.where(
                torch.isnan(rows[:, :1]), rows, empty_moments(len(copies), device=moments.device)
            )
        return _Kind(list(self._sites), moments, groups, list(self._site_expert))

    # ------------------------------------------------------------------ combine and write

    def _emit(self, ctx: RunContext, pending: dict[str, _Kind]) -> None:
        kinds = [k for k in KINDS if k in pending]
        _merge_over_groups([pending[k] for k in kinds])
        names = {k: pending[k].names for k in kinds}
        stats = [pending[k].moments for k in kinds]
        # Experts: every EP rank holds different experts; gather them (one collective).
        ep = ctx.groups.ep
        if group_size(ep) > 1:
            names, stats = self._gather_experts(ep, kinds, pending, names, stats)
        # Pipeline stages hold different tensors: gather them to rank 0 (one object gather).
        pp = ctx.groups.pp
        host: list[torch.Tensor] | None = None
        if group_size(pp) > 1:
            host = [s.cpu() for s in stats]
            gathered = all_gather_objects(
                {k: (names[k], h) for k, h in zip(kinds, host, strict=True)}, pp
            )
            for i, k in enumerate(kinds):
                names[k] = [n for g in gathered for n in g[k][0]]
                host[i] = torch.cat([g[k][1] for g in gathered])
        if ctx.global_rank != 0:
            return
        if host is None:  # one device-to-host transfer for every kind
            sizes = [s.shape[0] for s in stats]
            flat = (
                torch.cat([s.to(stats[0].device) for s in stats]).cpu()
                if stats
                else empty_moments(0)
            )
            host = list(flat.split(sizes))
        lines = []
        scalars: dict[str, float] = {}
        micro = max(ctx.micro_batches_in_step, 1)
        for i, k in enumerate(kinds):
            keep = ~torch.isnan(host[i][:, 0])  # NaN count: not measured this step (a failure)
            if k in ("activation", "dgrad"):
                # sites never reached (integer inputs, unused modules) are left out; experts
                # that received no tokens stay (count 0 is information)
                seen = (host[i][:, 0] > 0) | (host[i][:, 7] > 0)
                expert = torch.tensor(
                    [self.expert_pattern.search(n) is not None for n in names[k]], dtype=torch.bool
                )
                keep &= seen | expert
            if not bool(keep.all()):
                rows = keep.nonzero().flatten().tolist()
                names[k] = [names[k][j] for j in rows]
                host[i] = host[i][rows]
        for k, h in zip(kinds, host, strict=True):
            rows = moments_to_rows(h)
            line = {
                "version": SCHEMA_VERSION,
                "step": ctx.step,
                "kind": k,
                "time": time.time(),
                "fields": list(FIELDS),
                "tensors": dict(zip(names[k], rows, strict=True)),
            }
            if k in ("activation", "dgrad"):
                line["micro_batches"] = micro
            lines.append(json.dumps(line, separators=(",", ":"), allow_nan=False))
            if self.summaries:
                scalars.update(self._summaries(k, names[k], h))
        self._drop_abandoned_steps(ctx)
        self._file_high_step = max(self._file_high_step, ctx.step)
        self._append_lines(lines)
        if scalars:
            self.write(ctx, scalars)

    def _append_lines(self, lines: list[str]) -> None:
        """Append ``lines`` to the file. After an append that failed part-way (a full disk; with
        several ranks the callback keeps running) the next one starts on a new line, so the cut
        line stays alone (readers skip it) instead of swallowing the next record."""
        if self._path is None:  # no file (Lightning's fast_dev_run)
            return
        text = "\n".join(lines) + "\n"
        if self._cut_line:
            text = "\n" + text
        self._cut_line = True
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(text)
        self._cut_line = False

    def _summaries(self, kind: str, names: list[str], moments: torch.Tensor) -> dict[str, float]:
        prefix = f"tensor_stats/{kind}"
        d = derive(moments)
        has = d["count"] > 0
        out: dict[str, float] = {f"{prefix}/nonfinite": float(d["nonfinite"].sum())}
        if bool(has.any()):
            rms = d["rms"][has]
            out[f"{prefix}/rms_mean"] = float(rms.mean())
            out[f"{prefix}/rms_max"] = float(rms.max())
            out[f"{prefix}/abs_max"] = float(
                torch.maximum(d["min"][has].abs(), d["max"][has].abs()).max()
            )
        kurt = d["kurtosis"][~torch.isnan(d["kurtosis"])]
        if kurt.numel():
            out[f"{prefix}/kurtosis_mean"] = float(kurt.mean())
            out[f"{prefix}/kurtosis_max"] = float(kurt.max())
        if self.layer_pattern is not None:
            layers: dict[int, list[int]] = {}
            not_number: tuple[str, str | None] | None = None  # (a name, its capture)
            for i, n in enumerate(names):
                m = self.layer_pattern.search(n)
                if not m:
                    continue
                # (isdecimal: what int() reads; isdigit() also passes superscripts)
                if m.group(1) is not None and m.group(1).isdecimal():
                    layers.setdefault(int(m.group(1)), []).append(i)
                elif not_number is None:
                    not_number = (n, m.group(1))
            if not_number is not None:
                self._warn_not_layer_number(*not_number)
            if layers:
                order = sorted(layers)
                idx = torch.tensor([i for L in order for i in layers[L]])
                owner = torch.tensor([j for j, L in enumerate(order) for _ in layers[L]])
                merged = derive(combine_moments(moments[idx], owner, len(order)))
                for j, L in enumerate(order):
                    for stat in ("rms", "kurtosis"):
                        v = float(merged[stat][j])
                        if math.isfinite(v):
                            out[f"{prefix}/layer_{L}/{stat}"] = v
        return out

    def _warn_not_layer_number(self, name: str, captured: str | None) -> None:
        """Say once that ``layer_pattern`` matched a tensor name (``name``, an example) whose
        capture is not a layer number: per-layer keys are ``layer_<number>``, ordered
        numerically, so such tensors are in no per-layer summary (a pattern capturing words
        wrote none, silently)."""
        pattern = self.layer_pattern.pattern if self.layer_pattern is not None else None
        self.warn_once(
            "layer-pattern-not-number",
            f"layer_pattern {pattern!r} matches {name!r} but captures {captured!r}, not a "
            "layer number: such tensors are in no tensor_stats/<kind>/layer_<i> summary. Make "
            r"the group capture the layer number (e.g. r'layers\.(\d+)\.')",
        )

    # ------------------------------------------------------------------ experts

    def _expert_offsets(
        self, ctx: RunContext, param_names: list[str]
    ) -> tuple[int, dict[str, int]] | None:
        """(ep_rank, {prefix: number of local experts}) when expert parallelism is on."""
        ep = ctx.groups.ep
        if group_size(ep) == 1:
            return None
        counts: dict[str, int] = {}
        for name in [canonical_name(n) for n in param_names]:
            m = self.expert_pattern.search(name)
            if m:
                prefix = name[: m.start(1)]
                counts[prefix] = max(counts.get(prefix, 0), int(m.group(1)) + 1)
        return group_rank(ep), counts

    def _global_name(self, name: str) -> str:
        if self._ep_info is None:
            return name
        rank, counts = self._ep_info
        m = self.expert_pattern.search(name)
        if not m or name[: m.start(1)] not in counts:
            return name
        local = int(m.group(1))
        return f"{name[: m.start(1)]}{rank * counts[name[: m.start(1)]] + local}{name[m.end(1) :]}"

    def _is_expert(self, name: str) -> bool:
        return self._ep_info is not None and self.expert_pattern.search(name) is not None

    def _warn_missing_edp(self, ctx: RunContext) -> None:
        """More token streams than EP ranks and no ``edp`` group (a hand-built ProcessGroups):
        the expert sites would hold only this EP group's tokens. Say so, once."""
        groups = ctx.groups
        if (
            any(self._site_expert)
            and any(k in self.kinds for k in ("activation", "dgrad"))
            and group_size(groups.edp) == 1
            and group_size(groups.dp_cp) > group_size(groups.ep) > 1
        ):
            self.warn_once(
                "missing-edp",
                f"groups.dp_cp has {group_size(groups.dp_cp)} ranks but groups.ep only "
                f"{group_size(groups.ep)} and groups.edp is not set: expert activations and "
                "dgrads cover only the tokens of this rank's EP group. Pass "
                "ProcessGroups(..., edp=<the ranks holding the same experts>) or build the "
                "groups with ProcessGroups.from_device_mesh on a mesh with an 'ep' dim",
            )

    def _recorded_of(self, left_out: list[str]) -> list[str]:
        """The site modules of ``left_out`` whose sites this monitor would have recorded
        (activation or dgrad among its kinds; kept by ``include``/``exclude``)."""
        if not any(k in self.kinds for k in ("activation", "dgrad")):
            return []
        return [n for n in left_out if any(self._wanted(f"{n}/{s}") for s in _SITE_SUFFIXES)]

    def _warn_fullgraph_sites(self, left_out: list[str]) -> None:
        """Say once which sites were left out for being inside code compiled with
        ``fullgraph=True`` (only those ``include``/``exclude`` would keep)."""
        named = self._recorded_of(left_out)
        if not named:
            return
        self.warn_once(
            "fullgraph-sites",
            f"{len(named)} activation/dgrad site module(s) (e.g. {named[0]}) are inside a module "
            "compiled with fullgraph=True: a hook there would break the graph and Dynamo "
            "refuses; they are not recorded (param and grad are). Compile without fullgraph, "
            "or leave these modules out of the compiled region, to record them",
        )

    def _warn_tensor_parallel_experts(self, left_out: list[str]) -> None:
        """Say once which fused experts modules the default rule left out for their
        tensor-parallel weights (only those whose sites ``include``/``exclude`` would keep)."""
        named = self._recorded_of(left_out)
        if not named:
            return
        shown = ", ".join(named[:3]) + (f", ... ({len(named)} in all)" if len(named) > 3 else "")
        self.warn_once(
            "tensor-parallel-experts",
            f"fused experts module(s) {shown} have weights sharded over a tensor-parallel "
            "mesh dim and are not activation/dgrad sites: a forward run on the local weight "
            "shards may return this rank's partial sums (torchtitan's TensorParallel / "
            "ExpertTensorParallel on GroupedExperts sum after the module), which would be "
            "recorded as the layer's values. If the class's forward returns the summed "
            "output (transformers' moe_tp_experts all-reduces inside it), name the class in "
            "module_types= (with the other site classes, e.g. nn.Linear) to record it; the "
            "default cannot tell the two apart",
        )

    def _gather_experts(
        self,
        ep: Any,
        kinds: list[str],
        pending: dict[str, _Kind],
        names: dict[str, list[str]],
        stats: list[torch.Tensor],
    ) -> tuple[dict[str, list[str]], list[torch.Tensor]]:
        """Gather expert tensors over the EP group; every EP rank holds the same number of
        local experts, so rank r's names follow from its offset."""
        assert self._ep_info is not None
        my_rank, counts = self._ep_info
        idx = {k: [i for i, e in enumerate(pending[k].expert) if e] for k in kinds}
        local = [s[index_on(idx[k], s.device)] for k, s in zip(kinds, stats, strict=True)]
        gathered = all_gather_coalesced(local, ep)  # [ep, T_k, F] per kind
        out_names: dict[str, list[str]] = {}
        out_stats = []
        for k, s, g in zip(kinds, stats, gathered, strict=True):
            keep = [i for i, e in enumerate(pending[k].expert) if not e]
            ns = [names[k][i] for i in keep]
            rows = [s[index_on(keep, s.device)]]
            for r in range(g.shape[0]):
                for i in idx[k]:
                    ns.append(self._rename_expert(names[k][i], my_rank, r, counts))
                rows.append(g[r].to(s.device))
            out_names[k] = ns
            out_stats.append(torch.cat(rows) if rows else s)
        return out_names, out_stats

    def _rename_expert(self, name: str, mine: int, rank: int, counts: dict[str, int]) -> str:
        m = self.expert_pattern.search(name)
        if not m:
            return name
        prefix = name[: m.start(1)]
        per = counts.get(prefix, 0)
        local = int(m.group(1)) - mine * per
        return f"{prefix}{rank * per + local}{name[m.end(1) :]}"

    # ------------------------------------------------------------------ names

    def _warn_unmatched_globs(self, names: list[str]) -> None:
        """A glob of ``include``/``exclude`` that matches no tensor name is almost always a
        mistake (``"head/*"`` for a module named ``lm_head``: globs match whole names), and
        it fails silently otherwise: say so once, at run start."""
        for option, globs in (("include", self.include or []), ("exclude", self.exclude)):
            for glob in globs:
                if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                    example = next(iter(names), "")
                    self.warn_once(
                        f"unmatched-{option}-{glob}",
                        f"{option} glob {glob!r} matches no parameter or activation site of the "
                        f"model (globs match whole names, e.g. {example!r})",
                    )

    def _wanted(self, name: str) -> bool:
        if self.include is not None and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)


# ---------------------------------------------------------------------------------- helpers


def _default_site_types() -> tuple[type, ...]:
    types: list[type] = [nn.Linear, nn.Embedding]
    try:
        from trainvitals.moe import TopKRouter

        types.append(TopKRouter)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _is_compiled(model: Any) -> bool:
    """Whether ``model`` is or holds a ``torch.compile``'d module: ``torch.compile(model)``
    (an ``OptimizedModule``, whose ``_orig_mod`` is the user's), ``module.compile()`` (per
    transformer block, torchtitan style: the module's ``_compiled_call_impl``), or a
    LightningModule Lightning took from ``torch.compile(lm)`` (``from_compiled``: its
    ``forward`` and ``training_step`` compiled, its ``_compiler_ctx`` set). A model whose
    forward is compiled as a function (``torch.compile(train_step)``) is not seen here."""
    if not isinstance(model, nn.Module):
        return False
    return any(
        isinstance(getattr(m, "_orig_mod", None), nn.Module)
        or getattr(m, "_compiled_call_impl", None) is not None
        or isinstance(getattr(m, "_compiler_ctx", None), dict)
        for m in model.modules()
    )


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Router")


def _is_fused_experts(module: nn.Module, site_types: tuple[type, ...]) -> bool:
    """Whether ``module`` computes a set of experts from weights no other site sees: its class
    name ends in ``Experts``, it has parameters, and no module inside it (itself included) is
    a site of ``site_types`` or a router.

    transformers 5.x keeps the experts of its MoE families (``MixtralExperts``,
    ``Qwen3MoeExperts``, ``OlmoeExperts``, ``DeepseekV3Experts``, ``GptOssExperts``, ...) as 3-d
    parameters (``gate_up_proj [E, 2F, H]``) used through ``F.linear``/grouped matmuls inside
    ``forward(hidden_states, top_k_index, top_k_weights)``: no ``nn.Linear`` to hook, so
    nothing of the experts was recorded. The rule asks for no 3-d shape: ``DbrxExperts``
    holds its weights in a child as ``[E * F, H]``, and torchtitan's ``GroupedExperts`` (3-d
    ``w1``/``w2``/``w3``) fits it too. A ``ModuleDict``/``ModuleList`` of per-expert MLPs
    (``NllbMoeExperts``, ``SwitchTransformersExperts``) is not one: its ``nn.Linear`` sites see
    each expert already."""
    if not type(module).__name__.endswith("Experts"):
        return False
    if any(isinstance(m, site_types) or _is_router(m) for m in module.modules()):
        return False
    return next(module.parameters(), None) is not None


def _group_members(group: Any, members: dict[int, frozenset[int]]) -> frozenset[int]:
    """``group``'s global ranks, from the local group table (no collective), cached in
    ``members`` by the group's ``id`` for one caller's run."""
    key = id(group)
    if key not in members:
        members[key] = frozenset(dist.get_process_group_ranks(group))
    return members[key]


def _tensor_parallel_weights(
    module: nn.Module, groups: Any, members: dict[int, frozenset[int]]
) -> bool:
    """Whether a parameter of ``module`` is a DTensor sharded over a tensor-parallel mesh
    dim: ``groups.tp``, or any group outside ``groups.dp_cp``, unless the group lies inside
    ``groups.ep`` or ``groups.edp`` (whole experts per rank, or their FSDP shards: torchtitan's
    ``ep`` and transformers' may borrow the tensor-parallel ranks, even be the ``tp`` ranks).

    torchtitan's ``TensorParallel`` / ``ExpertTensorParallel`` on ``GroupedExperts`` shard
    ``w1``/``w3`` on dim 1 and ``w2`` on dim 2 over ``tp``, run ``forward`` on the
    ``to_local()`` shards and leave the row-parallel sum to the MoE block's output layout: the
    module's ``output0`` and the dgrad of its ``input0`` are one rank's partial sums. FSDP2
    (``Shard(0)`` over ``dp``) and expert parallelism (``Shard(0)`` over ``ep``) keep whole
    activations and are not caught. Group membership comes from the local table (no
    collective); ``members`` caches each group's global ranks by ``id``."""
    if not dist.is_available() or not dist.is_initialized():
        return False  # (a DTensor needs a process group)

    def ranks(group: Any) -> frozenset[int]:
        return _group_members(group, members)

    def inside(r: frozenset[int], *among: Any) -> bool:
        return any(group_size(g) > 1 and r <= ranks(g) for g in among)

    tp = ranks(groups.tp) if group_size(groups.tp) > 1 else None
    for p in module.parameters():
        if not _is_dtensor(p):
            continue
        shards, _, _ = groups_by_placement(p.device_mesh, p.placements, replicas=False)
        for g in shards:
            r = ranks(g) if group_size(g) > 1 else None
            if r is None or inside(r, groups.ep, groups.edp):
                continue
            if r == tp or not inside(r, groups.dp_cp):
                return True
    return False


def _is_dtensor(x: torch.Tensor) -> bool:
    return callable(getattr(x, "to_local", None)) and hasattr(x, "placements")


def _local_layout(
    x: torch.Tensor, reduced: tuple[tuple[int, ...], tuple[Any, ...]] | None
) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """(the groups a plain activation ``x`` is sharded over, the groups it is a known replica
    over): ``((), ())`` for a whole tensor of unknown layout, ``None`` when that cannot be told.

    A parallel style hands out ``dtensor.to_local()`` (``use_local_output=True``), e.g.
    ``RowwiseParallel(output_layouts=Shard(1))`` under sequence parallelism: each
    tensor-parallel rank then holds a different part of the sequence, which taken as a replica
    would leave the other ranks' parts out. With autograd on, ``to_local``'s backward node
    keeps the DTensor's spec (the same on every rank): merge over its ``Shard`` dims. Without
    it, a reduced ``Partial`` output (``reduced``: its global shape and the groups it is split
    over) is whole if its shape is the global one, split otherwise; when the global shape has
    a dim of size 0 or 1 the two cannot be told apart on every rank alike (``None``). The
    replicas (the spec's ``Replicate`` dims; the groups a whole reduced output was all-reduced
    over) let :func:`_count_once` count each copy once."""
    spec = getattr(x.grad_fn, "dtensor_spec", None) if x.grad_fn is not None else None
    placements = getattr(spec, "placements", None)
    if placements is not None:
        shards, partials, replicas = groups_by_placement(spec.mesh, placements)
        return None if partials else (shards, replicas)
    if reduced is None:
        return (), ()  # assumed whole or a replica over tensor-parallel ranks (documented)
    shape, groups = reduced
    if any(n <= 1 for n in shape):
        return None
    return ((), groups) if tuple(x.shape) == shape else (groups, ())


def _count_once(
    shards: tuple[Any, ...],
    replicas: tuple[Any, ...],
    data: tuple[Any, ...],
    members: dict[int, frozenset[int]],
) -> tuple[tuple[Any, ...], bool]:
    """(the groups to merge an activation/dgrad site over, whether this rank's values count).

    ``data`` is the site's data group (``(dp_cp,)``, ``(edp,)`` for an expert site, or ``()``),
    merged over because its ranks see different tokens. A mesh dim can also lie inside it: under
    Megatron-style sequence parallelism the tensor-parallel dim is named ``sp`` and is a ``cp``
    dim. Each distinct piece of data must then count once: a ``Shard`` group inside ``data`` is
    not merged over on its own (the merge over ``data`` covers its ranks already; merging both
    counted every shard twice), and over a group inside ``data`` where the tensor is a replica
    (``Replicate`` dims, a ``Partial`` dgrad once summed) only its lowest global rank's values
    count; the others' count as no elements, so the merge over ``data`` takes each copy once.
    Groups outside ``data`` (a ``tp`` dim) are merged, or not, as before. Membership comes from
    the local group table (no collective, no new group) and is the same on every rank of a
    group, so every rank merges over the same groups in the same order. ``members`` caches
    each group's global ranks by ``id`` (the caller's, for one call)."""
    if not data or group_size(data[0]) == 1:
        return shards + data, True

    def ranks(group: Any) -> frozenset[int]:
        return _group_members(group, members)

    inside = ranks(data[0])
    kept = tuple(g for g in shards if group_size(g) == 1 or not ranks(g) <= inside)
    me = dist.get_rank()
    counted = all(
        group_size(g) == 1 or not ranks(g) <= inside or me == min(ranks(g)) for g in replicas
    )
    return kept + data, counted


def _in_recorded_function() -> bool:
    """Whether some custom autograd ``Function``'s ``forward`` on the Python stack is recorded
    in the autograd graph (its ``ctx.next_functions`` not empty; see :func:`_function_ctxs`).
    Every enclosing one is looked at, not the nearest only: a reentrant checkpoint inside
    another one runs in the outer one's first run, autograd off, so it is not recorded
    itself, yet the outer one is, and the backward pass re-runs both (a block used plainly and
    under two nested checkpoints lost half its activations and dgrads). Under an outer
    ``no_grad`` (generation) none is recorded."""
    return any(ctx.next_functions for ctx in _function_ctxs("forward"))


def _in_function_backward() -> bool:
    """Whether a custom autograd ``Function``'s ``backward`` is running (a reentrant
    checkpoint's re-run; a non-reentrant checkpoint recomputes outside any)."""
    return next(_function_ctxs("backward"), None) is not None


def _function_ctxs(method: str) -> Iterator[Any]:
    """The ``ctx`` of each custom autograd ``Function``'s ``method`` (``"forward"`` or
    ``"backward"``) running on the Python stack, innermost first.

    A reentrant activation checkpoint (``torch.utils.checkpoint``'s ``CheckpointFunction``;
    Megatron's and DeepSpeed's are ``Function`` s too) runs its block in ``forward`` with
    autograd off (autograd runs every ``Function.forward`` so) and re-runs it in ``backward``.
    Its ``ctx.next_functions`` is not empty only when the call is recorded in the autograd
    graph (autograd on outside it and an input needing a gradient): then the backward pass
    re-runs it, and the first run is part of the training step; a checkpointed block called
    under ``no_grad`` (generation) is not. Called on logging steps only, for a site's
    autograd-off calls and held-back re-runs (a walk up the Python stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == method and code.co_argcount and code.co_varnames[0] == "ctx":
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                yield ctx
        frame = frame.f_back


def _first_float(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor of a module's arguments or output: ``obj`` itself, or
    the first among its top-level items (token ids and other integer tensors, ``None`` and
    other objects are passed over, so ``module(ids, hidden)`` is measured on ``hidden``)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, list | tuple):
        for v in obj:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v
    return None


def _grad_target(module: nn.Module, slot: int, x: torch.Tensor) -> torch.Tensor:
    """The tensor whose gradient hook delivers the dgrad of ``x`` (``slot`` 1: an output).

    A hook on a view never fires once the view is changed in place (autograd rebases the
    view's history onto its base; the node the hook sits on leaves the graph), and
    ``nn.Linear``'s output for an input of 3 or more dims is such a view (of its 2-D
    ``addmm`` result): ``ReLU(inplace=True)``, or a residual added in place, after it left the
    site's dgrad out, silently. That base is made inside ``F.linear`` and used by nothing
    else, so its gradient is the gradient of ``x`` (the same elements, reshaped), whether or
    not ``x`` is changed later: hook the base instead. Other views keep the hook on ``x``
    (their base may have other consumers, whose gradients it would add)."""
    if (
        slot == 1
        and type(module).forward is nn.Linear.forward
        and x._is_view()
        and not _is_dtensor(x)
    ):
        base = x._base
        if (
            base is not None
            and base.requires_grad
            and base.numel() == x.numel()
            and base.is_contiguous()
            and x.is_contiguous()
            and base.data_ptr() == x.data_ptr()
        ):
            return base
    return x


def _sum_partials(tensors: list[torch.Tensor], locals_: list[torch.Tensor]) -> None:
    """A Partial DTensor's value is the elementwise sum of its locals: sum them first (one
    collective per distinct partial group, only when some tensor is Partial)."""
    items, where = [], []
    for i, t in enumerate(tensors):
        groups = partial_groups(t)
        if groups:
            items.append((locals_[i], groups))
            where.append(i)
    if items:
        reduced = all_reduce_by_groups(items, "sum", dtype=torch.float64)
        for i, value in zip(where, reduced, strict=True):
            locals_[i] = value


def _concat_kinds(first: _Kind, second: _Kind) -> _Kind:
    """One kind's moments of two disjoint sets of tensors (measured at two optimizer steps)."""
    # on the tensors' device: an empty part's moments sit on the CPU, where a collective of
    # the merge (NCCL) could not take them
    device = (first.moments if first.names else second.moments).device
    return _Kind(
        names=first.names + second.names,
        moments=torch.cat([first.moments.to(device), second.moments.to(device)]),
        groups=first.groups + second.groups,
        expert=first.expert + second.expert,
    )


def _merge_over_groups(kinds: list[_Kind]) -> None:
    """Merge each tensor's moments over its groups: one all_gather per distinct rank set (and
    backend), the groups in order of first appearance (the same on every rank). Keyed by rank
    set, not by object: two group objects over the same ranks (equal meshes built apart, a
    mesh's dim and a ProcessGroups group) would merge a tensor's moments twice (its count and
    sums doubled) and cost a second collective."""
    memo: dict[int, Any] = {}
    keys = [[{group_key(g, memo) for g in gs} for gs in k.groups] for k in kinds]
    first: dict[Any, Any] = {}
    for k in kinds:
        for gs in k.groups:
            for g in gs:
                first.setdefault(group_key(g, memo), g)
    for key, g in first.items():
        if group_size(g) == 1:
            continue
        sel = [
            (k, [i for i, ks in enumerate(kk) if key in ks])
            for k, kk in zip(kinds, keys, strict=True)
        ]
        sel = [(k, idx) for k, idx in sel if idx]
        blocks = [k.moments[index_on(idx, k.moments.device)] for k, idx in sel]
        gathered = all_gather_coalesced(blocks, g)
        for (k, idx), rows in zip(sel, gathered, strict=True):
            k.moments[index_on(idx, k.moments.device)] = combine_moments(rows, dim=0).to(
                k.moments.device
            )


# The files claimed by the TensorStatsMonitors of this process whose run has not ended:
# resolved path -> the instance (weakly held: a monitor garbage-collected mid-run frees its file)
_CLAIMS: dict[Path, weakref.ref[TensorStatsMonitor]] = {}
_CLAIMS_LOCK = threading.RLock()  # (_claim_file calls _unclaim_file holding it)


def _prepare_jsonl(path: Path, first_step: int) -> None:
    """Make ``path`` safe to append to from ``first_step`` on, by JsonlSink's rule: a new run
    (step 0) moves an earlier run's file aside (``tensor_stats.jsonl.1``, ...); a resumed run
    drops a last line cut by a crash and every line of a step >= ``first_step`` (it re-logs
    those steps), reading the file line by line (it can hold gigabytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.stat().st_size == 0:
        return  # nothing to keep; a pipe is appended to without reading it
    if first_step == 0:
        kept = move_aside(path)
        message = f"TensorStatsMonitor: {path} held an earlier run; moved it to {kept.name}"
    else:
        records, cut = _drop_steps_from(path, first_step, line_step=_line_step)
        if not records + cut:
            return
        message = (
            f"TensorStatsMonitor: {path}: dropped {records + cut} line(s) (cut by a crash, or of "
            f"steps >= {first_step} that this resumed run logs again)"
        )
        if not cut:
            # the lines the interrupted run wrote after the checkpoint this run resumes from:
            # the ordinary resume, an INFO log (as JsonlSink's metrics.jsonl)
            _log.info(message)
            return
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# the start of a line as _emit writes it (compact separators, "version" then "step")
_STEP_PREFIX = re.compile(rb'\{"version":\d+,"step":(\d+),')


def _line_step(raw: bytes) -> int | None:
    """The step of a complete line of this file; ``None`` for a cut or foreign line."""
    m = _STEP_PREFIX.match(raw)
    if m is not None and raw.endswith(b"}\n"):  # as _emit writes it: skip the full parse
        return int(m.group(1))
    try:
        step = json.loads(raw)["step"]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return step if type(step) is int else None
