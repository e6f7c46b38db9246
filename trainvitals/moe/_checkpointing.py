"""Which training-mode forward of a module to count, under either kind of activation checkpointing.

Shared by :class:`~trainvitals.moe.TopKRouter` (what it records into the tracker and adds to its
token counts) and :class:`~trainvitals.moe.capture.RouterCapture` (what it counts per expert).
"""

from __future__ import annotations

import torch


class CheckpointRuns:
    """Tells, for one module, whether the training-mode forward running now is the one to count.

    * Outside the backward pass with autograd on: yes. A non-reentrant checkpoint
      (``use_reentrant=False``) may re-run it in the backward pass (:attr:`may_rerun`).
    * Outside the backward pass with autograd off: no. It is a reentrant checkpoint's first run
      (held back: its re-run in the backward pass counts) unless the module has run with autograd
      on outside the backward pass, which a module under a reentrant checkpoint never does; a
      ``no_grad`` forward of such a module (generation between a forward and its backward, a
      teacher pass) is re-run by nothing.
    * In the backward pass (``torch._C._current_graph_task_id() != -1``) with autograd on: the
      re-run of a held-back run counts, once per held-back run; any other is a non-reentrant
      re-run of a forward that counted already.
    * In the backward pass with autograd off (an inner checkpoint's first run during an outer
      re-run, nested reentrant checkpoints): no, and nothing is consumed.
    """

    __slots__ = ("grad_forward_seen", "held_back", "may_rerun")

    def __init__(self) -> None:
        self.held_back = 0  # held-back runs whose re-run in the backward pass is to count
        self.grad_forward_seen = False
        self.may_rerun = False  # the last counted forward may be re-run (non-reentrant)

    def counts(self) -> bool:
        """Call once per training-mode forward of the module."""
        in_backward = torch._C._current_graph_task_id() != -1
        grad = torch.is_grad_enabled()
        self.may_rerun = False
        if not in_backward:
            if grad:  # an ordinary forward, or a non-reentrant checkpoint's first run
                self.grad_forward_seen = True
                self.held_back = 0
                self.may_rerun = True
                return True
            if not self.grad_forward_seen:  # a reentrant checkpoint's first run
                self.held_back += 1
            return False
        if grad and self.held_back > 0:  # the reentrant re-run of a held-back run
            self.held_back -= 1
            return True
        return False
