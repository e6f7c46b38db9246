"""The :class:`Sink` base class and the key-mapping rule shared by every sink.

A sink turns one delivered step (``step``, wall time, ``{key: float}``) into one call of its
backend's batch API. Sinks never see tensors: the writer has already moved every value to the
host and converted it to a Python ``float``.

Key mapping
-----------
Some backends refuse some keys. MLflow accepts only ASCII letters and digits, ``_ - . /`` and
space (and ``:`` except on Windows servers), at most 250 characters, and no name that
``posixpath.normpath`` would change (``a//b``, ``a/./b``, ``/a``, ``a/``, ``..a``). W&B silently
overwrites the keys it uses itself (``_step``, ``_runtime``, ``_timestamp``, ``_wandb...``).
Comet cuts a metric name longer than 100 characters to its first 88 plus ``" [truncated]"``
(with a warning per call), so two long keys with a common start would land in one metric.
Every sink maps keys through one rule (:class:`KeyRule`), which differs between backends only in
*which* characters it has to escape:

* a character the backend refuses is replaced by ``_x`` and two lower-case hex digits per byte
  of its UTF-8 encoding: ``loss[0]`` becomes ``loss_x5b0_x5d``;
* an underscore that would otherwise read as the start of such an escape (``_x`` followed by two
  lower-case hex digits in the key itself, as in ``idx_x1f``) is escaped too (``_x5f``), so that
  decoding is unambiguous: :func:`unmap_key` turns every mapped key back into the original and
  two different keys can never map to the same name;
* a key still longer than the backend's limit is cut at an escape boundary and ends with
  ``_x2d`` plus the first 12 hex digits of the SHA-256 of the original key. ``_x2d`` (an escaped
  ``-``) never occurs in an uncut mapped key because ``-`` is never escaped, so a cut key can
  only meet another cut key, with probability 2**-48.

A key the backend accepts and that contains no ``_x`` + two hex digits is left unchanged.

Example::

    >>> MLFLOW_KEYS.map("moe/layer_3/cv")
    'moe/layer_3/cv'
    >>> MLFLOW_KEYS.map("loss[0]")
    'loss_x5b0_x5d'
    >>> unmap_key("loss_x5b0_x5d")
    'loss[0]'
    >>> WANDB_KEYS.map("_step")
    '_x5fstep'
"""

from __future__ import annotations

import copy
import errno
import hashlib
import inspect
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "COMET_KEYS",
    "IDENTITY_KEYS",
    "MAX_INT64_STEP",
    "MLFLOW_KEYS",
    "WANDB_KEYS",
    "WANDB_SHARED_KEYS",
    "KeyRule",
    "Sink",
    "StepRefused",
    "unmap_key",
    "warn",
]

_ESCAPE = re.compile(r"_x([0-9a-f]{2})")
_AMBIGUOUS_UNDERSCORE = re.compile(r"x[0-9a-f]{2}")
_CUT_MARK = "_x2d"  # an escaped "-": never produced for an uncut key
_HASH_DIGITS = 12


_ADAPTERS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def stacklevel(skip: int = 1) -> int:
    """``warnings.warn``'s ``stacklevel``, counted from the caller's caller (``skip`` frames
    above this function's caller), that names the first frame outside
    ``trainvitals/adapters/``: the user's ``add_scalar``/``flush()``/``close()`` line, or the
    callback that logged. In a writer thread (no frame but ``threading``'s outside) the line
    that reported it, whose message names the sink and the step."""
    frame = sys._getframe(skip + 1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_ADAPTERS_DIR):
        frame = frame.f_back
        level += 1
    if frame is None or frame.f_code.co_filename == threading.__file__:
        return 3
    return level


def make_folder(folder: Path) -> None:
    """``mkdir -p``; a folder that is a regular file raises ``NotADirectoryError`` naming it
    (pathlib's ``FileExistsError`` names no path, and its errno is retried as transient, where
    ``ENOTDIR`` has the writer disable the sink at once: retrying cannot fix it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder)) from e


def warn(message: str) -> None:
    """A ``RuntimeWarning`` at the user's line (:func:`stacklevel`); never raises (a warnings
    filter set to "error" must not fail a write or kill a writer thread: it is logged)."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel())
    except Exception:
        logging.getLogger(__name__).warning(message)


def _escape_char(ch: str) -> str:
    return "".join(f"_x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))


class KeyRule:
    """A deterministic, injective mapping of metric keys onto names a backend accepts.

    Args:
        name: the backend, for error messages.
        allowed: a regular-expression character class of the characters the backend accepts
            (``None``: every character).
        path_safe: escape ``/`` and ``.`` where they would make the name change under
            ``posixpath.normpath`` (MLflow stores metric names as paths).
        reserved: keys the backend uses itself; their first character is escaped.
        reserved_prefixes: key prefixes the backend uses itself.
        max_length: the longest name the backend accepts.

    ``map`` caches its results, so mapping the same keys every step costs one dict look-up.
    """

    def __init__(
        self,
        name: str,
        *,
        allowed: str | None = None,
        path_safe: bool = False,
        reserved: frozenset[str] = frozenset(),
        reserved_prefixes: tuple[str, ...] = (),
        max_length: int | None = None,
    ) -> None:
        self.name = name
        self._allowed = re.compile(f"[{allowed}]") if allowed is not None else None
        self._valid = re.compile(f"[{allowed}]*") if allowed is not None else None
        self.path_safe = path_safe
        self.reserved = reserved
        self.reserved_prefixes = reserved_prefixes
        self.max_length = max_length
        self._cache: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"KeyRule({self.name!r})"

    def with_reserved(self, *keys: str) -> KeyRule:
        """This rule with ``keys`` reserved too (a sink's own column, such as its step axis):
        a metric of that name is escaped instead of being overwritten by the sink's value."""
        rule = copy.copy(self)
        rule.reserved = self.reserved | frozenset(keys)
        rule._cache = {}
        return rule

    def map(self, key: str) -> str:
        """The backend name for ``key`` (the key itself when the backend accepts it)."""
        mapped = self._cache.get(key)
        if mapped is None:
            mapped = self._map(key)
            if len(self._cache) < 1_000_000:
                self._cache[key] = mapped
        return mapped

    def map_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """``metrics`` with every key mapped."""
        m = self.map
        return {m(k): v for k, v in metrics.items()}

    # ---- the rule

    def _needs_escape(self, key: str) -> Callable[[int], bool] | None:
        """None when ``key`` maps to itself, else a predicate on character positions."""
        n = len(key)
        flagged: set[int] = set()
        if self.reserved and (
            key in self.reserved or any(key.startswith(p) for p in self.reserved_prefixes)
        ):
            flagged.add(0)
        if self.path_safe:
            for i, ch in enumerate(key):
                if ch == "/" and (i == 0 or i == n - 1 or key[i + 1] == "/"):
                    flagged.add(i)
            start = 0
            for segment in key.split("/"):
                if segment in (".", ".."):
                    flagged.add(start)
                start += len(segment) + 1
            if key.startswith(".."):
                flagged.add(0)
        allowed = self._allowed
        for i, ch in enumerate(key):
            ambiguous = ch == "_" and _AMBIGUOUS_UNDERSCORE.match(key, i + 1)
            if ambiguous or (allowed is not None and not allowed.match(ch)):
                flagged.add(i)
        if not flagged:
            return None
        return flagged.__contains__

    def _map(self, key: str) -> str:
        escape = self._needs_escape(key)
        if escape is None:
            tokens = None
            mapped = key
        else:
            tokens = [_escape_char(ch) if escape(i) else ch for i, ch in enumerate(key)]
            mapped = "".join(tokens)
        limit = self.max_length
        if limit is None or len(mapped) <= limit:
            return mapped
        if tokens is None:
            tokens = list(key)
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_DIGITS]
        budget = limit - len(_CUT_MARK) - _HASH_DIGITS
        kept: list[str] = []
        length = 0
        for tok in tokens:
            # an escaped multi-byte character is one token: never cut inside an escape
            if length + len(tok) > budget:
                break
            kept.append(tok)
            length += len(tok)
        return "".join(kept) + _CUT_MARK + digest


def unmap_key(mapped: str) -> str | None:
    """The original key of a mapped name, or ``None`` for a name that was cut to fit.

    Example::

        >>> unmap_key("moe_x3alayer")
        'moe:layer'
    """
    if _CUT_MARK in mapped:
        return None
    out = bytearray()
    i = 0
    n = len(mapped)
    while i < n:
        m = _ESCAPE.match(mapped, i)
        if m is not None:
            out.append(int(m.group(1), 16))
            i = m.end()
        else:
            out += mapped[i].encode("utf-8", "surrogatepass")
            i += 1
    return out.decode("utf-8", "surrogatepass")


#: Keys every backend accepts unchanged (TensorBoard, JSONL, CSV).
IDENTITY_KEYS: KeyRule | None = None

#: MLflow: ASCII letters and digits, ``_ - . /`` and space (``:`` is left out: Windows servers
#: refuse it), names unchanged by ``posixpath.normpath``, at most 250 characters
#: (``mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH``).
MLFLOW_KEYS = KeyRule("mlflow", allowed=r"A-Za-z0-9_\-. /", path_safe=True, max_length=250)

#: W&B: every key except the ones W&B writes itself into each history row.
WANDB_KEYS = KeyRule(
    "wandb",
    reserved=frozenset({"_step", "_runtime", "_timestamp"}),
    reserved_prefixes=("_wandb",),
)

#: W&B for a run whose step other code moves (``WandbSink(shared_step=True)``): as
#: :data:`WANDB_KEYS`, and ``*`` and ``\`` escaped too. That sink declares each key's x-axis
#: with ``run.define_metric(name, step_metric=...)``, which raises for a ``*`` inside a name
#: and reads a trailing ``*`` as a glob (which would give the loop's own keys with that start
#: trainvitals' x-axis). It reads ``\`` in a name as an escape: wandb-core (0.31) has no name
#: for a key with an odd run of ``\`` before a ``.`` or at its end (``a\.b``, ``odd\``), so
#: such a key was logged without its x-axis; with every ``\`` escaped (``a\.b`` ->
#: ``a_x5c.b``) the only ``\`` in a declared name is the one before each ``.``.
WANDB_SHARED_KEYS = KeyRule(
    "wandb (shared step)",
    allowed=r"^*\\",
    reserved=WANDB_KEYS.reserved,
    reserved_prefixes=WANDB_KEYS.reserved_prefixes,
)

#: Comet: any characters, at most 100 (``comet_ml.config.MAXIMAL_KEY_LENGTH``); Comet itself
#: would cut a longer name to a prefix, merging keys that share their first 88 characters.
COMET_KEYS = KeyRule("comet", max_length=100)


class StepRefused(Exception):
    """Raised by :meth:`Sink.write` for a step the backend will not take (retrying cannot help).

    The writer counts the step as missed for that sink, warns once, and carries on; it is not a
    failure and does not count towards disabling the sink.
    """


#: The largest step TensorBoard (``Event.step``), MLflow (its ``step`` column) and W&B
#: (``_step``) can store: they keep steps as signed 64-bit integers.
MAX_INT64_STEP = 2**63 - 1


def refuse_step_beyond_int64(step: int, backend: str) -> None:
    """Raise :class:`StepRefused` for a step that ``backend`` stores as an int64 and that does
    not fit one. The backend itself raised for it at every retry (TensorBoard's and W&B's
    protobuf "Value out of range", MLflow's SQLite "Python int too large"), so the sink was
    disabled after ``max_failures`` and ``close()`` waited on its backoff."""
    if step > MAX_INT64_STEP:
        raise StepRefused(
            f"{backend} stores steps as signed 64-bit integers; step {step} is above 2**63 - 1"
        )


# add_scalars functions (unbound) -> whether they are TensorBoard's: inspect.signature costs
# tens of microseconds, too much to pay at every logging step.
_MAIN_TAG_FIRST: dict[Any, bool] = {}


def takes_main_tag(add_scalars: Any) -> bool:
    """Whether ``add_scalars`` is TensorBoard's ``SummaryWriter.add_scalars(main_tag,
    tag_scalar_dict, global_step)`` (``main_tag`` its first parameter), which groups its keys
    into runs of one chart, rather than ``add_scalars(mapping, step)`` of a
    :class:`FanoutWriter` (which takes ``main_tag`` as a keyword only) or a duck-typed writer."""
    func = getattr(add_scalars, "__func__", None)  # the class's function of a bound method
    if func is not None and func in _MAIN_TAG_FIRST:
        return _MAIN_TAG_FIRST[func]
    try:
        result = list(inspect.signature(add_scalars).parameters)[:1] == ["main_tag"]
    except (TypeError, ValueError):  # (a builtin without a signature: not TensorBoard's)
        result = False
    if func is not None and len(_MAIN_TAG_FIRST) < 256:
        _MAIN_TAG_FIRST[func] = result
    return result


class Sink:
    """Base class of the writer's sinks: one backend, written one step at a time.

    Subclasses implement :meth:`write` (and :meth:`open`, :meth:`flush`, :meth:`close` where
    needed). The writer calls them from one thread at a time:

    * :meth:`resume_at` before anything else, when the run says which step it resumes at
      (:meth:`FanoutWriter.resume_at`); again, with another step, when the run calls that
      again before it logged anything and before a ``flush()`` had the sink act on it
      (:meth:`settle_resume`): the last call counts;
    * :meth:`open` once, lazily, before the first :meth:`write` (so that a sink built on a
      non-zero rank, or never written to, creates no files, runs or connections); when it
      raises, it is retried like a failed write;
    * :meth:`write` once per step, in step order, with host floats; it must raise on failure
      (the writer retries the same step later, so a write should be idempotent or resume
      where it stopped), and may raise :class:`StepRefused`. An ``OSError`` whose ``errno``
      is ``ENOTDIR``, ``EISDIR``, ``EACCES``, ``EPERM`` or ``EROFS`` (raised by :meth:`open`
      or :meth:`write`: a path that cannot be made or opened) is not retried: the writer
      disables the sink at once, so a sink that can never work does not hold ``close()``;
    * :meth:`close` once at the end: flush, and release what the sink owns. A sink built from
      an object the user passed in (a ``SummaryWriter``, an MLflow client and run, a Comet
      experiment, a W&B run) does not own it and leaves it open;
    * :meth:`capture_context`, only when a subclass overrides it, from the training thread
      when the first value of a step is logged; what it returned is the sink's
      :attr:`step_context` while that step's :meth:`write` runs (the writer delivers a step
      some time after it was logged, when the loop may have moved on, to the next epoch say).

    Attributes:
        name: used in warnings and :meth:`FanoutWriter.status`.
        thread_safe: ``True`` when the writer may call this sink from its background worker
            thread; ``False`` makes the writer call it from the training thread (at the next
            writer call after the step's values reached the host), for backends that the
            training thread also uses without locking (Lightning's ``CSVLogger``). Such a
            sink may also define ``install_order_hook(deliver_before)`` to be handed its
            steps before the loop's own later logs to the same object (``TrackerSink``,
            ``LightningLoggerSink``).
        key_rule: the :class:`KeyRule` of the backend, or ``None`` when it takes every key.
        run_failed: set by the writer before :meth:`close` when the run ended with an
            exception (``FanoutWriter.close(failed=True)``): a sink ending a run it created
            marks it failed.
        run_interrupted: set with ``run_failed`` when the user stopped the run
            (``KeyboardInterrupt``; ``FanoutWriter.close(interrupted=True)``): a backend that
            tells a run killed by its user from a failed one is told so (MLflow ``KILLED``).
        step_context: during :meth:`write`, what :meth:`capture_context` returned when the
            step's first value was logged (``None`` for a sink that does not override it).
        key_prefix: put before every key, ahead of the key rule (``""``: none). Set by
            :meth:`FanoutWriter.from_lightning` to a logger's ``prefix=`` and separator, which
            the logger applies in its own ``log_metrics`` only.

    Example (a sink printing each step)::

        class PrintSink(Sink):
            name = "print"

            def write(self, step, metrics, wall_time):
                print(step, dict(metrics))
    """

    name: str = "sink"
    thread_safe: bool = True
    key_rule: KeyRule | None = None
    run_failed: bool = False
    run_interrupted: bool = False
    key_prefix: str = ""
    step_context: Any = None

    def __init__(self, *, name: str | None = None, owned: bool = True) -> None:
        if name is not None:
            self.name = name
        self.owned = owned

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def map_key(self, key: str) -> str:
        """The name ``key`` is written under in this sink's backend."""
        if self.key_prefix:
            key = self.key_prefix + key
        return key if self.key_rule is None else self.key_rule.map(key)

    def map_metrics(self, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """``metrics`` under the names of :meth:`map_key`."""
        if self.key_prefix:
            prefix = self.key_prefix
            metrics = {prefix + k: v for k, v in metrics.items()}
        return metrics if self.key_rule is None else self.key_rule.map_metrics(metrics)

    def open(self) -> None:
        """Create or connect to the backend (called once, before the first write)."""

    def capture_context(self) -> Any:
        """What of the backend's state a step's values belong to, read on the training thread
        when the step's first value is logged (cheap: a few attribute reads; never raise).
        Called only when a subclass overrides it; see :attr:`step_context`."""
        return None

    def resume_at(self, step: int) -> None:
        """The run resumes at ``step`` (``0``: a new run); called before :meth:`open` by
        :meth:`FanoutWriter.resume_at`. A sink that keeps files drops what an earlier run wrote
        for steps ``>= step``; the default does nothing."""

    def settle_resume(self) -> None:
        """Act on :meth:`resume_at` now, although nothing was written since: a run that rolled
        back and then ended before its next logging step. Called by the writer's ``flush()``
        before the sink was opened (from the thread calling ``flush()``, while no other
        thread calls the sink), and by a sink's own :meth:`close`; must be idempotent. The
        default does nothing."""

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        """Deliver one step: ``metrics`` maps the original keys to floats (NaN/Inf included)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered data to the backend."""

    def close(self) -> None:
        """Flush, and close what this sink owns. Called once, after the last write."""
        self.flush()
