"""``TinyMoELightningModule``: :class:`TinyMoELM` as a LightningModule (imports lightning)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

try:  # the unified package first, the standalone one otherwise
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl
    from pytorch_lightning.core.optimizer import LightningOptimizer

from trainvitals.distributed import ProcessGroups
from trainvitals.moe._aux_loss import (
    get_aux_loss_backward_scale,
    get_aux_loss_grad_scaler,
    set_aux_loss_backward_scale,
)
from trainvitals.moe.tiny_model import TinyMoELM


class TinyMoELightningModule(pl.LightningModule):
    """Trains :class:`TinyMoELM` on batches ``{"input_ids", "labels"}`` with AdamW.

    At train start it gives the routers the strategy's data-parallel group and scales the
    routers' injected aux-loss gradients as Lightning scales the main loss: by
    ``1 / accumulate_grad_batches`` and, under ``precision="16-mixed"``, by the precision
    plugin's ``GradScaler`` scale (without it the unscaled aux-loss gradient would be 65536x too
    small). The previous setting is restored at train end. After every optimizer step it calls
    :meth:`TinyMoELM.moe_step_end`, telling it whether the optimizer really stepped: a step
    that fp16's ``GradScaler`` skipped (non-finite gradients) leaves the expert biases alone.

    Under manual optimization (``self.automatic_optimization = False`` in a subclass, whose
    ``training_step`` calls ``opt.step()`` itself) Lightning never calls
    :meth:`optimizer_step`: the biases stayed at zero and the token counts grew without end.
    There, from train start to train end, each ``step()`` of the ``LightningOptimizer`` that
    :meth:`optimizers` returns is followed by the same update, once per real step (several
    optimizers: each one's step). A subclass that steps otherwise (the torch optimizer itself,
    ``self.optimizers(use_pl_optimizer=False).step()``, or an ``on_train_start`` that does not
    call ``super().on_train_start()``) calls ``self.model.moe_step_end(optimizer_stepped=...)``
    after each optimizer step itself (``False`` when the step was skipped).

    Example:
        >>> module = TinyMoELightningModule(lr=1e-3, vocab_size=64, hidden_size=32,
        ...                                 num_layers=2, num_experts=4, top_k=2)
    """

    def __init__(self, lr: float = 1e-3, **model_kwargs: Any) -> None:
        super().__init__()
        self.lr = lr
        self.model = TinyMoELM(**model_kwargs)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids, labels)

    def on_train_start(self) -> None:
        self.model.set_process_groups(ProcessGroups.from_strategy(self.trainer.strategy))
        self._previous_aux_loss_scale = (get_aux_loss_backward_scale(), get_aux_loss_grad_scaler())
        # MixedPrecision (16-mixed) and FSDPPrecision hold the GradScaler as `.scaler`
        # (None under bf16 / 32). DeepSpeed scales the loss inside its engine: not seen here.
        grad_scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        set_aux_loss_backward_scale(
            1.0 / max(int(self.trainer.accumulate_grad_batches), 1), grad_scaler=grad_scaler
        )
        if not self.automatic_optimization:
            self._follow_manual_steps()

    def on_train_end(self) -> None:
        previous = getattr(self, "_previous_aux_loss_scale", None)
        if previous is not None:
            set_aux_loss_backward_scale(previous[0], grad_scaler=previous[1])
        for ref in getattr(self, "_followed_optimizers", []):
            optimizer = ref()
            if optimizer is not None:
                vars(optimizer).pop("step", None)
        self._followed_optimizers: list[weakref.ref[Any]] = []

    def _follow_manual_steps(self) -> None:
        """Follow each ``step()`` of the run's ``LightningOptimizer`` objects (what
        ``self.optimizers()`` hands a manual ``training_step``) with the bias update: Lightning
        calls no module hook around a manual step."""
        optimizers = self.optimizers(use_pl_optimizer=True)
        followed = []
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            if "step" in vars(optimizer):  # followed already (a run that did not end)
                continue
            original = optimizer.step

            def step(
                closure: Any = None, *, _original: Any = original, _opt: Any = optimizer, **kw: Any
            ) -> Any:
                return self._step_then_update(_opt, lambda: _original(closure, **kw))

            optimizer.step = step  # an instance attribute: shadows the class's step
            followed.append(optimizer)
        # weak references, left out of pickles (__getstate__): the module keeps no optimizer
        # alive and stays picklable mid-fit or after a fit that raised (no on_train_end)
        self._followed_optimizers = [weakref.ref(o) for o in followed]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_followed_optimizers", None)
        return state

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch["input_ids"], batch["labels"]).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch["input_ids"], batch["labels"]).loss

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        step = super().optimizer_step
        self._step_then_update(
            optimizer, lambda: step(epoch, batch_idx, optimizer, optimizer_closure)
        )

    def _step_then_update(self, optimizer: Any, run_step: Any) -> Any:
        """Run ``run_step()`` (one step of ``optimizer``), then update the expert biases unless
        the step was skipped; returns what ``run_step()`` returned."""
        # GradScaler.step() does not call optimizer.step() when the gradients are not finite:
        # a post hook on the wrapped torch optimizer sees whether it ran (torchtitan, whose
        # bias update is a step pre hook, skips it the same way). Under 32-bit precision the
        # closure runs inside step(), so the update itself waits until step() returned.
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(inner, "_step_supports_amp_scaling", False):
            # An optimizer that unscales itself (fused=True) is always called by
            # GradScaler.step and skips inside: its post hook runs either way. The scale tells
            # instead (it backs off exactly on a skipped step), compared on the device.
            before = getattr(scaler, "_scale", None)
            before = None if before is None else before.clone()
            result = run_step()
            after = getattr(scaler, "_scale", None)
            if after is None:  # (a disabled scaler: nothing skipped)
                self.model.moe_step_end()
                return result
            if before is None:  # (its first scale() ran inside the step: from init_scale)
                before = torch.full_like(after, float(scaler._init_scale))
            self.model.moe_step_end(optimizer_stepped=after >= before)
            return result
        stepped: list[bool] = []
        register = getattr(inner, "register_step_post_hook", None)
        handle = register(lambda *_: stepped.append(True)) if register is not None else None
        try:
            result = run_step()
        finally:
            if handle is not None:
                handle.remove()
        # (an optimizer without step hooks, DeepSpeed's: updated every step, as before)
        self.model.moe_step_end(optimizer_stepped=bool(stepped) or handle is None)
        return result

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
