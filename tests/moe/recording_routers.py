"""TopKRouters whose training forwards are recorded by a hook of their own: the independent
record that router-capture tests compare against (no optional package needed)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def topk_routers_with_recorder(
    num: int, seed: int = 0
) -> tuple[nn.ModuleList, dict[int, list[torch.Tensor]], dict[int, list[float]]]:
    """``num`` TopKRouters (E = 4, k = 2, Switch aux loss) and what each training forward
    routed, recorded by a separate hook (copies of the maps and of ``last_aux_loss``)."""
    from trainvitals.moe import TopKRouter

    torch.manual_seed(seed)
    model = nn.ModuleList(
        [TopKRouter(8, 4, 2, aux_loss_type="aux_loss", aux_loss_coeff=0.01) for _ in range(num)]
    )
    maps: dict[int, list[torch.Tensor]] = {i: [] for i in range(num)}
    aux: dict[int, list[float]] = {i: [] for i in range(num)}
    for i, router in enumerate(model):

        def hook(m: nn.Module, inp: Any, out: Any, i: int = i) -> None:
            if m.training and torch.is_grad_enabled():
                maps[i].append(out[1].clone())
                aux[i].append(float(m.last_aux_loss))

        router.register_forward_hook(hook)
    return model, maps, aux
