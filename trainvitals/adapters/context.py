"""What callbacks know about a run, shared by the Lightning adapter and the loop driver."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainvitals.adapters.fanout_writer import _UNSET, _scalar_args, _tagged_scalars_args
from trainvitals.distributed import ProcessGroups, global_rank, group_size, world_group
from trainvitals.stats.norms import optimized_ids

__all__ = [
    "BatchInfo",
    "ReplayWriter",
    "RunContext",
    "infer_batch_size",
    "infer_num_tokens",
    "needs_replay_floor",
]


@dataclass
class BatchInfo:
    """One training micro-batch as seen by the callbacks.

    ``batch_size`` (samples) and ``num_tokens`` are ``None`` when unknown; see
    :func:`infer_batch_size` and :func:`infer_num_tokens` for the defaults used under Lightning.
    """

    batch: Any = None
    batch_size: int | None = None
    num_tokens: int | None = None


@dataclass
class RunContext:
    """What a callback needs to know about the run; built once by the Lightning adapter or the
    driver and shared by all callbacks of that run.

    ``step`` is the 0-based index of the optimizer step in progress; ``micro_batch`` the 0-based
    index of the micro-batch within it; ``micro_batches_in_step`` how many micro-batches of the
    current step have started (at ``on_step_end``: the step's number of micro-batches);
    ``step_increment`` how far the step in progress advances ``step``: 1, except under
    Lightning's manual optimization with several optimizers stepped per batch, where
    ``trainer.global_step`` (and so ``step``) counts every ``optimizer.step()``.
    ``step_gap``: how far ``step`` is past the first step of the previous batch that stepped
    (that batch's ``step_increment``; 1 at a run's first step and whenever every batch is one
    step). Known when a batch starts, unlike its own ``step_increment``, so the logging
    decision (:meth:`~trainvitals.callbacks.base.VitalsCallback.should_log`) can use it from
    ``micro_batch_start`` to ``step_end`` alike.
    ``trainer``: the Lightning ``Trainer`` (Lightning runs); ``accelerator``: the Accelerate
    ``Accelerator`` given to the driver (``framework == "accelerate"``): where the run computes
    (``accelerator.device``) and its ``mixed_precision``.
    ``stepping_optimizer``: during ``before_optimizer_step``, the optimizer whose ``step()``
    is about to run when the gradients are shown per optimizer (Lightning passes it to every
    ``on_before_optimizer_step``; the driver sets it with several attached optimizers stepped
    apart); ``None`` when every gradient is shown at once.
    ``start_step``: the step the run started at, the checkpoint's step on a resume (the
    writer's :meth:`~trainvitals.adapters.FanoutWriter.resume_at`).
    ``replay_floor``: set when the run went back to an earlier step (a rollback to a
    checkpoint in the same process): the first step that the writers which outlived the
    rollback have not seen yet (see :class:`ReplayWriter`); those are the callbacks' own
    ``writer=`` and, when ``replay_run_writer``, ``writer`` (a writer given to the driver).
    """

    writer: Any
    groups: ProcessGroups
    model: torch.nn.Module | None = None
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    max_steps: int | None = None
    num_training_batches: int | None = None
    max_epochs: int | None = None
    run_dir: Path = Path("runs")
    framework: str = "loop"
    trainer: Any = None
    accelerator: Any = None
    step: int = 0
    micro_batch: int = 0
    micro_batches_in_step: int = 0
    step_increment: int = 1
    step_gap: int = 1
    in_validation: bool = False
    start_step: int = 0
    stepping_optimizer: Any = None
    replay_floor: int | None = None
    replay_run_writer: bool = False
    replay_warned: bool = False

    @property
    def global_rank(self) -> int:
        return global_rank()

    @property
    def world_size(self) -> int:
        return group_size(world_group())

    @property
    def device(self) -> torch.device:
        if self.model is not None:
            for p in self.model.parameters():
                return p.device
        return torch.device("cpu")

    @property
    def stepping_apart(self) -> bool:
        """Several optimizers stepped apart (a GAN): ``before_optimizer_step`` runs once per
        ``optimizer.step()``, for :attr:`stepping_optimizer`, not once for every gradient."""
        return self.stepping_optimizer is not None and len(self.optimizers) > 1

    @property
    def stepping_index(self) -> int | None:
        """The index of :attr:`stepping_optimizer` in :attr:`optimizers` (``None``: none)."""
        stepping = self.stepping_optimizer
        return next((i for i, o in enumerate(self.optimizers) if o is stepping), None)

    def stepped_parameters(
        self, parameters: Iterable[torch.Tensor], first: bool
    ) -> tuple[set[int], set[int]]:
        """With :attr:`stepping_apart`: ``(owned, measured)``, the ids of the stepping
        optimizer's parameters, and of those among ``parameters`` that a callback measures at
        this ``step()``: its own, and at the batch's ``first`` step() also those in no
        optimizer (nothing else steps them)."""
        owned = optimized_ids([self.stepping_optimizer])
        if not first:
            return owned, owned
        every = optimized_ids(self.optimizers)
        return owned, owned | {id(p) for p in parameters if id(p) not in every}


class ReplayWriter:
    """A :class:`~trainvitals.adapters.FanoutWriter` that outlived a rollback
    (``Vitals(writer=...)``, a callback's own ``writer=``): values of steps below ``floor`` are
    dropped, with one warning per run (``ctx``); every other call goes to the writer unchanged.

    Such a writer already holds the abandoned timeline's steps up to ``floor - 1``. It refuses
    a step lower than one it was given (``ValueError``, which would disable the callback) and
    has no way to go back; the step it still holds open would take the replayed values and
    mix the two timelines (one step old, the next replayed). So it keeps the old timeline
    below the floor and gets the restored one from the floor on. A writer that takes any step
    (``SummaryWriter``) is not wrapped: it gets the replayed steps (:func:`needs_replay_floor`).

    ``add_scalar`` and ``add_scalars`` take what the writer's take, ``SummaryWriter``'s names
    and order included (``tag=``, ``scalar_value=``, ``global_step=``; ``main_tag=``,
    ``tag_scalar_dict=``), and find the step as it does: ``step``, else ``global_step``; the
    third argument or ``global_step=`` in the form ``add_scalars(main_tag, tag_scalar_dict)``.
    A call the writer would refuse for its arguments goes to it, below the floor too, and
    raises there. Every other attribute (``flush``, ``close``, ``end_step``, ``status``,
    ``closed``, ...) is the writer's; ``with`` closes the writer as ``with writer:`` does.
    """

    def __init__(self, writer: Any, floor: int, ctx: RunContext) -> None:
        self.writer = writer
        self._floor = floor
        self._ctx = ctx

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        if not self._dropped(_call_step(_scalar_step, args, kwargs)):
            self.writer.add_scalar(*args, **kwargs)

    def add_scalars(self, *args: Any, **kwargs: Any) -> None:
        if not self._dropped(_call_step(_scalars_step, args, kwargs)):
            self.writer.add_scalars(*args, **kwargs)

    def _dropped(self, step: Any) -> bool:
        floor = self._floor
        # any integer the writer takes (numpy ints too); anything else is its to refuse
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step >= floor:
            return False
        if not self._ctx.replay_warned:
            self._ctx.replay_warned = True
            warnings.warn(
                "trainvitals: the run went back to an earlier step (a restore from a "
                f"checkpoint) and a writer given to it (writer=) already holds steps up to "
                f"{floor - 1}; the replayed steps below {floor} are dropped from that writer "
                "(it cannot take back what it was given), steps from "
                f"{floor} on are written. Let Vitals make its own writer (no writer=), or give "
                "the resumed run a new writer, to have them written (warned once)",
                RuntimeWarning,
                stacklevel=4,
            )
        return True

    def __enter__(self) -> ReplayWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.writer.__exit__(exc_type, exc, tb)

    def __getattr__(self, name: str) -> Any:
        # (looked up in __dict__: copy and pickle call this before __init__ has run)
        try:
            writer = self.__dict__["writer"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(writer, name)  # flush, close, end_step, resume_at, status, ...


# FanoutWriter.add_scalar's and add_scalars' parameters (tests/adapters/test_replay_writer.py
# checks that they stay the same): the step each call is for, found as those methods find it.


def _scalar_step(
    name: Any = None,
    value: Any = _UNSET,
    step: Any = None,
    walltime: Any = None,
    new_style: Any = False,
    double_precision: Any = False,
    *,
    global_step: Any = None,
    tag: Any = None,
    scalar_value: Any = _UNSET,
) -> Any:
    if tag is not None or scalar_value is not _UNSET or value is _UNSET:
        _scalar_args(name, value, tag, scalar_value)  # raises for what the writer refuses
    return _one_step(step, global_step)


def _scalars_step(
    mapping: Any = None,
    step: Any = None,
    global_step: Any = None,
    walltime: Any = None,
    *,
    main_tag: Any = None,
    tag_scalar_dict: Any = None,
) -> Any:
    if main_tag is not None or tag_scalar_dict is not None:
        mapping, step = _tagged_scalars_args(mapping, step, main_tag, tag_scalar_dict)
    if isinstance(mapping, str):
        # SummaryWriter's add_scalars(main_tag, tag_scalar_dict, global_step): the second
        # argument is the dict, the step comes third or as global_step=
        return global_step
    return _one_step(step, global_step)


def _one_step(step: Any, global_step: Any) -> Any:
    if step is not None and global_step is not None:
        raise TypeError("step and global_step given both")  # the writer raises too
    return global_step if step is None else step


def _call_step(find: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The step of a call, or ``None`` for a call the writer refuses (it raises there)."""
    try:
        return find(*args, **kwargs)
    except TypeError:
        return None


def needs_replay_floor(writer: Any) -> bool:
    """Whether ``writer`` refuses steps lower than those it was given (a ``FanoutWriter``)."""
    from trainvitals.adapters.fanout_writer import FanoutWriter

    return isinstance(writer, FanoutWriter)


def infer_batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dim of the first tensor with a dim found (dicts, lists,
    tuples, dataclasses, depth first, in order); a 0-d tensor before it (a scalar setting) has
    no batch dim.

    A sample is a row: a packed row holding several sequences (``DataCollatorWithFlattening``'s
    ``input_ids`` ``[1, total]``) is one sample, as Megatron counts its packed sequences. A
    list of per-sample items (``collate_fn=lambda x: x``) is counted by its first item's first
    tensor. Pass ``batch_size_fn`` (Lightning) or ``batch_size=`` (driver) for other counts.
    """
    tensor = _first_tensor(batch, _has_dim)
    return None if tensor is None else int(tensor.shape[0])


def infer_num_tokens(batch: Any) -> int | None:
    """Tokens in a batch: ``input_ids``' element count when present (a dict,
    ``BatchEncoding``, dataclass or named tuple holding it, or such a mapping or record first in
    a tuple or list whose later items hold none: a ``(features, labels)`` collate, not a list
    of uncollated samples, each with its own, whose first is no count of the batch); else the
    element count of the batch's token ids: its first tensor of two or more dims (bool masks
    skipped), when that is a 2-d ``int64``/``int32`` tensor (``[batch, seq]``: the index types
    ``nn.Embedding`` takes; of an uncollated list, its first sample's); ``None`` otherwise. A
    float tensor first (images, features, embeddings) or an 8- or 16-bit integer one (``uint8``
    images, flattened or not) means the batch's input is not token ids, and an integer tensor
    after it (class labels ``[batch, 1]``, multi-hot labels ``[batch, classes]``) is not
    counted as tokens.

    Padding is counted, as Composer's ``SpeedMonitor``, torchtitan, Megatron and the
    Transformers ``Trainer`` count tokens by default (the compute spent on them); packed rows
    have no padding, so their count is exact. An encoder-decoder batch counts its
    ``input_ids`` (encoder side), not ``decoder_input_ids``; a multimodal batch its
    ``input_ids`` (the image placeholder tokens a processor puts there included, not the
    pixels). Pass ``num_tokens_fn`` (Lightning) or ``num_tokens=`` (driver) to count
    otherwise, e.g. only real tokens with ``lambda b: b["attention_mask"].sum()``: a 0-d
    tensor stays on the device until a logging step reads it (``int(...)`` would wait for the
    device at every micro-batch).

    Under context parallelism the token counts are summed over the context-parallel ranks,
    each of which must count its own slice of the sequence: read off the batch as loaded (the
    whole sequence, before the split that torchtitan's and Accelerate's loops make inside the
    step), every rank counts all of it, ``cp`` times too many. Count this rank's share
    (``num_tokens=``, ``num_tokens_fn``) or the batch after the split; ``ThroughputMonitor``
    and ``RuntimeMonitor`` warn once per run when a count read off the batch meets more than
    one context-parallel rank.
    """
    ids = _input_ids(batch)
    if (
        ids is None
        and isinstance(batch, list | tuple)
        and batch
        and not any(_input_ids(item) is not None for item in batch[1:])
    ):
        # ``(features, labels)``: the features' ``input_ids``, not their first tensor (pixels
        # before it left the batch uncounted, decoder labels before it were counted instead);
        # not a list of samples each with its own (an uncollated batch: its first sample's
        # would be a fraction of the tokens)
        ids = _input_ids(batch[0])
    if ids is not None:
        return int(ids.numel())
    tensor = _first_tensor(batch, _not_a_mask)
    return None if tensor is None or not _token_ids(tensor) else int(tensor.numel())


def _input_ids(obj: Any) -> torch.Tensor | None:
    """``obj``'s ``input_ids`` tensor when ``obj`` is a mapping, dataclass or named tuple
    holding one."""
    if isinstance(obj, Mapping):
        ids = obj.get("input_ids")
    elif (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or (
        isinstance(obj, tuple) and hasattr(obj, "_fields")
    ):
        ids = getattr(obj, "input_ids", None)
    else:
        return None
    return ids if isinstance(ids, torch.Tensor) else None


def _first_tensor(obj: Any, fits: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    """The first tensor (depth first, in order) of ``obj``, its dicts, lists, tuples and
    dataclasses (their fields in order, as Lightning's ``extract_batch_size`` reads them) for
    which ``fits`` holds. Each container is visited once: a batch that holds itself (a list
    appended to itself) is searched, not recursed into forever (a ``RecursionError`` that
    ended the run from ``vitals.batch()``)."""
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if fits(item):
                return item
            continue
        if isinstance(item, Mapping):
            values: Any = item.values()
        elif isinstance(item, list | tuple):
            values = item
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            values = [getattr(item, f.name, None) for f in dataclasses.fields(item)]
        else:
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        stack.extend(reversed(list(values)))
    return None


def _has_dim(tensor: torch.Tensor) -> bool:
    return tensor.ndim >= 1


def _not_a_mask(tensor: torch.Tensor) -> bool:
    """A tensor that may hold the batch's input: two or more dims, not a bool mask (1-d and
    0-d tensors, per-sample labels or lengths and settings, are passed over)."""
    return tensor.ndim >= 2 and tensor.dtype != torch.bool


def _token_ids(tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and tensor.dtype in (torch.int64, torch.int32)
