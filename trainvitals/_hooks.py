"""Hooks that trainvitals registers on a user's modules."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

_Hook = TypeVar("_Hook", bound=Callable[..., object])


def eager_hook(hook: _Hook) -> _Hook:
    """``hook`` excluded from ``torch.compile``.

    Dynamo traces the hooks registered on the modules of a compiled model: it breaks the graph
    inside them (at the autograd graph-task query) and compiles the rest, and what they call.
    Traced, a hook guards on the telemetry's Python state (held tensors, counts), which changes
    on every forward, so it is recompiled forward after forward up to Dynamo's recompile limit
    (RouterCapture); a kernel it runs fails under fake tensors (TensorStatsMonitor lost a
    compiled model's first logging step); and a ``_version`` read is a constant of the trace,
    not the counter of the tensor kept. Run eagerly, a hook holds the real tensor with its real
    version counter, which an in-place op of the compiled graph after the hook still bumps.
    It breaks the graph either way; the cost is well under a microsecond per call.
    """
    return torch.compiler.disable(hook)  # (no reason=: older torch 2.x lacks it)


class FullgraphRegions:
    """Where a forward hook on a module of ``model`` can run: the modules whose hooks would be
    traced into code compiled with ``fullgraph=True`` (or with graph breaks made errors).

    Dynamo inlines the hooks of every module it traces through. An :func:`eager_hook` there
    is a graph break, and a region compiled with ``fullgraph=True`` refuses it: the user's
    forward raises ``torch._dynamo.exc.Unsupported`` ("Skip calling torch.compiler.disable()d
    function"), and so does a traced hook with any other graph break. Such modules are:

    * under ``torch.compile(m, fullgraph=True)`` (an ``OptimizedModule``), ``m`` and every
      module inside it. The wrapper's own hooks run in its ``nn.Module.__call__``, before
      the compiled code: :meth:`target` of ``m`` is the wrapper, which sees the same calls;
    * under ``m.compile(fullgraph=True)`` (``m._compiled_call_impl``), every module inside
      ``m``; ``m``'s own hooks run outside the graph (Dynamo skips ``nn.Module._call_impl``
      and starts at ``forward``), unless the compiled callable was wrapped to be traced
      whole (``torch._dynamo.config.wrap_top_frame`` at compile time);
    * a LightningModule that Lightning took from ``torch.compile(lm, fullgraph=True)``
      (``lightning.pytorch.utilities.compile.from_compiled``: its ``forward`` and
      ``training_step`` compiled, ``_compiler_ctx``): the module and everything inside it.

    Computed once (at run start): a module compiled later is not seen. Anything that cannot be
    told (another torch's internals) counts as not fullgraph: today's behaviour.
    """

    def __init__(self, model: object) -> None:
        self._inside: set[int] = set()
        self._wrapper: dict[int, torch.nn.Module] = {}
        if not isinstance(model, torch.nn.Module):
            return
        for m in model.modules():
            orig = getattr(m, "_orig_mod", None)
            if isinstance(orig, torch.nn.Module) and _refuses_graph_breaks(
                getattr(m, "dynamo_ctx", None)
            ):
                self._wrapper[id(orig)] = m
                self._inside.update(id(s) for s in orig.modules())
                continue
            lightning = getattr(m, "_compiler_ctx", None)  # lightning's from_compiled
            if isinstance(lightning, dict) and _refuses_graph_breaks(lightning.get("dynamo_ctx")):
                # its training_step and forward are compiled: they call the module itself
                self._inside.update(id(s) for s in m.modules())
                continue
            compiled = getattr(m, "_compiled_call_impl", None)
            if compiled is not None and _refuses_graph_breaks(_dynamo_context(compiled)):
                traced = getattr(compiled, "_torchdynamo_orig_callable", None)
                whole = not (inspect.ismethod(traced) and traced.__self__ is m)
                self._inside.update(id(s) for s in m.modules() if whole or s is not m)

    def target(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The module to hook to see ``module``'s calls: ``module`` itself, the
        ``OptimizedModule`` wrapping it (a compiled region's root, called through it), or
        ``None`` when every choice runs inside a fullgraph region."""
        if id(module) not in self._inside:
            return module
        wrapper = self._wrapper.get(id(module))
        if wrapper is not None and id(wrapper) not in self._inside:
            return wrapper
        return None


def on_behalf_of(hook: Callable[..., object], module: torch.nn.Module) -> Callable[..., object]:
    """``hook`` registered on a wrapper of ``module`` (:meth:`FullgraphRegions.target`),
    called with ``module`` in place of the wrapper (its buffers, its ``training`` flag)."""

    def called(_wrapper: torch.nn.Module, *args: object) -> object:
        return hook(module, *args)

    return called


def _refuses_graph_breaks(ctx: object) -> bool:
    """Whether Dynamo's context ``ctx`` makes a graph break an error: ``fullgraph=True``, its
    own ``error_on_graph_break``, or (unset there) the global one in force now."""
    if ctx is None:
        return False
    if getattr(ctx, "fullgraph", False) is True:
        return True
    own = getattr(ctx, "error_on_graph_break", None)
    if own is not None:
        return own is True
    try:
        from torch._dynamo.utils import _get_error_on_graph_break
    except ImportError:  # another torch: not known
        return False
    return _get_error_on_graph_break() is True


def _dynamo_context(compiled: object) -> object | None:
    """The Dynamo context that ``m.compile()`` put in ``m._compiled_call_impl`` (a closure
    cell of the function ``torch.compile`` returns), or ``None`` when not found."""
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "fullgraph") and hasattr(value, "callback"):
            return value
    return None
