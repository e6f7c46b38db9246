"""NormMonitor: global (and optionally per-parameter) L2 norms of parameters and gradients."""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainvitals._device import host_to_device, index_on
from trainvitals._natural import natural_order
from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.base import (
    DEEPSPEED,
    FSDP1,
    VitalsCallback,
    compile_one_group,
    compile_regex,
    flat_sharding,
)
from trainvitals.distributed import (
    all_gather_objects,
    all_reduce_coalesced,
    group_rank,
    group_size,
    local_tensor,
)
from trainvitals.stats.norms import (
    canonical_named_parameters,
    group_named_tensors,
    has_no_values,
    is_flat_shard,
    keep_sharded_parameters,
    local_sq_norms,
    optimized_ids,
    reduce_sq_norms,
    sharding_groups,
    sums_by_group,
    unwrap_model,
)

__all__ = ["NormMonitor"]

_KINDS = ("grad", "param")


@dataclass
class _Tracked:
    name: str  # canonical name in the user's module
    param: torch.nn.Parameter
    groups: tuple[Any, ...]  # the groups its per-tensor sums are summed over
    # a plain-tensor expert of an expert-parallel model: each EP rank holds other experts,
    # so its sums join the totals over ``groups.ep`` (its own keys stay this rank's)
    expert: bool = False
    # its position in the run's group labels (``group_by``); None: in no group
    group: int | None = None
    # an FSDP1 flat shard (a FlatParameter, or with use_orig_params a view of one): its
    # gradient is a plain tensor sharded like it, summed over the same ``groups``
    flat: bool = False


@dataclass
class _Part:
    """The norms measured at one ``optimizer.step()``: of every tracked parameter, or, with
    several optimizers stepped apart (Lightning's manual optimization), of the stepped one's."""

    optimizer: int | None  # index in ctx.optimizers of the stepped optimizer (None: all at once)
    tracked: list[_Tracked]
    has_grad: list[bool]  # the gradient is present on this rank
    # per parameter: its gradient's sum is reduced over some group (presence then on the device)
    shared: list[bool]
    owned: list[int]  # positions of the parameters that belong to ``optimizer``
    selected: list[int]  # positions of the parameters reported one by one
    sq: torch.Tensor  # float64 [param sums of squares..., grad sums of squares...], reduced
    # float64 per parameter: how many ranks of its gradient's reduction hold the gradient,
    # reduced with the sums (0: no rank has it, its norm is undefined)
    present: torch.Tensor
    # bool per parameter: its gradient held NaN/Inf at an earlier step() of the same optimizer
    # in this step, whose measurement this one replaced (None: no such step)
    earlier_bad: torch.Tensor | None = None

    def nonfinite(self) -> torch.Tensor:
        """bool per parameter: its gradient holds NaN/Inf now or did at a replaced step()."""
        grad_sq = self.sq[len(self.tracked) :]
        bad = torch.isnan(grad_sq) | (grad_sq == math.inf)  # (-inf: not measured)
        return bad if self.earlier_bad is None else bad | self.earlier_bad.to(bad.device)

    def nonfinite_by_param(self) -> dict[int, torch.Tensor]:
        """:meth:`nonfinite` by parameter ``id``, on the device: no host sync."""
        flags = self.nonfinite()
        return {id(t.param): flags[i] for i, t in enumerate(self.tracked)}

    def without(self, drop: set[int]) -> tuple[_Part, dict[int, torch.Tensor]]:
        """This part without the parameters at positions ``drop``, and those parameters'
        non-finite flags (by ``id``), all on the device: no host sync."""
        n = len(self.tracked)
        keep = [i for i in range(n) if i not in drop]
        flags = self.nonfinite()
        dropped = {id(self.tracked[i].param): flags[i] for i in sorted(drop)}
        device = self.sq.device
        rows = index_on(keep, device)
        position = {old: new for new, old in enumerate(keep)}
        kept = _Part(
            optimizer=self.optimizer,
            tracked=[self.tracked[i] for i in keep],
            has_grad=[self.has_grad[i] for i in keep],
            shared=[self.shared[i] for i in keep],
            owned=[position[i] for i in self.owned if i in position],
            selected=[position[i] for i in self.selected if i in position],
            sq=self.sq.index_select(0, torch.cat([rows, rows + n])),
            present=self.present.index_select(0, rows.to(self.present.device)),
            earlier_bad=None if self.earlier_bad is None else flags.index_select(0, rows),
        )
        return kept, dropped


@dataclass
class _PendingFlags:
    step: int
    names: list[str]  # the gradients the flags stand for
    flags: torch.Tensor  # bool per name: that gradient holds NaN/Inf (host memory)
    event: Any  # a CUDA event marking the end of the copy, or None when already on the host
    # the step's nonfinite_count, over every rank (other pipeline stages' or expert-parallel
    # ranks' gradients too, which ``names`` lacks); None: just the flags
    count: torch.Tensor | None = None


class NormMonitor(VitalsCallback):
    r"""Global L2 norms of the parameters and gradients, exact under DDP, FSDP1, FSDP2 and TP.

    On each logging step, in ``before_optimizer_step`` (gradients after AMP unscaling and
    before clipping), the monitor computes every trainable parameter's and gradient's sum of
    squares on its device, sums the shards of ``DTensor`` parameters over their ``Shard`` mesh
    dims only (one collective per distinct group for parameters and gradients together), and
    writes the norms. Plain tensors are replicas (DDP) and are not reduced (plain experts under
    expert parallelism excepted, below); tied parameters count once. Non-logging steps cost nothing: no computation, no sync, no collective.

    Under Lightning's manual optimization, whose ``training_step`` clips before ``opt.step()``,
    the gradients are read when ``self.clip_gradients(opt, gradient_clip_val=...)`` starts
    clipping (not under fp16 with a ``GradScaler``, where they are still scaled then); a
    ``torch.nn.utils.clip_grad_norm_`` called directly is not seen (clipped norms).

    The parameter norm is taken at the same moment, i.e. of the weights the step's gradients
    were computed with (before the update). The norms of a logging step are over the
    parameters that train at that step: those with ``requires_grad`` then (and, for the
    gradient norms, a gradient present). Parameters frozen or unfrozen during training
    (``BackboneFinetuning``) drop out or join, and so do parameters added to the model during
    the run (LoRA adapters given to the optimizer with ``add_param_group``): each logging step
    compares the ids of the parameters registered in the model's modules with the last look
    and finds the names again only when they changed (FSDP2's unsharded parameters left
    registered after backward are not taken for the sharded ones:
    :func:`~trainvitals.stats.norms.keep_sharded_parameters`); one left on
    the ``meta`` device (deferred initialisation never materialised) has no values and is left
    out, warned once.
    With pipeline parallelism (``groups.pp`` non-trivial) the totals are summed over the
    pipeline stages in one more collective; per-parameter keys then come from rank 0's stage
    (``group_by`` keys from every stage: their rows ride in the same collective).
    With expert parallelism (``groups.ep`` non-trivial) each EP rank holds other experts: the
    plain-tensor parameters whose names match ``expert_pattern`` are summed into the totals
    (``global``, ``optimizer_<i>``, ``group/<label>``, ``nonfinite_count``) over ``groups.ep``
    in one more collective, as Megatron-LM's norms sum expert parameters over their expert
    groups (and not over ``groups.edp``, whose ranks hold the same experts); their
    per-parameter keys, and the names in the NaN/Inf warning, are the reporting rank's
    experts'. An EP rank with nothing to train takes part with zeros. Expert ``DTensor`` parameters (torchtitan) are
    summed over their ``Shard`` dims like any other. When no parameter matches and none is a
    ``DTensor``, a warning (once) says the totals count this rank's experts only.

    Several optimizers stepped apart (a GAN stepping ``opt_g`` and ``opt_d`` in one batch:
    Lightning's manual optimization, or the driver with both attached): the step is the batch,
    under Lightning keyed by ``trainer.global_step`` at its start (which counts every
    ``optimizer.step()``: 0, 2, 4, ... with two optimizers, so the interval counts those steps
    too), in the driver by the batch count. Each optimizer's parameters
    are measured right before its own ``step()`` (its gradients as it uses them, its weights
    before its update; parameters in no optimizer with the first ``step()`` of the batch),
    each parameter once per step, and the step's keys are written once, after the batch: the
    ``global`` norms over the optimizers stepped in it, and per optimizer the
    ``optimizer_<i>`` keys (``i``: its index in ``trainer.optimizers`` or the attached
    list). An optimizer stepped several times in the batch (a critic stepped k times per
    generator step) shows its last ``step()``: the gradients its last update used and its
    weights before that update; a gradient that held NaN/Inf at one of its earlier
    ``step()`` calls is still counted in ``nonfinite_count`` (once) and named, though the
    norms may then be finite. With one optimizer, or when every gradient is shown at once
    (the driver's unscaling or clipping of every optimizer's parameters before any steps),
    no ``optimizer_<i>`` keys are written; one optimizer stepped several times in a Lightning
    batch writes each ``step()``'s norms at the batch's step: the last one stays, and the
    count keeps the earlier ones' NaN/Inf gradients.

    Args:
        per_param: globs (``fnmatch``, matched against canonical parameter names such as
            ``layers.0.attn.q_proj.weight``, wrapper prefixes like ``module.``/``_orig_mod.``
            removed) of the parameters to also report one by one; ``None`` for none, ``"*"``
            for all. A glob matching no parameter is a ``ValueError`` at run start. A tied
            parameter is selected by any of its names (``*lm_head.weight`` of a head tied to
            the embedding) and reported under its first (``model.embed_tokens.weight``).
        per_param_kinds: which per-parameter and per-group norms to write: ``"grad"``
            and/or ``"param"``.
        group_by: regex (``re.search`` on the canonical names ``per_param`` matches) with
            exactly one capture group: every trainable parameter whose name matches counts in
            the group named by the captured text (``r"layers\.(\d+)\."``: one norm per
            transformer layer, ``l2_norm/grad/group/0``, ``.../group/1``, ...). A group's norm is
            ``sqrt`` of the sum of its members' sums of squares, reduced like the ``global``
            ones (DTensor shards over their ``Shard`` dims, plain experts over ``groups.ep``,
            pipeline stages over ``groups.pp``: in the same collectives, none added); a tied
            parameter counts once, in the group of its first name the regex matches. Every rank
            writes the groups of every stage (their labels gathered once at run start over
            ``groups.ep`` when plain experts are summed there, then over ``groups.pp``), in
            natural order (``"2"`` before ``"10"``). A name the regex does not match, or whose
            group captures nothing, is in no group. A group appears when it starts training
            (unfrozen, or its parameters added during the run: a new label joins the labels,
            except under pipeline or plain expert parallelism, where the run-start labels stay
            and the new one's parameters count in the totals only, warned once). Not a
            string: ``TypeError``; not a valid regex or not one capture group: ``ValueError``;
            matching no parameter (on any pipeline stage or EP rank): ``ValueError`` at run
            start.
        max_nonfinite_names: how many non-finite gradients the warning names.
        expert_pattern: regex (``re.search`` on canonical names) of the plain-tensor parameters
            that differ between expert-parallel ranks (default: a component ``experts``:
            Hugging Face's ``experts.<i>.*`` and fused ``experts.gate_up_proj``, Megatron-LM's
            ``experts.local_experts.<i>.*`` and ``experts.linear_fc1.weight<i>``; not
            ``shared_experts``); used only when ``groups.ep`` has more than one rank. Not a
            string: ``TypeError``; not a valid regex: ``ValueError``.
        log_every_n_steps: interval in optimizer steps (default: the run's).
        writer: where values go (default: the run's writer).

    Keys written (on logging steps):

    ================================  ===========================================================  ======
    key                               meaning                                                      unit
    ================================  ===========================================================  ======
    ``l2_norm/param/global``          L2 norm of all trainable parameters, each counted once       value
    ``l2_norm/grad/global``           L2 norm of all gradients, unscaled, before clipping          value
    ``l2_norm/grad/nonfinite_count``  number of gradient tensors holding a NaN or an Inf           count
    ``l2_norm/grad/<name>``           L2 norm of one parameter's gradient (``per_param`` only)     value
    ``l2_norm/param/<name>``          L2 norm of one parameter (``per_param_kinds`` has "param")   value
    ``l2_norm/grad/optimizer_<i>``    L2 norm of the gradients of optimizer ``i``'s parameters     value
    ``l2_norm/param/optimizer_<i>``   L2 norm of optimizer ``i``'s parameters                      value
    ``l2_norm/grad/group/<label>``    L2 norm of the gradients of one group (``group_by`` only)    value
    ``l2_norm/param/group/<label>``   L2 norm of one group (``per_param_kinds`` has "param")       value
    ================================  ===========================================================  ======

    "value": the unit of the tensor's elements (an L2 norm has the unit of what it measures).
    FSDP1 (``FullyShardedDataParallel``: Lightning's ``FSDPStrategy``, Accelerate's FSDP
    plugin with ``fsdp_version=1``): each unit's flat shards are summed over its
    ``process_group`` under the sharded strategies (HYBRID: the shard group, within one
    replica), not under NO_SHARD, as torch's ``FullyShardedDataParallel.clip_grad_norm_``
    does; only the ``global``, ``optimizer_<i>`` and ``nonfinite_count`` keys are written (a
    flat shard mixes pieces of several parameters: ``per_param`` and ``group_by`` keys are
    left out, warned once), and ``nonfinite_count`` counts flat parameters (one per unit)
    unless ``use_orig_params=True``. DeepSpeed, whose partitions live outside ``p.grad``,
    is refused with a warning (no keys) rather than reported wrongly.
    When a gradient holds NaN/Inf, ``l2_norm/grad/global`` is NaN/Inf too. The first logging
    step of a run with such gradients is warned (``RuntimeWarning``, issued once the values
    reach the host, at the latest by the next logging step): its step and the first
    ``max_nonfinite_names`` bad tensors in parameter order (those held by other pipeline
    stages or expert-parallel ranks are counted, by every rank, but not named). Later ones
    are not warned one by one (a diverged run would warn at every logging step):
    ``nonfinite_count`` shows them step by step, and at the run's end (or when it raises) one more warning says how many
    logging steps of the run had them and the last one's step, when there was more than
    one. A logging step counts once however many ``step()`` calls it writes. The first
    step, its names and the number of such logging steps (``first_nonfinite_step``,
    ``first_nonfinite_names``, ``nonfinite_logging_steps``) are the ``state_dict`` and
    continue across a resume; each run (each ``fit``, a resumed one too) warns at its own
    first such step.
    A gradient that is ``None`` counts 0 in the gradient norms. A grad key (``global``, ``optimizer_<i>``, per parameter) none of whose
    gradients exists on any rank of its reduction (a step without backward: a
    ``training_step`` returning ``None``; warned once) is not written: its norm is undefined,
    not 0. The ranks learn it from counts of the gradients present summed in the norms'
    collectives; only a rank holding none of a key's gradients, which other ranks share,
    reads those counts to the host.

    Example::

        import lightning.pytorch as pl
        from trainvitals import NormMonitor

        trainer = pl.Trainer(callbacks=[NormMonitor(per_param=["*.router.*"])])

        # or in a plain / Accelerate loop
        from trainvitals.adapters.loop import Vitals

        vitals = Vitals([NormMonitor()], log_every_n_steps=10).attach(model, optimizer)
    """

    def __init__(
        self,
        *,
        per_param: str | Sequence[str] | None = None,
        per_param_kinds: Sequence[str] = ("grad",),
        group_by: str | None = None,
        max_nonfinite_names: int = 5,
        expert_pattern: str = r"(?:^|\.)experts\.",
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        self.expert_pattern = compile_regex("expert_pattern", expert_pattern)
        self.per_param = _globs(per_param)
        self.group_by = compile_one_group("group_by", group_by)
        kinds = (per_param_kinds,) if isinstance(per_param_kinds, str) else per_param_kinds
        if not kinds or any(k not in _KINDS for k in kinds):
            raise ValueError(
                f"per_param_kinds must be a non-empty subset of {_KINDS}, got {kinds!r}"
            )
        self.per_param_kinds = tuple(dict.fromkeys(kinds))
        if (
            isinstance(max_nonfinite_names, bool)
            or not isinstance(max_nonfinite_names, int)
            or max_nonfinite_names <= 0
        ):
            raise ValueError(
                f"max_nonfinite_names must be a positive int, got {max_nonfinite_names!r}"
            )
        self.max_nonfinite_names = max_nonfinite_names
        self._model: torch.nn.Module | None = None  # the user's module (wrappers removed)
        # ids of the parameters registered in its modules, at last look: parameters added
        # during training (LoRA adapters) or put in place of others change them
        self._registered: list[int] = []
        self._named: list[tuple[str, torch.nn.Parameter]] = []  # every parameter, frozen too
        self._trainable: tuple[bool, ...] | None = None  # requires_grad of each, at last look
        self._tracked: list[_Tracked] = []
        # the totals of plain-tensor experts are summed over groups.ep (decided at run start,
        # from every parameter, frozen ones too: the same on every rank)
        self._ep_experts = False
        self._selected_names: list[str] = []
        # group_by: the run's group labels (every rank of groups.pp alike, natural order), and
        # each canonical name's label (None: in no group)
        self._group_labels: list[str] = []
        self._label_of: dict[str, str | None] = {}
        self._unsupported = False
        # FSDP1: id of each parameter its units manage -> the groups its flat shard's sums are
        # summed over (None: no FSDP1 in the model)
        self._flat_groups: dict[int, tuple[Any, ...]] | None = None
        self._pending: _PendingFlags | None = None
        # Several optimizers stepped apart: the parts of the step measured so far (written at
        # step_end)
        self._parts: list[_Part] = []
        self._parts_step: int | None = None
        self._measured: set[int] = set()  # ids of the parameters measured in that step
        # One optimizer: the step and part last written (an optimizer stepped twice in a
        # Lightning batch writes twice at one step)
        self._written: tuple[int, _Part] | None = None
        # state kept across checkpoints
        self.first_nonfinite_step: int | None = None
        self.first_nonfinite_names: list[str] = []
        self.nonfinite_logging_steps = 0
        # The warnings of this run (reset at run_start): the first logging step whose gradients
        # hold NaN/Inf is warned, later ones are counted and summed up in one warning at the
        # run's end (a diverged run would otherwise warn at every logging step).
        self._last_counted_step: int | None = None  # (a step written twice counts once)
        self._run_start_count = 0  # nonfinite_logging_steps when this run started
        self._run_warned_step: int | None = None  # the step this run warned about
        self._run_last_step: int | None = None  # the last non-finite logging step of this run

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        """Find the parameters (canonical names) and check the per-parameter globs; a glob
        matching no parameter raises here, before any collective."""
        if ctx.model is None:
            raise ValueError("NormMonitor needs the model: attach it (vitals.attach(model, opt))")
        # An instance reused for another run: what it found in the last run's model is stale
        # (a layout refused there must not silence this run). Its flags are that run's.
        self._report_pending(block=True)
        self._unsupported = False
        self._flat_groups = None
        self._named, self._tracked, self._selected_names, self._trainable = [], [], [], None
        self._model, self._registered = None, []
        self._group_labels, self._label_of = [], {}
        self._parts, self._parts_step, self._measured = [], None, set()
        self._written = None
        self._last_counted_step = None
        self._run_start_count = self.nonfinite_logging_steps  # (restored by a resume)
        self._run_warned_step = self._run_last_step = None
        model = unwrap_model(ctx.model)
        sharding = flat_sharding(model, ctx)
        units = _fsdp1_units(model, ctx) if sharding == FSDP1 else []
        if sharding == DEEPSPEED or (sharding == FSDP1 and not units):
            # Plain tensors holding flat shards, and (FSDP1 units out of reach: the inner
            # module of a wrapper the monitor was not given) no group to add them over: a norm
            # would be wrong.
            self.warn_once("layout", f"{sharding} is not supported; no norms are written")
            self._unsupported = True
            return
        if units:
            flat = _fsdp1_shard_groups(units)
            if flat is None:
                self.warn_once(
                    "layout",
                    "FSDP1 (FullyShardedDataParallel) whose units lack torch's handle "
                    "attributes is not supported; no norms are written",
                )
                self._unsupported = True
                return
            unreached = [
                n for n, p in model.named_parameters() if is_flat_shard(p) and id(p) not in flat
            ]
            if unreached:
                # A flat shard (or a view into one) of a unit the monitor cannot see (attached
                # to the inner module of an outer unit: the root's own flat parameter is out of
                # reach): its pieces would be taken for whole tensors, and the ranks disagree.
                self.warn_once(
                    "layout",
                    f"FSDP1 (FullyShardedDataParallel): {len(unreached)} parameter(s) (e.g. "
                    f"{unreached[0]!r}) belong to a unit outside the model the monitor was "
                    "given (give it the FSDP-wrapped model itself); no norms are written",
                )
                self._unsupported = True
                return
            self._flat_groups = flat
            if self.per_param or self.group_by is not None:
                # A flat shard mixes pieces of several parameters (use_orig_params=False) and
                # holds padding; per-parameter keys would need FSDP internals to be right.
                self.warn_once(
                    "fsdp1-per-param",
                    "under FSDP1 (FullyShardedDataParallel) only the global and per-optimizer "
                    "norms are written; per_param and group_by keys are left out",
                )
        self._model = model
        self._registered = _registered_ids(model)
        self._named = canonical_named_parameters(model)
        ep_size = group_size(ctx.groups.ep)
        self._ep_experts = ep_size > 1 and any(self._is_expert(n, p) for n, p in self._named)
        if (
            ep_size > 1
            and not self._ep_experts
            and all(local_tensor(p) is p for _, p in self._named)
        ):
            # (the same layout on every rank: every rank warns alike)
            self.warn_once(
                "ep_experts",
                f"groups.ep has {ep_size} ranks but no parameter name matches expert_pattern "
                f"{self.expert_pattern.pattern!r}: the totals count this rank's experts only; "
                "pass the pattern of your expert parameters' names",
            )
        if self._flat_groups is None:
            self._check_globs(ctx)
            self._find_groups(ctx)
        self._track_trainable()

    def before_optimizer_step(self, ctx: RunContext) -> None:
        """On logging steps: norms of the parameters and of the complete gradients."""
        if not self.should_log(ctx) or self._unsupported:
            return
        # The flags of the last logging step are reported before this step's replace them.
        self._report_pending(block=True)
        self._track_trainable()
        if not ctx.stepping_apart:
            # One optimizer, or every gradient shown at once: written now.
            part = self._measure(ctx, None, self._tracked, set())
            written = self._written
            if written is not None and written[0] == ctx.step:
                # The optimizer stepped again in this step (Lightning's manual optimization):
                # these keys replace the earlier step()'s in the writer; its NaN/Inf stay counted.
                self._carry_flags(part, written[1].nonfinite_by_param())
            self._written = (ctx.step, part)
            self._write(ctx, [part], ctx.step)
            return
        # Several optimizers stepped apart: this optimizer's parameters (and, at the step's
        # first optimizer.step(), those of no optimizer), each measured once per step; the
        # step's keys are written at step_end, once every optimizer of the batch has stepped.
        if self._parts_step != ctx.step:
            self._parts, self._parts_step, self._measured = [], ctx.step, set()
        owned, here = ctx.stepped_parameters((t.param for t in self._tracked), not self._parts)
        # The same optimizer stepped again in this step (a critic stepped k times per batch):
        # its parameters are measured again and this measurement replaces the earlier ones,
        # so the step shows the gradients its last update used, as a single-optimizer run
        # shows its step's; a gradient that held NaN/Inf at an earlier step() stays counted.
        earlier_bad = self._forget_earlier_steps(ctx.stepping_index)
        tracked = [
            t for t in self._tracked if id(t.param) in here and id(t.param) not in self._measured
        ]
        self._measured.update(id(t.param) for t in tracked)
        part = self._measure(ctx, ctx.stepping_index, tracked, owned)
        self._carry_flags(part, earlier_bad)
        self._parts.append(part)

    @staticmethod
    def _carry_flags(part: _Part, flags: dict[int, torch.Tensor]) -> None:
        """Give ``part`` the non-finite flags (by parameter ``id``) of the measurements it
        replaces."""
        if not flags or not part.tracked:
            return
        no = torch.zeros((), dtype=torch.bool, device=part.sq.device)
        part.earlier_bad = torch.stack(
            [flags.get(id(t.param), no).to(no.device) for t in part.tracked]
        )

    def _forget_earlier_steps(self, optimizer: int | None) -> dict[int, torch.Tensor]:
        """Drop the parameters of ``optimizer`` from the parts its earlier ``step()`` calls
        of this step measured (they are measured again now); return their non-finite flags
        by parameter ``id``. Parameters in no optimizer, measured with the step's first
        ``step()``, stay in their part."""
        flags: dict[int, torch.Tensor] = {}
        for k, part in enumerate(self._parts):
            if part.optimizer != optimizer or not part.owned:
                continue
            self._parts[k], dropped = part.without(set(part.owned))
            flags.update(dropped)
            self._measured.difference_update(dropped)
        return flags

    def step_end(self, ctx: RunContext) -> None:
        """Write the norms of a step whose optimizers were stepped apart; name the non-finite
        gradients of the last logging step once their flags arrived."""
        self._written = None
        if self._parts:
            parts, step = self._parts, self._parts_step
            self._parts, self._parts_step, self._measured = [], None, set()
            if step == ctx.step:  # (parts of a step that never ended are dropped)
                self._write(ctx, parts, step)
        self._report_pending(block=False)

    def collective_key(self, hook: str, ctx: RunContext) -> Any:
        # Which optimizer steps decides which parameters (and so which collectives) a call
        # measures; step_end reduces over pipeline stages only when it writes.
        key = super().collective_key(hook, ctx)
        if hook == "before_optimizer_step" and ctx.stepping_apart:
            # (the step's first step() also measures the parameters in no optimizer; a later
            # one of an optimizer that stepped before measures its parameters again)
            first = self._parts_step != ctx.step or not self._parts
            stepped = () if first else tuple(sorted({p.optimizer for p in self._parts}, key=str))
            return (*key, ctx.stepping_index, stepped)
        if hook == "step_end":
            return (*key, bool(self._parts))
        return key

    def run_end(self, ctx: RunContext) -> None:
        self._report_pending(block=True)
        self._warn_nonfinite_summary()

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._report_pending(block=True)
        self._warn_nonfinite_summary()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        # Flags still on their way from the device (CUDA) belong to a step this checkpoint
        # follows: wait for them, or a first non-finite step would be missing after a resume.
        self._report_pending(block=True)
        return {
            "first_nonfinite_step": self.first_nonfinite_step,
            "first_nonfinite_names": list(self.first_nonfinite_names),
            "nonfinite_logging_steps": self.nonfinite_logging_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.first_nonfinite_step = state_dict.get("first_nonfinite_step")
        self.first_nonfinite_names = list(state_dict.get("first_nonfinite_names", []))
        self.nonfinite_logging_steps = int(state_dict.get("nonfinite_logging_steps", 0))
        # (a restore in the middle of a run, a rollback: the steps replayed from the checkpoint
        # on are counted again, and this run's count does not go below its start)
        self._last_counted_step = None
        self._run_start_count = min(self._run_start_count, self.nonfinite_logging_steps)
        # A restore in the middle of a step (a rollback) replays it from its start: what was
        # measured of it belongs to the abandoned timeline.
        self._parts, self._parts_step, self._measured = [], None, set()
        self._written = None

    # ------------------------------------------------------------------ internals

    def _measure(
        self, ctx: RunContext, optimizer: int | None, tracked: list[_Tracked], owned: set[int]
    ) -> _Part:
        """Sums of squares of ``tracked``'s parameters and gradients, reduced over their shard
        groups (every rank measures the same list: the collectives depend on it)."""
        grads = [t.param.grad for t in tracked]
        if tracked and all(g is None for g in grads):
            self.warn_once("no-grads", "no parameter has a gradient at a logging step")
        tensors = [t.param for t in tracked] + grads
        try:
            sq = local_sq_norms(tensors)
        except Exception as exc:
            # Rank-local (say, out of memory): raising would skip this rank's collectives
            # below and leave the other ranks waiting. -inf marks "not measured" (a sum of
            # squares is never negative): it goes through the sums, its norm is NaN and it
            # is not counted as a non-finite gradient.
            self.tolerate_failure(
                "norm-failure", "computing the norms", exc, "this logging step's norms are NaN"
            )
            device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
            sq = torch.full((len(tensors),), -math.inf, dtype=torch.float64, device=device)
        grad_groups = [
            t.groups if g is None or t.flat else sharding_groups(g)
            for t, g in zip(tracked, grads, strict=True)
        ]
        has_grad = [g is not None for g in grads]
        # Whether each gradient is present rides in the sums' collectives, over its gradient's
        # groups (no collective added): a gradient None on every rank of its reduction has no
        # norm (a step without backward), one None on some ranks only counts 0 there.
        present = host_to_device(torch.tensor(has_grad, dtype=torch.float64), sq.device)
        n = len(tracked)
        reduced = reduce_sq_norms(
            torch.cat([sq, present]), [t.groups for t in tracked] + grad_groups * 2
        )
        selected = set(self._selected_names)
        return _Part(
            optimizer=optimizer,
            tracked=tracked,
            has_grad=has_grad,
            shared=[bool(g) for g in grad_groups],
            owned=[i for i, t in enumerate(tracked) if id(t.param) in owned],
            selected=[i for i, t in enumerate(tracked) if t.name in selected],
            sq=reduced[: 2 * n],
            present=reduced[2 * n :],
        )

    def _write(self, ctx: RunContext, parts: list[_Part], step: int) -> None:
        """Write the step's norms from its parts (one, or one per optimizer stepped)."""
        pipeline = group_size(ctx.groups.pp) > 1
        # A pipeline stage (or an expert-parallel rank) without trainable parameters (frozen)
        # still takes part in the totals' collectives over the stages (and groups.ep), with
        # zeros: skipping it would leave the others waiting in that all-reduce.
        if not pipeline and not self._ep_experts and not any(p.tracked for p in parts):
            return
        device = next((p.sq.device for p in parts if p.tracked), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        param_sq = [p.sq[: len(p.tracked)] for p in parts]
        grad_sq = [p.sq[len(p.tracked) :] for p in parts]
        bad = [p.nonfinite() for p in parts]
        # Plain-tensor experts (other experts on each EP rank) are summed apart, then over
        # groups.ep; ``split(x, mask)``: the (others, experts) sums of a per-parameter ``x``.
        ep = self._ep_experts
        masks = [_expert_mask(p) if ep else None for p in parts]

        def split(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[Any, Any]:
            x = x.to(torch.float64)
            if mask is None:
                return x.sum().to(device), zero
            none = torch.zeros((), dtype=x.dtype, device=x.device)
            mask = mask.to(x.device)
            return (
                torch.where(mask, none, x).sum().to(device),
                torch.where(mask, x, none).sum().to(device),
            )

        rows: list[Any] = []
        expert_rows: list[Any] = []
        for per_part in (param_sq, grad_sq, bad, [p.present for p in parts]):
            # (the last: gradients present, summed counts)
            sums = [split(x, m) for x, m in zip(per_part, masks, strict=True)]
            rows.append(sum((a for a, _ in sums), zero))
            expert_rows.append(sum((b for _, b in sums), zero))
        # optimizer index -> its rows (param, grad, gradients present)
        by_optimizer: dict[int, list[int]] = {}
        for k, part in enumerate(parts):
            if part.optimizer is None:  # (one optimizer, or all at once: no optimizer_<i> keys)
                continue
            index = index_on(part.owned, part.sq.device)
            mask = masks[k]
            mask = None if mask is None else mask.index_select(0, index.to(mask.device))
            owned = (
                param_sq[k].index_select(0, index),
                grad_sq[k].index_select(0, index),
                part.present.index_select(0, index.to(part.present.device)),
            )
            if part.optimizer not in by_optimizer:
                by_optimizer[part.optimizer] = [len(rows), len(rows) + 1, len(rows) + 2]
                rows += [zero, zero, zero]
                expert_rows += [zero, zero, zero]
            # (an optimizer stepped several times in the step: its parameters are in the
            # part of its last step(), the earlier parts hold none of them)
            for r, x in zip(by_optimizer[part.optimizer], owned, strict=True):
                a, b = split(x, mask)
                rows[r] = rows[r] + a
                expert_rows[r] = expert_rows[r] + b
        # group_by: per label, 4 more rows (param, grad, gradients present, members), in the
        # same totals, so they ride the same collectives over groups.ep and groups.pp
        n_groups = len(self._group_labels)
        grouped, grouped_experts = _group_rows(parts, masks, n_groups, device)
        first_group = len(rows)
        totals = torch.cat([torch.stack([r.to(device) for r in rows]), grouped])
        if ep:
            # (one collective on every EP rank, experts tracked here or not: the ranks decided
            # at run start, from the same model layout)
            experts = torch.cat([torch.stack([r.to(device) for r in expert_rows]), grouped_experts])
            totals = totals + all_reduce_coalesced([experts], "sum", ctx.groups.ep)[0]
        if pipeline:
            totals = all_reduce_coalesced([totals], "sum", ctx.groups.pp)[0]
        # A grad key whose gradients are None on every rank of its reduction (a step without
        # backward) is not written: its norm is undefined, not 0. ``present``: key -> True or
        # False where the host knows it (this rank holds one of its gradients, or they are not
        # reduced with other ranks), else their reduced count, read below in one transfer.
        present: dict[str, bool | torch.Tensor] = {
            "l2_norm/grad/global": _presence(
                [h for p in parts for h in p.has_grad],
                pipeline or ep or any(any(p.shared) for p in parts),
                totals[3],
            )
        }
        values: dict[str, Any] = {
            "l2_norm/param/global": totals[0].sqrt(),
            "l2_norm/grad/global": totals[1].sqrt(),
            "l2_norm/grad/nonfinite_count": totals[2],
        }
        for optimizer, (i, j, c) in sorted(by_optimizer.items()):
            values[f"l2_norm/param/optimizer_{optimizer}"] = totals[i].sqrt()
            key = f"l2_norm/grad/optimizer_{optimizer}"
            values[key] = totals[j].sqrt()
            mine = [(p, k) for p in parts if p.optimizer == optimizer for k in p.owned]
            present[key] = _presence(
                [p.has_grad[k] for p, k in mine],
                pipeline or ep or any(p.shared[k] for p, k in mine),
                totals[c],
            )
        self._group_values(parts, totals, first_group, pipeline or ep, values, present)
        for part in parts:
            n = len(part.tracked)
            norms = part.sq.sqrt() if part.selected else part.sq
            for i in part.selected:
                name = part.tracked[i].name
                if "grad" in self.per_param_kinds:
                    key = f"l2_norm/grad/{name}"
                    values[key] = norms[n + i]
                    present[key] = _presence([part.has_grad[i]], part.shared[i], part.present[i])
                if "param" in self.per_param_kinds:
                    values[f"l2_norm/param/{name}"] = norms[i]
        unknown = {k: v for k, v in present.items() if isinstance(v, torch.Tensor)}
        if unknown:  # (a logging step on which this rank holds none of some keys' gradients)
            counts = torch.stack([v.to(device) for v in unknown.values()]).tolist()
            present.update(zip(unknown, (c > 0 for c in counts), strict=True))
        for key, known in present.items():
            if not known:
                del values[key]
        self.write(ctx, values, step)
        names = [t.name for part in parts for t in part.tracked]
        flags = torch.cat([b.to(device) for b in bad]) if bad else torch.zeros(0, dtype=torch.bool)
        self._pending = _to_host(step, names, flags, totals[2])
        self._report_pending(block=False)

    def _group_values(
        self,
        parts: list[_Part],
        totals: torch.Tensor,
        first: int,
        spread: bool,
        values: dict[str, Any],
        present: dict[str, bool | torch.Tensor],
    ) -> None:
        """The ``group/<label>`` keys, from the group rows of ``totals`` (from ``first`` on);
        ``spread``: other ranks (pipeline stages, EP ranks) add members to the groups."""
        n_groups = len(self._group_labels)
        # label position -> (this rank's members measured at the step, as (part, position))
        members: dict[int, list[tuple[_Part, int]]] = {}
        for part in parts:
            for k, t in enumerate(part.tracked):
                if t.group is not None:
                    members.setdefault(t.group, []).append((part, k))
        for g, label in enumerate(self._group_labels):
            mine = members.get(g, [])
            param_row, grad_row, present_row, member_row = (
                first + g + r * n_groups for r in range(4)
            )
            if "grad" in self.per_param_kinds:
                key = f"l2_norm/grad/group/{label}"
                values[key] = totals[grad_row].sqrt()
                present[key] = _presence(
                    [p.has_grad[k] for p, k in mine],
                    spread or any(p.shared[k] for p, k in mine),
                    totals[present_row],
                )
            if "param" in self.per_param_kinds:
                # (a group none of whose members was measured, all frozen: no key, not 0)
                key = f"l2_norm/param/group/{label}"
                values[key] = totals[param_row].sqrt()
                present[key] = _presence([bool(mine)], spread, totals[member_row])

    def _track_trainable(self) -> None:
        """Track the parameters that require a gradient now (deduplicated) and select the
        per-parameter ones. Training can freeze or unfreeze parameters after run start (Lightning's
        ``BackboneFinetuning``) and add new ones (LoRA adapters); every rank changes the same
        ones at the same step, so the collectives stay alike. A look at host attributes, on
        logging steps only."""
        if self._model is not None:
            registered = _registered_ids(self._model)
            if registered != self._registered:
                # (a parameter added or put in place of another since the last look: the
                # names found at run start would leave it out of every norm)
                self._registered = registered
                ctx = self._ctx
                self._named = keep_sharded_parameters(
                    canonical_named_parameters(self._model),
                    dict(self._named),
                    optimized_ids(ctx.optimizers if ctx else ()),
                )
                self._label_new_parameters()
                self._trainable = None
        # A parameter with no values is left out rather than making every norm fail (it
        # cannot be read) and the monitor disabled: on the meta device (deferred
        # initialisation never materialised) with a warning; a lazy module's weight before
        # its first forward silently, as it joins when it materialises (the same object).
        trainable = tuple(p.requires_grad and not has_no_values(p) for _, p in self._named)
        if trainable == self._trainable:
            return
        self._trainable = trainable
        self.warn_meta_parameters(
            [n for n, p in self._named if p.requires_grad and p.is_meta], "the norms"
        )
        named = [(n, p) for (n, p), t in zip(self._named, trainable, strict=True) if t]
        grouped = group_named_tensors(named)
        position = {label: i for i, label in enumerate(self._group_labels)}
        flat = self._flat_groups or {}
        self._tracked = [
            _Tracked(
                name,
                p,
                flat[id(p)] if id(p) in flat else sharding_groups(p),
                self._ep_experts and self._is_expert(name, p),
                position.get(self._label_of.get(name)),  # type: ignore[arg-type]
                id(p) in flat,
            )
            for name, p, _ in grouped
        ]
        # A tied parameter is selected by any of its names (``*lm_head.weight`` of a head tied
        # to the embedding) and reported under its first, the name it is counted under.
        # (FSDP1: no per-parameter keys, warned at run start)
        globs = self.per_param if self._flat_groups is None else ()
        self._selected_names = [
            name
            for name, _, aliases in grouped
            if any(fnmatch.fnmatchcase(a, glob) for a in aliases for glob in globs)
        ]

    def _label_new_parameters(self) -> None:
        """``group_by``: the labels of parameters added after run start. Without pipeline
        stages or EP ranks to agree with, a new label joins the run's labels (every rank holds
        the same names). With them, the labels were gathered once at run start and a new one
        would change the length of the totals on some ranks only: its parameters count in the
        totals but in no group, warned once."""
        if self.group_by is None or self._flat_groups is not None:
            return
        ctx = self._ctx
        spread = ctx is not None and (
            group_size(ctx.groups.pp) > 1 or (self._ep_experts and group_size(ctx.groups.ep) > 1)
        )
        known = set(self._group_labels)
        new: set[str] = set()
        for _, _, aliases in group_named_tensors(self._named):
            if aliases[0] in self._label_of:
                continue
            label = next(filter(None, map(self._label, aliases)), None)
            if label is not None and label not in known:
                new.add(label)
                if spread:
                    label = None
            self._label_of.update(dict.fromkeys(aliases, label))
        if not new:
            return
        if spread:
            self.warn_once(
                "new-labels",
                f"group_by labels {sorted(new, key=natural_order)} appeared after run start "
                "(parameters added during training); with pipeline stages or EP ranks the "
                "labels are gathered once, at run start: these parameters count in the totals "
                "but in no group",
            )
            return
        self._group_labels = sorted(known | new, key=natural_order)

    def _is_expert(self, name: str, param: torch.Tensor) -> bool:
        """A plain-tensor parameter of one expert (a DTensor expert carries its own shard
        groups)."""
        return local_tensor(param) is param and self.expert_pattern.search(name) is not None

    def _find_groups(self, ctx: RunContext) -> None:
        """``group_by``: each parameter's group label, and the run's labels: this rank's, made
        the union over the pipeline stages (and over the expert-parallel ranks, whose experts
        differ) with one object gather at run start, so that every rank carries the same group
        rows in the totals' collectives."""
        if self.group_by is None:
            return
        # Every parameter, frozen ones too (they may be unfrozen later), once: a tied one
        # under its first name that the regex matches (selected by any of its names, like
        # per_param's globs; counted once).
        for _, _, aliases in group_named_tensors(self._named):
            label = next(filter(None, map(self._label, aliases)), None)
            self._label_of.update(dict.fromkeys(aliases, label))
        labels = {label for label in self._label_of.values() if label is not None}
        names = [name for name, _ in self._named]
        message = (
            f"group_by {self.group_by.pattern!r} matches no parameter; names look like {names[:5]}"
        )
        ep = ctx.groups.ep if self._ep_experts else None
        # over groups.ep first: a stage without plain experts gathers over groups.pp only, so
        # each stage-mate it meets there must hold its EP ranks' union already (pp first, a
        # dense stage got one EP rank's expert labels and the totals' lengths differed)
        spread = [g for g in (ep, ctx.groups.pp) if group_size(g) > 1]
        if not labels and not spread:
            raise ValueError(f"NormMonitor: {message}")  # (before any collective)
        for group in spread:  # (other stages', other EP ranks' labels)
            labels = {label for got in all_gather_objects(sorted(labels), group) for label in got}
        if not labels:  # (the same union on every rank: every rank raises, none waits)
            raise ValueError(f"NormMonitor: {message} on any pipeline stage or EP rank")
        self._group_labels = sorted(labels, key=natural_order)

    def _label(self, name: str) -> str | None:
        """``name``'s group label: the text the ``group_by`` regex captures (None: no match, or
        the group captured nothing)."""
        match = self.group_by.search(name) if self.group_by is not None else None
        return (match.group(1) or None) if match is not None else None

    def _check_globs(self, ctx: RunContext) -> None:
        # Against every parameter, frozen ones too (they may be unfrozen later), by each of
        # its names (a tied parameter's keys use its first).
        grouped = group_named_tensors(self._named)
        names = [name for name, _, _ in grouped]
        aliases = [a for _, _, group in grouped for a in group]
        unmatched = [
            g for g in self.per_param if not any(fnmatch.fnmatchcase(a, g) for a in aliases)
        ]
        if unmatched:
            message = f"per_param globs {unmatched} match no parameter; names look like {names[:5]}"
            if group_size(ctx.groups.pp) > 1:
                # Another pipeline stage may hold them; raising on one stage would hang the others.
                self.warn_once("unmatched", message)
            else:
                raise ValueError(f"NormMonitor: {message}")

    def _report_pending(self, *, block: bool) -> None:
        pending = self._pending
        if pending is None:
            return
        if pending.event is not None:
            if not block and not pending.event.query():
                return
            pending.event.synchronize()
        self._pending = None
        bad = [pending.names[i] for i in pending.flags.nonzero().flatten().tolist()]
        # NaN/Inf gradients held by other pipeline stages or expert-parallel ranks are in the
        # reduced count only: every rank counts the step alike, and the warning says so
        total = len(bad) if pending.count is None else max(len(bad), int(pending.count))
        if not total:
            return
        if pending.step == self._last_counted_step:
            # The same step written again (one optimizer stepped twice in a Lightning batch;
            # its earlier step()'s flags are carried into this write): one logging step.
            return
        self._last_counted_step = pending.step
        self.nonfinite_logging_steps += 1
        self._run_last_step = pending.step
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = pending.step
            self.first_nonfinite_names = bad[: self.max_nonfinite_names]
        if self._run_warned_step is not None:
            return  # counted, summed up at the run's end
        self._run_warned_step = pending.step
        if self._is_reporting_rank():
            shown = ", ".join(bad[: self.max_nonfinite_names])
            extra = len(bad) - self.max_nonfinite_names
            more = f" and {extra} more" if extra > 0 else ""
            if total > len(bad):
                more += (
                    f"{'; ' if bad else ''}{total - len(bad)} held by other pipeline stages or "
                    "expert-parallel ranks (not named here)"
                )
            warnings.warn(
                f"NormMonitor: {total} gradient(s) hold NaN/Inf at step {pending.step}: "
                f"{shown}{more} (parameter order); later logging steps with NaN/Inf gradients "
                "are not warned one by one (l2_norm/grad/nonfinite_count has each step's "
                "count; a summary at the end of the run)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _warn_nonfinite_summary(self) -> None:
        """At the run's end: how many logging steps of the run had NaN/Inf gradients, when
        more than the one warned about."""
        warned, last = self._run_warned_step, self._run_last_step
        earlier = self._run_start_count  # (counted by the run this one resumed)
        in_run = self.nonfinite_logging_steps - earlier
        self._run_start_count = self.nonfinite_logging_steps  # (summed up once)
        if warned is None or last is None or in_run <= 1 or not self._is_reporting_rank():
            return
        before = (
            f"; {self.nonfinite_logging_steps} in all since step {self.first_nonfinite_step} "
            "(nonfinite_logging_steps, which a resume continues)"
            if earlier > 0
            else ""
        )
        warnings.warn(
            f"NormMonitor: gradients held NaN/Inf at {in_run} logging steps of this run, "
            f"from step {warned} to step {last} (only the first was warned){before}",
            RuntimeWarning,
            stacklevel=2,
        )

    def _is_reporting_rank(self) -> bool:
        ctx = self._ctx
        if ctx is None:
            return True
        g = ctx.groups
        return all(group_rank(x) == 0 for x in (g.dp, g.tp, g.cp, g.ep))


def _fsdp1_units(model: torch.nn.Module, ctx: RunContext) -> list[torch.nn.Module]:
    """The FSDP1 (``FullyShardedDataParallel``) instances in ``model`` and around it: Lightning's
    ``FSDPStrategy`` wraps the ``LightningModule`` itself (``ctx.model``), its root unit is
    only in ``trainer.strategy.model``."""
    roots = [model]
    outer = getattr(getattr(ctx.trainer, "strategy", None), "model", None)
    if isinstance(outer, torch.nn.Module) and outer is not model:
        roots.append(outer)
    units = {
        id(m): m
        for root in roots
        for m in root.modules()
        if type(m).__name__ == "FullyShardedDataParallel"
    }
    return list(units.values())


def _fsdp1_shard_groups(units: list[torch.nn.Module]) -> dict[int, tuple[Any, ...]] | None:
    """id of each parameter the FSDP1 ``units`` manage -> the groups its local sums of squares
    are summed over (None: a unit lacks torch's attributes, not recognised).

    The registered parameters are the units' ``FlatParameter`` s (this rank's flat shard), or
    with ``use_orig_params=True`` the original parameters, views of the pieces of them in
    this rank's shard (empty where none). Either way each rank of a unit's ``process_group``
    holds a disjoint part and the padding is zeros, so a sum of squares is the SUM over that
    group under a sharded strategy (FULL_SHARD, SHARD_GRAD_OP; HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2, whose ``process_group`` is the shard group within one replica: the
    replicas are not summed), and is not reduced under NO_SHARD (replicas). This is how
    torch's ``FullyShardedDataParallel.clip_grad_norm_`` (torch/distributed/fsdp/
    fully_sharded_data_parallel.py) takes the total norm: ``handle.uses_sharded_strategy``
    sorts the parameters, the sharded ones' local sums are all-reduced over
    ``self.process_group``, the others added once. Parameters of no unit (ignored modules)
    are absent here and not reduced: each rank's own values, as torch's total takes them
    (FSDP1 does not reduce their gradients, so the ranks' may differ; rank 0's is written)."""
    out: dict[int, tuple[Any, ...]] = {}
    for unit in units:
        if "_handle" not in vars(unit):
            return None
        handle = unit._handle
        if handle is None:
            continue  # a unit without parameters of its own (all in its children)
        try:
            flat = handle.flat_param
            params = list(flat._params) if handle._use_orig_params else [flat]
            group = unit.process_group
            sharded = bool(handle.uses_sharded_strategy)
        except (AttributeError, TypeError):
            return None
        groups = (group,) if sharded and group_size(group) > 1 else ()
        out.update(dict.fromkeys(map(id, params), groups))
    return out


def _registered_ids(model: torch.nn.Module) -> list[int]:
    """The ids of the parameters registered in ``model``'s modules, in module order: a cheap
    look (no names built) at whether parameters were added or replaced since the last one."""
    return [id(p) for m in model.modules() for p in m._parameters.values()]


def _expert_mask(part: _Part) -> torch.Tensor | None:
    """bool per parameter of ``part``: a plain-tensor expert (None: there is none)."""
    flags = [t.expert for t in part.tracked]
    if not any(flags):
        return None
    return host_to_device(torch.tensor(flags, dtype=torch.bool), part.sq.device)


def _group_rows(
    parts: list[_Part], masks: list[torch.Tensor | None], n_groups: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_by``: per group, the sums over its members in ``parts`` of the (param, grad)
    sums of squares (already reduced over their shards), of the gradients present and of the
    members, as one float64 vector ``[4 * n_groups]`` (row-major: all param sums, then all
    grad sums, ...); the plain-tensor experts' (``masks``) apart, in the second vector."""
    out = torch.zeros(4, n_groups, dtype=torch.float64, device=device)
    experts = torch.zeros_like(out)
    if n_groups:
        for part, mask in zip(parts, masks, strict=True):
            n = len(part.tracked)
            if not n or all(t.group is None for t in part.tracked):
                continue
            index = [n_groups if t.group is None else t.group for t in part.tracked]
            x = part.sq.to(device)
            rows = torch.stack(
                [x[:n], x[n:], part.present.to(device), torch.ones_like(part.present).to(device)]
            )
            where = index_on(index, device)
            sums, expert_sums = sums_by_group(rows, where, n_groups, mask)
            out += sums
            if expert_sums is not None:
                experts += expert_sums
    return out.flatten(), experts.flatten()


def _presence(has: list[bool], shared: bool, count: torch.Tensor) -> bool | torch.Tensor:
    """Whether some gradient of a key is present on some rank of its reduction: known on the
    host when this rank holds one (``has``) or when none is reduced with other ranks
    (``shared`` false); otherwise the reduced count of present gradients (on the device)."""
    if any(has):
        return True
    return count if shared else False


def _globs(per_param: str | Sequence[str] | None) -> tuple[str, ...]:
    if per_param is None:
        return ()
    if isinstance(per_param, str):
        per_param = (per_param,)
    if not isinstance(per_param, Sequence) or not all(isinstance(g, str) and g for g in per_param):
        raise TypeError(
            f"per_param must be None, a glob or a list of non-empty globs, got {per_param!r}"
        )
    return tuple(per_param)


def _to_host(
    step: int, names: list[str], flags: torch.Tensor, count: torch.Tensor
) -> _PendingFlags:
    """Start copying the flags and the count to the host without waiting (CUDA: pinned memory
    + event)."""
    if flags.device.type == "cuda" or count.device.type == "cuda":
        host, host_count = (
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (flags, count)
        )
        host.copy_(flags, non_blocking=True)
        host_count.copy_(count, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _PendingFlags(step, names, host, event, host_count)
    return _PendingFlags(step, names, flags.cpu(), None, count.cpu())
