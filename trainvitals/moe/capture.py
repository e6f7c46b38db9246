"""Router capture: find the routers of a MoE model without changing it, and count on the device
how many tokens each expert of each layer received over every micro-batch of a step.

:class:`RouterCapture` walks ``model.named_modules()`` once, recognises routers, and registers
forward hooks on them. Each hook adds the router's token-to-expert assignment counts of one
forward into row ``i`` of one ``[L, E]`` accumulator that lives on the router's device: no
``.item()``, no host copy, no collective. For ``TopKRouter`` the hook runs no kernel (but one
scalar product for a ``global_aux_loss`` over several ranks): it keeps a reference to the
forward's routing map and aux loss (a fresh tensor per forward; a later in-place change is
detected by its version counter), and the step's maps are counted together when the step is read
(:meth:`RouterCapture.read_host`, :meth:`RouterCapture.loads`), in a few kernels whatever the
number of layers and micro-batches, or earlier when the held maps exceed 32 Mi elements. So
under gradient accumulation every micro-batch of the step is counted (NeMo Automodel's gates
keep only the last micro-batch's load, a bug), and the owner (``LoadBalanceMonitor``) reads the
whole step at once and resets it.

Recognised routers (first match wins, user extractors first):

==========================  =======================================================================
router                      how its counts are read
==========================  =======================================================================
user extractor              ``register_router_extractor(predicate_or_type, fn)``; ``fn(module,
                            inputs, output)`` returns the ``[E]`` tokens per expert of one forward,
                            or a pair ``(tokens_per_expert, aux_loss)``
``TopKRouter`` of           output ``(probs [T, E], routing_map [T, E] bool)``: ``routing_map.sum(0)``
``trainvitals.moe``         (the tokens each expert processes, after any capacity drop; with
                            ``pad_to_capacity`` the weight-0 padding slots are not counted);
                            ``module.last_aux_loss`` (when not ``None``) as the layer's aux loss
                            (``global_aux_loss``: this rank's share times the size of the router's
                            ``dp_group``, so its mean over data parallel is the global loss)
Hugging Face transformers   ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``,
routers                     ``OlmoeTopKRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``,
                            ``HunYuanMoEV1Gate``, ``AfmoeTokenChoiceRouter``,
                            ``DeepseekV4HashRouter`` (a frozen token-id lookup; no aux loss:
                            transformers' loss sees the ``DeepseekV4TopKRouter`` layers only)
                            (and any ``transformers`` module whose class name ends in
                            ``TopKRouter`` / ``TopkRouter`` with ``num_experts`` and ``top_k``:
                            DeepSeek-V2/V3.2/V4, GLM-4-MoE(-Lite), Inkling, ...): output
                            ``(router_logits [N, E], scores [N, k], indices [N, k], ...)``, the
                            indices its third output (``InklingTopkRouter`` adds a fourth, its
                            shared experts' gammas); ``Gemma4TextRouter``,
                            ``DiffusionGemmaTextRouter``: the same with the probabilities first,
                            ``E`` their ``proj.out_features`` (no ``num_experts`` attribute);
                            ``LongcatFlashTopkRouter``: the same, ``E`` its
                            ``n_routed_experts`` (routed + zero experts, the last columns);
                            ``ZayaRouter``: the same, ``E`` its ``num_router_classes`` (the
                            experts + its skip expert, the last column), the indices recomputed
                            as it selects, top-``k`` of ``softmax(router_logits) +
                            balancing_biases`` (its own returned indices turn a skip into
                            expert 0); ``DogeCDMoE`` (Doge, product keys, no router module):
                            output ``(hidden_states, router_logits [2, N, num_keys])``, its
                            experts recomputed as it picks them (the top ``k`` of the
                            ``num_keys**2`` pairs ``x * num_keys + y`` scored ``s_x + s_y``);
                            ``Llama4Router``: output ``(scores, router_logits)``, its indices
                            ``torch.topk(router_logits, top_k, dim=1)``; ``JetMoeTopKGating``
                            (MoE attention and MoE MLP, two per layer): output ``(...,
                            router_logits)``, indices ``torch.topk(router_logits, top_k, dim=1)``;
                            ``DbrxRouter``: output ``router_logits``, indices the top-``k`` (its
                            parent ``DbrxFFN.top_k``) of ``softmax(router_logits, dim=1)``, as
                            ``DbrxFFN.route_tokens_to_experts``; each recomputed with the
                            router's own call on the same tensor; ``SwitchTransformersTop1Router``:
                            the sum of its one-hot dispatch mask ``[B, S, E]`` (after the
                            per-sequence ``expert_capacity`` drop), padding left out; the counts
                            are a scatter-add of the router's own ``indices``, without padding:
                            a pre-hook on the transformers models that contain the routers
                            records their forward's 2-d ``attention_mask`` ``[B, S]``, and the
                            tokens where it is 0 (token ``b * S + s`` of the router's
                            ``N = B * S``) go to the overflow column; without a 2-d mask, or
                            when its size is not ``N`` (a KV cache, a model that removes padding
                            itself; warned once per router), every token is counted; Ernie
                            4.5-VL's ``text_moe`` / ``vision_moe`` routers see only their
                            modality's tokens (by the forward's ``moe_mm_token_type_ids``), and
                            each is matched with its own tokens' mask (their aux loss: below). For the
                            softmax families (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, JetMoE, DBRX)
                            and any other of these routers whose modeling module defines the
                            standard ``load_balancing_loss_func`` (PhiMoE, GraniteMoE, Ernie 4.5,
                            MiniMax, ...) the layer's aux loss is Hugging Face's per-layer
                            ``load_balancing_loss_func`` term with the attention mask, / ``top_k``
                            (1.0 at perfect balance; Ernie 4.5-VL: the layer's one term over
                            both modality routers' logits, as its block returns them, with text
                            expert ``e`` and vision expert ``e`` in one column, on the text
                            router's row; the vision router reports none),
                            computed as that function does: the top-k
                            counts and mean probabilities of ``softmax(router_logits)`` taken in
                            the logits' dtype, over the tokens that are not padding. Those loss
                            counts are not always the router's own choice, which the loads
                            count: a router that selects with a bias or a sparsemixer, and with
                            bf16 logits Mixtral/Qwen/OLMoE's float32 softmax against the
                            function's bf16 one, which pick other experts at near ties; Doge:
                            its own ``load_balancing_loss_func`` term of the layer (``softmax``
                            of the pair scores; the counts divided by ``T * k``, so already 1.0
                            at balance), padding left out; Switch Transformers: its own
                            per-sequence loss of the layer,
                            ``E**2 * mean_{b,e}(f_be P_be)`` over every token (its
                            ``load_balancing_loss_func`` takes no mask; the model adds it only
                            with a sparse step > 1), and, the only router with one, its router
                            z-loss (:func:`unpack_z_losses`): ``router_z_loss_func`` of
                            the layer, the mean over every token, padding included, of
                            ``logsumexp(router_logits, -1)**2`` (logit**2; before
                            ``router_z_loss_coef``); a forward whose mask is all 0 (a micro-batch
                            of padding) has no such loss and is left out of the layer's mean over
                            micro-batches (a count kept on the device: no host read)
torchtitan ``MoE``          a module with a 1-d buffer ``tokens_per_expert_E`` (torchtitan 0.3) or
                            ``tokens_per_expert`` (older): torchtitan adds each training forward's
                            counts to it and its optimizer step PRE-hook ``_update_expert_bias``
                            zeroes it (only with a ``load_balance_coeff``: without one the float32
                            buffer grows over the whole run). Around each counted forward the
                            capture sets the buffer aside and zeroes it (pre-hook), takes what the
                            forward added, then adds the set-aside value back (post-hook, also when
                            the forward raises): the counts are exact however large the buffer has
                            grown (a difference of float32 totals past 2**24 is not), are taken
                            before torchtitan's zeroing, and the buffer ends bit-identical to
                            ``before + counts`` as torchtitan alone would have left it
==========================  =======================================================================

A transformers module whose class name ends in ``Router`` or ``Gating`` and that none of these
recognises is warned about when the capture is built, naming the model and the classes: its
layers are not counted. NLLB-MoE (``NllbMoeTop2Router``) is left so on purpose: in transformers
5.x ``NllbMoeExperts`` one-hot encodes the router's ``[N, E]`` dispatch mask as if it held expert
indices, so only ``expert_0`` and ``expert_1`` ever run and no count of the router's dispatch is
the experts' load; its routing also depends on the attention implementation's mask format.

What is counted: each training forward once, with the module in training mode. Evaluation
(``model.eval()``, ``torch.no_grad()``, ``torch.inference_mode()``) is not counted. Activation
checkpointing runs a forward twice, and which run to count depends on its kind:

* non-reentrant (``use_reentrant=False``, the default of transformers 5, torchtitan and FSDP's
  ``checkpoint_wrapper``): the first run has autograd on and is counted; the re-run during the
  backward pass (detected with ``torch._C._current_graph_task_id()``, which is ``-1`` outside
  the autograd engine) is not, so a checkpointed layer is not counted twice (torchtitan's own
  buffer is; it halves it for full AC);
* reentrant (``use_reentrant=True``, DeepSpeed's): the first run has autograd off, like an
  evaluation forward, and is held back; the re-run during the backward pass then counts, once
  per held-back run of the same router. A training-mode forward under ``no_grad`` that no
  backward re-runs (a generation step, a teacher) is never counted: once a router has run with
  autograd on outside the backward pass, its ``no_grad`` forwards are not held back at all,
  and such a forward drops its held-back runs.

The attention mask a Hugging Face router's tokens are matched with is that of the latest
training-mode forward of the transformers models that contain it (an encoder-decoder's encoder
routers take the encoder stack's mask, its decoder routers the decoder stack's, whichever ran
last). For a reentrant re-run that is the mask of the forward being
re-run when each micro-batch's forward and backward come in order (gradient accumulation); a
schedule that interleaves forwards and backwards of different micro-batches through the same
model (a pipeline schedule, a training-mode forward between a forward and its backward) could
pair a re-run with another micro-batch's mask: only a mask of another size is detected (every
token is then counted).

Layer numbers come from the module name: the first integer component, so
``model.layers.10.mlp.gate`` is layer 10 and ``module.decoder.layers.3.mlp.router`` layer 3.
Routers are ordered numerically by all the integers of their name (``layers.2`` before
``layers.10``), never as strings. A router whose name contains no integer uses its own
1-based ``layer_number`` attribute minus one when it has one (``TopKRouter``; so labels stay the
0-based block index of the names), else its position in discovery order; such routers sort after the numbered ones. Routers of one stack (the same
name before the first integer) with the same number get labels made of all the integers of
their names (``layers.3.experts.1.router`` -> ``3_1``). Routers of different stacks with the
same number (an encoder and a decoder: Switch Transformers' ``encoder.block.1.layer.1.mlp.router``
and ``decoder.block.1.layer.2.mlp.router``, whose ``1_1`` / ``1_2`` would read as two routers
of one block), and routers whose integer labels still clash, get their full module names with
``_`` for ``.`` (``encoder_block_1_layer_1_mlp_router``), so labels are unique and say which
stack. The order stays numeric (encoder and decoder blocks of one number side by side).

Why a scatter-add and not ``torch.bincount``: on CUDA ``bincount`` reads the maximum index back
to the host to size its output, a device synchronisation on every forward. Indices outside
``[0, E)`` (some dispatchers use ``E`` or ``-1`` for "no expert") go to an extra overflow column
that is never reported, so a sentinel cannot corrupt the counts or raise a device assert.

Example::

    capture = RouterCapture(model)           # finds the routers, registers hooks
    for micro_batch in step_batches:
        model(micro_batch).loss.backward()
    loads = capture.loads()                  # [L, E] on the device, summed over the step
    capture.reset()
    capture.remove()                         # remove the hooks
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainvitals._device import host_to_device, index_on
from trainvitals._hooks import FullgraphRegions, eager_hook, on_behalf_of
from trainvitals._strict import strict as _strict
from trainvitals.distributed import group_size, local_tensor
from trainvitals.moe._checkpointing import CheckpointRuns
from trainvitals.stats.norms import canonical_name

__all__ = [
    "FLOAT32_EXACT_COUNTS",
    "HF_ROUTER_CLASSES",
    "RouterCapture",
    "RouterInfo",
    "clear_router_extractors",
    "count_dtype",
    "find_routers",
    "layer_number_from_name",
    "register_router_extractor",
    "unpack_loads",
    "unpack_z_losses",
]

# Router classes of transformers 5.x verified against the installed source (modeling_*.py):
# most forwards return (router_logits, top-k scores, top-k indices); the others are read by
# the family rules below.
HF_ROUTER_CLASSES: frozenset[str] = frozenset(
    {
        "MixtralTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "OlmoeTopKRouter",
        "DeepseekV3TopkRouter",
        "GptOssTopKRouter",
        "HunYuanMoEV1Gate",  # same output, a name the generic rule below does not match
        "AfmoeTokenChoiceRouter",  # same output (sigmoid + expert_bias selection)
        "Llama4Router",  # output (scores [N, E], router_logits [N, E]): see _TOPK_OF_LOGITS
        "JetMoeTopKGating",  # output (..., router_logits [N, E]): see _TOPK_OF_LOGITS
        "DbrxRouter",  # output router_logits [N, E]: see _DBRX_ROUTERS
        "SwitchTransformersTop1Router",  # output (dispatch [B, S, E], ...): see _DISPATCH_ROUTERS
        # the same output as the generic rule, names it does not match:
        "DeepseekV4HashRouter",  # indices a frozen token-id lookup; in no aux loss
        "Gemma4TextRouter",  # (router_probabilities, weights, indices); E: proj.out_features
        "DiffusionGemmaTextRouter",  # as Gemma4TextRouter
        "ZayaRouter",  # E: num_router_classes (+ its skip expert): see _SKIP_EXPERT_ROUTERS
        "DogeCDMoE",  # product-key routing, output (hidden, logits [2, N, K]): see _PRODUCT_KEY
    }
)
# Routers whose forward returns the logits and whose experts are torch.topk(router_logits,
# top_k, dim=1), which the capture recomputes (the same call on the same tensor), with the
# position of the logits in the output tuple: Llama4Router (scores, router_logits);
# JetMoeTopKGating (index_sorted_experts, batch_index, batch_gates, expert_size, logits).
_TOPK_OF_LOGITS: dict[str, int] = {"Llama4Router": 1, "JetMoeTopKGating": 4}
# DbrxRouter returns router_logits [N, E] only; its parent DbrxFFN selects
# torch.topk(softmax(router_logits, dim=1, dtype=router_logits.dtype), ffn.top_k, dim=-1)
# (route_tokens_to_experts), which the capture recomputes with the parent's top_k.
_DBRX_ROUTERS: frozenset[str] = frozenset({"DbrxRouter"})
# Routers whose forward returns a one-hot dispatch mask [B, S, E] after the capacity drop as
# its first output and the router logits [B, S, E] as its third: the counts are the mask's sum
# (SwitchTransformersTop1Router: top-1, expert_capacity per sequence).
_DISPATCH_ROUTERS: frozenset[str] = frozenset({"SwitchTransformersTop1Router"})
# Routers whose number of experts is not their num_experts attribute: LongcatFlashTopkRouter's
# logits and indices cover n_routed_experts = the routed experts + the zero (identity) experts.
# ZayaRouter's logits cover num_router_classes = num_experts + 1, its last class the skip
# expert (no compute): counted as the last column, like LongCat's zero experts.
_HF_EXPERTS_ATTR: dict[str, str] = {
    "LongcatFlashTopkRouter": "n_routed_experts",
    "ZayaRouter": "num_router_classes",
}
# Routers whose returned indices replace the skip expert by expert 0 (with weight 0), so the
# choice is recomputed as the router makes it (transformers 5.x models/zaya/modeling_zaya.py::
# ZayaRouter.forward): top-k of softmax(router_logits).float() + balancing_biases.
_SKIP_EXPERT_ROUTERS: frozenset[str] = frozenset({"ZayaRouter"})
# MoE modules that route with product keys and return (hidden_states, router_logits [2, N, K])
# (Doge's DogeCDMoE: no router submodule of its own); see _product_key_routing.
_PRODUCT_KEY_ROUTERS: frozenset[str] = frozenset({"DogeCDMoE"})
# Routers with no num_experts attribute whose number of experts is the width of a linear
# layer of theirs (Gemma 4's router: proj = nn.Linear(hidden_size, num_experts)).
_HF_EXPERTS_LINEAR: dict[str, str] = {
    "Gemma4TextRouter": "proj",
    "DiffusionGemmaTextRouter": "proj",
}
# Routers whose logits transformers leaves out of load_balancing_loss_func although their
# modeling module defines it: DeepSeek-V4 records router_logits of DeepseekV4TopKRouter only
# (OutputRecorder(DeepseekV4TopKRouter, index=0)), so its hash-routed layers have no aux loss.
_HF_NO_AUX: frozenset[str] = frozenset({"DeepseekV4HashRouter"})
# Families whose Hugging Face aux loss is the Switch loss over softmax(router_logits)
# (``load_balancing_loss_func``); DeepSeek-V3 and AFMoE balance with a bias, HunYuan-MoE and
# Llama 4 train without one. Other routers get a Switch aux loss when their modeling module
# defines the standard ``load_balancing_loss_func`` (_hf_switch_loss_family). For all of them
# the loss's top-k is recomputed from the logits as that function does (_hf_loss_counts): it is
# not always the router's own selection (a bias, a sparsemixer; and in bf16 the router's
# float32 softmax against the function's bf16 one, which differ at near ties). Switch
# Transformers has its own per-sequence loss (_switch_seq_aux_loss).
_HF_SOFTMAX_AUX: frozenset[str] = frozenset(
    {
        "MixtralTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "OlmoeTopKRouter",
        "GptOssTopKRouter",
        "JetMoeTopKGating",
        "DbrxRouter",
    }
)
_HF_SWITCH_LOSS_PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")
# Routers of a block that sends each modality's tokens to its own experts (Ernie 4.5-VL-MoE,
# transformers 5.x modeling_ernie4_5_vl_moe.py::Ernie4_5_VLMoeMoeBlock.forward): with
# moe_mm_token_type_ids [B, S] given and not all 0, `text_moe` routes the tokens whose type is 0
# and `vision_moe` those whose type is not (image and video), each as hidden_states[mask] (the
# tokens in row-major order); otherwise `text_moe` routes every token. Keyed by the name of the
# router's parent module.
_MODALITY_ROUTER_PARENTS: dict[str, str] = {"text_moe": "text", "vision_moe": "vision"}
_TOKEN_TYPES_ARG = "moe_mm_token_type_ids"
# transformers modules that look like MoE routers; warned about when not recognised
_HF_ROUTER_LIKE = re.compile(r"(Router|Gating)$")
_HF_NOT_MOE = re.compile(r"Density")  # GraniteDoclingDensityRouter: a vision path switch
_HF_GENERIC = re.compile(r"Top[kK]Router$")
_TORCHTITAN_BUFFERS = ("tokens_per_expert_E", "tokens_per_expert")
# The integer components of a dotted module name; the first is the layer number in keys. A
# tensor name `<module>/input0` (tensor statistics) ends its module name with '/'.
LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=[./]|$)")
# Deferred routing maps held before they are counted early (elements, i.e. bytes of bool):
# bounds the memory a long gradient accumulation of large maps can hold until the step ends.
_MAX_PENDING_NUMEL = 1 << 25
# Up to this many per-forward counts (forwards x experts) read_host adds them on the host;
# above, one index_add_ on the device is cheaper than a long Python loop.
_HOST_SUM_MAX = 4096

# float32 counts are exact integers up to this value; past it an added 1 can be lost.
FLOAT32_EXACT_COUNTS = 1 << 24

Extractor = Callable[[nn.Module, Any, Any], Any]
# A Hugging Face router's tokens against the attention mask, see RouterCapture._hf_valid_tokens
_ValidTokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Predicate = Callable[[nn.Module], bool]


@dataclass
class _ExtractorEntry:
    predicate: Predicate
    fn: Extractor
    num_experts: int | Callable[[nn.Module], int] | None
    description: str


_REGISTRY: list[_ExtractorEntry] = []


def _as_predicate(predicate_or_type: Any, argname: str) -> tuple[Predicate, str]:
    if isinstance(predicate_or_type, type):
        if not issubclass(predicate_or_type, nn.Module):
            raise TypeError(
                f"{argname} must be an nn.Module subclass or a predicate, got {predicate_or_type!r}"
            )
        cls = predicate_or_type
        return (lambda m: isinstance(m, cls)), cls.__name__
    if (
        isinstance(predicate_or_type, tuple)
        and predicate_or_type
        and all(isinstance(t, type) and issubclass(t, nn.Module) for t in predicate_or_type)
    ):
        classes = predicate_or_type
        return (lambda m: isinstance(m, classes)), "/".join(t.__name__ for t in classes)
    if callable(predicate_or_type):
        return predicate_or_type, getattr(predicate_or_type, "__name__", "predicate")
    raise TypeError(
        f"{argname} must be an nn.Module subclass, a tuple of them, or a callable(module) -> bool, "
        f"got {type(predicate_or_type).__name__}"
    )


def _make_entry(
    predicate_or_type: Any, fn: Any, num_experts: Any, argname: str = "predicate_or_type"
) -> _ExtractorEntry:
    predicate, description = _as_predicate(predicate_or_type, argname)
    if not callable(fn):
        raise TypeError(
            f"fn must be callable(module, inputs, output) -> tokens_per_expert, got {fn!r}"
        )
    if (
        num_experts is not None
        and not callable(num_experts)
        and (isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0)
    ):
        raise ValueError(
            f"num_experts must be a positive int, a callable(module) -> int or None, got {num_experts!r}"
        )
    return _ExtractorEntry(predicate, fn, num_experts, description)


def register_router_extractor(
    predicate_or_type: Any,
    fn: Extractor,
    *,
    num_experts: int | Callable[[nn.Module], int] | None = None,
) -> None:
    """Teach router capture (every :class:`RouterCapture` made afterwards) a new kind of router.

    Args:
        predicate_or_type: an ``nn.Module`` subclass (or tuple of them), or a callable
            ``module -> bool`` that says whether a module is such a router.
        fn: ``fn(module, inputs, output)``, called after each counted forward of the router,
            returns the ``[E]`` tensor of tokens per expert of that forward (on the device, do
            not call ``.item()``), or a pair ``(tokens_per_expert, aux_loss)`` with the layer's
            auxiliary loss of that forward (a 0-d tensor, before its coefficient) or ``None``.
        num_experts: the number of experts ``E`` (an int, or a callable on the module); default
            the module's ``num_experts`` attribute. It must be known when the routers are found.

    Example::

        register_router_extractor(MyGate, lambda m, inp, out: out.expert_counts)
    """
    _REGISTRY.append(_make_entry(predicate_or_type, fn, num_experts))


def clear_router_extractors() -> None:
    """Forget every extractor registered with :func:`register_router_extractor`."""
    _REGISTRY.clear()


def layer_number_from_name(name: str) -> int | None:
    """The first integer component of a dotted module name (``model.layers.10.mlp.gate`` ->
    ``10``), or ``None`` when there is none."""
    match = LAYER_NUMBER.search(name)
    return int(match.group(1)) if match else None


@dataclass
class RouterInfo:
    """One router found in the model.

    Attributes:
        name: the module's qualified name in the model.
        module: the router module.
        kind: ``"custom"``, ``"topk_router"``, ``"hf"`` or ``"torchtitan"``.
        num_experts: its number of experts ``E``.
        layer: the layer number used in keys (see the module docstring), or ``None`` before
            labels are assigned.
        label: the unique layer label used in keys (``str(layer)`` unless two routers clash).
        has_aux_loss: whether the router reports an auxiliary loss.
        has_z_loss: whether the router reports a router z-loss (Switch Transformers).
        computed_experts: how many of the ``num_experts`` columns, the first ones, are experts
            that compute; the others are experts without compute (ZAYA's skip expert,
            LongCat-Flash's zero experts), which a load statistic leaves out. ``None``: all.
    """

    name: str
    module: nn.Module
    kind: str
    num_experts: int
    layer: int | None = None
    label: str = ""
    has_aux_loss: bool = False
    has_z_loss: bool = False
    extractor: Extractor | None = field(default=None, repr=False)
    # the number of experts each token selects, where the router module does not say it
    # (DbrxRouter: its parent DbrxFFN's top_k)
    top_k: int | None = field(default=None, repr=False)
    sort_key: tuple = field(default=(), repr=False)
    computed_experts: int | None = None
    # the modality whose tokens the router sees, for routers of a block that splits the
    # tokens by ``moe_mm_token_type_ids`` (_MODALITY_ROUTER_PARENTS); None: every token
    modality: str | None = field(default=None, repr=False)


def count_dtype(device: torch.device | str | None) -> torch.dtype:
    """The dtype of the counts and aux sums kept on ``device``: float64 (exact integer counts
    up to 2**53), float32 on Apple's ``mps``, which has no float64 (exact up to 2**24 =
    16,777,216 tokens for one expert of one layer in one read; see :class:`RouterCapture`)."""
    if device is not None and torch.device(device).type == "mps":
        return torch.float32
    return torch.float64


def _router_classes(module: nn.Module) -> list[type]:
    """The module's class and its bases: FSDP2's ``fully_shard`` swaps a module's class for a
    generated subclass (``FSDPMixtralTopKRouter``), so the original is looked up in the MRO."""
    return [c for c in type(module).__mro__ if c not in (nn.Module, object)]


def _is_trainvitals_topk_router(module: nn.Module) -> bool:
    return hasattr(module, "num_experts") and any(
        c.__name__ == "TopKRouter" and c.__module__.startswith("trainvitals")
        for c in _router_classes(module)
    )


def _is_hf_router(module: nn.Module) -> bool:
    for cls in _router_classes(module):
        if not cls.__module__.startswith("transformers."):
            continue
        if cls.__name__ in HF_ROUTER_CLASSES:
            return True
        if _HF_GENERIC.search(cls.__name__):
            return hasattr(module, "num_experts") and hasattr(module, "top_k")
    return False


def _hf_switch_loss_family(module: nn.Module) -> bool:
    """Whether the router's transformers modeling module defines the standard
    ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` (Mixtral's,
    copied into each MoE family that trains with the Switch loss over its routers' logits)."""
    for cls in _router_classes(module):
        if not cls.__module__.startswith("transformers."):
            continue
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if not callable(fn):
            return False
        try:
            params = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return False
        return params == _HF_SWITCH_LOSS_PARAMS
    return False


def _hf_num_experts(module: nn.Module) -> int | None:
    """The number of experts a recognised Hugging Face router routes to: the width of its
    logits (``num_experts``, ``n_routed_experts`` for LongCat-Flash, the linear layer's
    ``out_features`` for DBRX, whose router has no such attribute)."""
    cls = _hf_class_name(module)
    if cls in _DBRX_ROUTERS or cls in _HF_EXPERTS_LINEAR:
        layer = getattr(module, _HF_EXPERTS_LINEAR.get(cls, "layer"), None)
        return _int_attr(layer, "out_features") if isinstance(layer, nn.Module) else None
    return _int_attr(module, _HF_EXPERTS_ATTR.get(cls, "num_experts"))


def _hf_class_name(module: nn.Module) -> str:
    for cls in _router_classes(module):
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(module).__name__


def _torchtitan_buffer(module: nn.Module) -> str | None:
    for name in _TORCHTITAN_BUFFERS:
        buf = module._buffers.get(name) if hasattr(module, "_buffers") else None
        if isinstance(buf, torch.Tensor) and buf.ndim == 1 and buf.numel() > 0:
            return name
    return None


def _int_attr(module: nn.Module, attr: str) -> int | None:
    value = getattr(module, attr, None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _is_hf_pretrained_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (looked up along the MRO, as FSDP2 swaps the class;
    by name, so that transformers is never imported here)."""
    return hasattr(module, "config") and any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _argument_position(module: nn.Module, argument: str) -> int | None:
    """The position of ``argument`` among the positional parameters of the module's
    ``forward`` (``attention_mask`` of ``forward(input_ids, attention_mask, ...)``: 1),
    ``None`` when it has none."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for pos, p in enumerate(parameters):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == argument:
            return pos
    return None


def _hf_mask_sources(model: nn.Module, routers: list[RouterInfo]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the transformers models (``PreTrainedModel``) that contain a Hugging
    Face router: the modules whose forward receives the attention mask (outer and inner, e.g.
    ``...ForCausalLM`` and its ``.model``; an encoder-decoder's ``.encoder`` and ``.decoder``
    stacks, each with its own mask)."""
    names = [r.name for r in routers if r.kind == "hf"]
    if not names:
        return []
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(_contains(name, n) for n in names) and _is_hf_pretrained_model(module)
    ]


def _contains(outer: str, name: str) -> bool:
    """Whether the module named ``outer`` contains the module named ``name`` (the root ``""``
    contains every module)."""
    return outer == "" or name.startswith(outer + ".")


def _hook_for(target: nn.Module, module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``hook`` of ``module``, to register on ``target`` (``module``, or the ``torch.compile``
    wrapper around it, whose hooks then get ``module``), run eagerly (:func:`eager_hook`)."""
    return eager_hook(hook if target is module else on_behalf_of(hook, module))


def _warn_unrecognised_hf_routers(model: nn.Module, routers: list[RouterInfo]) -> None:
    """Warn (naming the model) about transformers modules that look like MoE routers (class
    names ending in ``Router`` / ``Gating``) but are not recognised: their layers would be
    missing from the counts without a word (JetMoE, Switch Transformers, NLLB-MoE, DBRX, ...)."""
    claimed = [r.name for r in routers]
    missed: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        cls = _hf_class_name(module)
        if (
            (
                type(module).__module__.startswith("transformers.")
                or any(c.__module__.startswith("transformers.") for c in _router_classes(module))
            )
            and _HF_ROUTER_LIKE.search(cls)
            and not _HF_NOT_MOE.search(cls)
        ):
            missed.setdefault(cls, []).append(name)
    if missed:
        detail = "; ".join(
            f"{cls} x{len(names)} (e.g. {names[0]!r})" for cls, names in sorted(missed.items())
        )
        warnings.warn(
            f"trainvitals router capture: {type(model).__name__} has Hugging Face MoE router "
            f"modules that router capture does not recognise: {detail}. Their layers are not "
            "counted (found "
            f"{len(routers)} recognised router(s)); register an extractor for them with "
            "trainvitals.moe.capture.register_router_extractor() or pass extractors=",
            RuntimeWarning,
            stacklevel=3,
        )


def find_routers(model: nn.Module, extractors: Iterable[Any] | None = None) -> list[RouterInfo]:
    """The routers of ``model``, ordered numerically by layer, with unique layer labels.

    ``extractors`` are extra ``(predicate_or_type, fn)`` or ``(predicate_or_type, fn,
    num_experts)`` entries tried before the registered and built-in ones. A router nested
    inside another router is not counted again. Raises ``ValueError`` when a router's number of
    experts cannot be determined.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    local = [_entry_from_user(e) for e in (extractors or ())]
    entries = [*local, *reversed(_REGISTRY)]
    found: list[RouterInfo] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        info = _classify(name, module, entries)
        if info is not None:
            found.append(info)
            claimed.append(name)
    for r in found:
        if r.kind == "hf" and _hf_class_name(r.module) in _DBRX_ROUTERS and "." in r.name:
            # DbrxFFN (the router's parent) holds the top_k its route_tokens_to_experts uses
            parent = model.get_submodule(r.name.rpartition(".")[0])
            r.top_k = _int_attr(parent, "top_k")
    _assign_labels(found)
    return found


def _entry_from_user(entry: Any) -> _ExtractorEntry:
    if isinstance(entry, _ExtractorEntry):
        return entry
    if isinstance(entry, dict):
        return _make_entry(
            entry.get("predicate"), entry.get("fn"), entry.get("num_experts"), "extractors"
        )
    if isinstance(entry, Sequence) and len(entry) in (2, 3):
        return _make_entry(entry[0], entry[1], entry[2] if len(entry) == 3 else None, "extractors")
    raise TypeError(
        "extractors must be a sequence of (predicate_or_type, fn) or (predicate_or_type, fn, "
        f"num_experts) tuples, got an element {entry!r}"
    )


def _classify(name: str, module: nn.Module, entries: list[_ExtractorEntry]) -> RouterInfo | None:
    for entry in entries:
        if entry.predicate(module):
            num = entry.num_experts
            if callable(num):
                num = num(module)
            if num is None:
                num = _int_attr(module, "num_experts")
            if not isinstance(num, int) or isinstance(num, bool) or num <= 0:
                raise ValueError(
                    f"router {name!r} ({type(module).__name__}) matched the extractor "
                    f"{entry.description!r} but its number of experts is unknown: pass "
                    "num_experts= when registering the extractor or give the module a "
                    "num_experts attribute"
                )
            return RouterInfo(name, module, "custom", num, extractor=entry.fn, has_aux_loss=True)
    if _is_trainvitals_topk_router(module):
        num = _int_attr(module, "num_experts")
        if num is not None:
            return RouterInfo(name, module, "topk_router", num, has_aux_loss=True)
    if _is_hf_router(module):
        num = _hf_num_experts(module)
        if num is not None:
            cls = _hf_class_name(module)
            # Switch Transformers: its own per-sequence loss (_switch_seq_aux_loss)
            aux = cls not in _HF_NO_AUX and (
                cls in _HF_SOFTMAX_AUX
                or cls in _DISPATCH_ROUTERS
                or cls in _PRODUCT_KEY_ROUTERS
                or _hf_switch_loss_family(module)
            )
            parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            modality = _MODALITY_ROUTER_PARENTS.get(parent)
            return RouterInfo(
                name,
                module,
                "hf",
                num,
                # Ernie 4.5-VL: the layer's one loss term, over both modality routers' logits,
                # is reported on its text router's row (_add_modality_layer_aux)
                has_aux_loss=aux and modality != "vision",
                has_z_loss=cls in _DISPATCH_ROUTERS,  # Switch: router_z_loss_func
                computed_experts=_hf_computed(module, num),
                modality=modality,
            )
    buffer = _torchtitan_buffer(module)
    if buffer is not None:
        return RouterInfo(name, module, "torchtitan", int(module._buffers[buffer].numel()))
    return None


def _hf_computed(module: nn.Module, columns: int) -> int | None:
    """The experts that compute among the ``columns`` of a Hugging Face router whose columns
    include experts without compute (:data:`_HF_EXPERTS_ATTR`): its ``num_experts`` attribute
    (transformers 5.x modeling_zaya.py: ``num_router_classes = num_experts + 1``;
    modeling_longcat_flash.py: ``n_routed_experts = num_experts + zero_expert_num``). ``None``
    for the other routers (every column computes)."""
    if _hf_class_name(module) not in _HF_EXPERTS_ATTR:
        return None
    n = _int_attr(module, "num_experts")
    return n if n is not None and 0 < n < columns else None


def _assign_labels(routers: list[RouterInfo]) -> None:
    for pos, r in enumerate(routers):
        ints = tuple(int(m) for m in LAYER_NUMBER.findall(r.name))
        if ints:
            r.layer = ints[0]
            r.sort_key = (0, ints, pos)
        else:
            own = getattr(r.module, "layer_number", None)
            # TopKRouter.layer_number is 1-based (Megatron's convention); labels from names are
            # the 0-based block index, so shift it to match.
            valid = isinstance(own, int) and not isinstance(own, bool) and own >= 1
            r.layer = own - 1 if valid else pos
            r.sort_key = (1, (r.layer,), pos)
        r.label = str(r.layer)
    routers.sort(key=lambda r: r.sort_key)
    # Routers of one block (layers.3.experts.1.router, layers.3.experts.2.router) are told apart
    # by all the integers of their names (3_1, 3_2). Routers of different stacks that share a
    # block number (an encoder and a decoder: Switch Transformers' encoder.block.1.layer.1 and
    # decoder.block.1.layer.2) are not: their other integers are no expert or router index
    # (1_1 / 1_2 would read as two routers of one block), so their labels are full names.
    _dedupe(
        routers,
        lambda r: "_".join(str(i) for i in r.sort_key[1]),
        same_stack=lambda group: len({_stack_of(r.name) for r in group}) == 1,
    )
    # Full names without the wrappers' components (DDP's ``module.``, torch.compile's
    # ``_orig_mod.``, ...): the same model's keys on one and on several ranks.
    _dedupe(routers, lambda r: canonical_name(r.name).replace(".", "_"))


def _stack_of(name: str) -> str:
    """The part of a module name before its first integer component (``encoder.block`` of
    ``encoder.block.1.layer.1.mlp.router``): the stack of layers the router's block is in."""
    match = LAYER_NUMBER.search(name)
    return name[: match.start()] if match else name


def _dedupe(
    routers: list[RouterInfo],
    relabel: Callable[[RouterInfo], str],
    same_stack: Callable[[list[RouterInfo]], bool] | None = None,
) -> None:
    """Relabel the routers whose labels clash with ``relabel``; with ``same_stack``, only the
    groups of clashing routers it accepts (the others keep their label for the next pass)."""
    groups: dict[str, list[RouterInfo]] = {}
    for r in routers:
        groups.setdefault(r.label, []).append(r)
    for group in groups.values():
        if len(group) > 1 and (same_stack is None or same_stack(group)):
            for r in group:
                r.label = relabel(r)


class RouterCapture:
    """Hooks on the routers of ``model`` that count tokens per expert per layer on the device.

    Args:
        model: the model (any ``nn.Module``; wrappers such as DDP, Lightning modules and
            ``torch.compile``'s ``_orig_mod`` are fine: names keep their layer numbers).
        extractors: extra ``(predicate_or_type, fn[, num_experts])`` entries, see
            :func:`register_router_extractor`.
        attach: register the hooks now (default) or later with :meth:`attach`.

    Counts are kept in float64 (exact integers up to 2**53), except on Apple's ``mps``, which
    has no float64: there every count, aux sum and value read (:meth:`loads`, :meth:`packed`,
    ...) is float32 (:func:`count_dtype`), exact while one expert of one layer receives fewer
    than 2**24 = 16,777,216 tokens between two :meth:`reset` calls (``LoadBalanceMonitor``
    resets every optimizer step: that many tokens of one step on one device, far beyond a
    single Apple GPU's step); :meth:`read_host` warns once when a count reaches it.

    :attr:`fired` (a host bool) says whether a router hook ran in a training forward (the
    router in training mode) while :attr:`enabled` since the last :meth:`reset`: counts of
    zero with it ``False`` mean the hooks never ran (a model compiled before they were added:
    Dynamo does not guard on module hooks, ``torch._dynamo.config.skip_nnmodule_hook_guards``;
    a forward that calls ``router.forward`` directly; another copy of the model trained), not
    that nothing was routed. An evaluation forward does not set it.

    Raises ``ValueError`` when the routers do not all have the same number of experts (MoE
    layers with different expert counts, e.g. a Hunyuan-MoE config with a per-layer
    ``num_experts`` list, are not supported; layers without a router are fine).
    """

    def __init__(
        self, model: nn.Module, *, extractors: Iterable[Any] | None = None, attach: bool = True
    ) -> None:
        found = find_routers(model, extractors)
        # A router inside code compiled with fullgraph=True gets no hook (Dynamo refuses the
        # graph break of one; a compiled region's root is hooked on its wrapper instead):
        # left out, by name in fullgraph_routers (torchtitan compiles the MoE module's
        # children, not the MoE module whose buffer is read: those stay)
        regions = FullgraphRegions(model)
        targets = [regions.target(r.module) for r in found]
        self.routers = [r for r, t in zip(found, targets, strict=True) if t is not None]
        self.fullgraph_routers = [  # (named without torch.compile's _orig_mod., as elsewhere)
            canonical_name(r.name) for r, t in zip(found, targets, strict=True) if t is None
        ]
        # per router index, the torch.compile wrapper its hooks go on
        self._targets: dict[int, nn.Module] = {
            i: t
            for i, t in enumerate(t for t in targets if t is not None)
            if t is not self.routers[i].module
        }
        if self.fullgraph_routers and self.routers:
            warnings.warn(
                f"trainvitals router capture: {len(self.fullgraph_routers)} router(s) (e.g. "
                f"{self.fullgraph_routers[0]!r}) are inside a module compiled with "
                "fullgraph=True: a hook there would break the graph and Dynamo refuses; their "
                "layers are not counted. Compile without fullgraph, or leave the routers out of "
                "the compiled region, to count them",
                RuntimeWarning,
                stacklevel=2,
            )
        by_size: dict[int, list[str]] = {}
        for r in self.routers:
            by_size.setdefault(r.num_experts, []).append(r.name)
        if len(by_size) > 1:
            # One [layers, experts] table for all layers (and load-balance statistics that
            # would count padded experts as dead): per-layer expert counts are not supported.
            detail = "; ".join(
                f"{e} in {', '.join(names[:3])}"
                + (f" and {len(names) - 3} more" if names[3:] else "")
                for e, names in sorted(by_size.items())
            )
            raise ValueError(
                "routers must all have the same number of experts, found " + detail + ". "
                "Router capture and LoadBalanceMonitor do not support MoE layers with "
                "different numbers of experts (layers without a router, such as dense layers, "
                "are fine): leave LoadBalanceMonitor out for this model (MoEMetricsMonitor "
                "still reports the per-layer router losses that TopKRouter or "
                "get_moe_metrics_tracker().record() record)"
            )
        self.num_experts = next(iter(by_size)) if by_size else 0
        _warn_unrecognised_hf_routers(model, found)
        self.enabled = True
        # A router hook ran while counting was on, since the last reset (a host flag, set
        # only in logging steps): the owner tells "nothing routed" from "the hooks never ran"
        # (code compiled before they were added, a forward that bypasses __call__).
        self.fired = False
        self._handles: list[Any] = []
        self._acc: torch.Tensor | None = None  # [L, E + 1], last column = out-of-range indices
        self._acc_device: torch.device | None = None
        self._dirty = False  # something was added since the last reset (a host flag)
        self._aux_sum: torch.Tensor | None = None  # [L]
        self._aux_count = [0] * len(self.routers)  # host ints: no sync to count forwards
        # [L] router z-loss sums and forward counts, like the aux loss's (Switch routers only;
        # None without such a router: no tensor, no kernel for the other models)
        self._z_sum: torch.Tensor | None = None
        self._z_rows: list[torch.Tensor] = []
        self._z_count = [0] * len(self.routers)
        # [L] forwards among those of _aux_count that had no token to average over (a Hugging
        # Face micro-batch that is all padding): known on the device only, subtracted from the
        # counts when they are read, so such a forward does not count in the layer's mean.
        self._aux_empty: torch.Tensor | None = None
        self._aux_empty_rows: list[torch.Tensor] = []
        self._aux_empty_dirty = False  # something was added to it since the last reset
        self._rows: list[torch.Tensor] = []
        self._count_rows: list[torch.Tensor] = []
        self._aux_rows: list[torch.Tensor] = []
        self._ones: dict[torch.device, torch.Tensor] = {}
        # torchtitan: the buffer totals set aside by the pre-hook of a counted forward (an
        # entry is also the pre-hook's decision to count it, for the post-hook)
        self._snapshots: dict[int, torch.Tensor] = {}
        self._broken: set[int] = set()
        # per router: which of its forwards to count under activation checkpointing
        self._runs = [CheckpointRuns() for _ in self.routers]
        # Deferred counting (TopKRouter): a counted forward only keeps a reference to its
        # routing map and aux-loss tensor, each with its version counter (to detect a later
        # in-place change); _fold() counts all of them in a few kernels when the step is read,
        # instead of two or three kernels in every forward.
        self._pending_maps: list[tuple[int, torch.Tensor, int]] = []
        self._pending_aux: list[tuple[int, torch.Tensor, int]] = []
        self._pending_numel = 0
        self._row_indices: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        self._eager: set[int] = set()  # routers whose map was changed in place: count at once
        self._invalid: set[int] = set()  # rows whose counts of this step are unknown
        # Hugging Face routers see no attention mask: it is taken from the forward of the
        # transformers models that contain them, to leave padding tokens out (_hf_valid_tokens).
        sources = [
            (name, module)
            for name, module in _hf_mask_sources(model, self.routers)
            if regions.target(module) is not None  # (its routers are inside too)
        ]
        self._mask_sources = [module for _, module in sources]
        self._mask_targets = [regions.target(module) for module in self._mask_sources]
        # per Hugging Face router, the mask sources that contain it: its mask is the latest
        # recorded by one of them, never one of a model beside it (an encoder-decoder's
        # decoder stack records its own mask after the encoder's, and a reentrant re-run of an
        # encoder layer in the backward pass must still get the encoder's)
        self._router_sources: dict[int, list[int]] = {
            i: [s for s, (name, _) in enumerate(sources) if _contains(name, r.name)]
            for i, r in enumerate(self.routers)
            if r.kind == "hf"
        }
        # per mask source: (record number, 2-d attention mask or None, moe_mm_token_type_ids
        # [B, S] or None) of its latest training forward
        self._source_masks: dict[int, tuple[int, torch.Tensor | None, torch.Tensor | None]] = {}
        self._mask_records = 0
        # derived from them once per mask source, device and modality: (padding [N, 1] bool,
        # valid [N], valid count clamped to 1, 1.0 when no token is valid else 0.0)
        self._valid_tokens: dict[tuple[int, torch.device, str | None], _ValidTokens] = {}
        self._mask_mismatch_warned: set[int] = set()
        # Ernie 4.5-VL: routers of a block that splits tokens by modality, by the block's name
        # (the text router's row holds the layer's aux loss: _add_modality_layer_aux), and the
        # text router's sums of the latest forward of each block, for its vision router
        self._modality_block: dict[int, str] = {
            i: r.name.rsplit(".", 2)[0]
            for i, r in enumerate(self.routers)
            if r.modality is not None and r.name.count(".") >= 2
        }
        text_blocks = {
            b for i, b in self._modality_block.items() if self.routers[i].modality == "text"
        }
        self._modality_layer_rows = {
            i
            for i, b in self._modality_block.items()
            if b in text_blocks
            and (self.routers[i].has_aux_loss or self.routers[i].modality == "vision")
        }
        self._modality_partial: dict[str, tuple[Any, ...]] = {}
        self._float32_warned = False  # counts past FLOAT32_EXACT_COUNTS (mps), warned once
        if attach:
            self.attach()

    # ------------------------------------------------------------------ what was found

    @property
    def layer_labels(self) -> list[str]:
        return [r.label for r in self.routers]

    @property
    def has_aux_loss(self) -> bool:
        return any(r.has_aux_loss for r in self.routers)

    @property
    def has_z_loss(self) -> bool:
        return any(r.has_z_loss for r in self.routers)

    @property
    def broken(self) -> frozenset[int]:
        """Indices of the routers no longer counted (their counting raised, or their output was
        not understood, each warned once): their counts stop where that happened, so from that
        step on they are not a measurement."""
        return frozenset(self._broken)

    @property
    def device(self) -> torch.device | None:
        """Where the counts live (the routers' device), ``None`` before the first count."""
        return self._acc.device if self._acc is not None else None

    def __len__(self) -> int:
        return len(self.routers)

    # ------------------------------------------------------------------ hooks

    def attach(self) -> None:
        """Register the forward hooks (idempotent)."""
        if self._handles:
            return
        for i, r in enumerate(self.routers):
            target = self._targets.get(i, r.module)  # (a compiled region's wrapper)
            if r.kind == "torchtitan":
                self._handles.append(
                    target.register_forward_pre_hook(
                        _hook_for(target, r.module, self._make_pre_hook(i))
                    )
                )
            # always_call: a torchtitan buffer set aside by the pre-hook is put back also when
            # the forward raises (torch passes output=None then)
            self._handles.append(
                target.register_forward_hook(
                    _hook_for(target, r.module, self._make_hook(i)),
                    always_call=r.kind == "torchtitan",
                )
            )
        for source, module in enumerate(self._mask_sources):
            target = self._mask_targets[source]
            assert target is not None
            self._handles.append(
                target.register_forward_pre_hook(
                    _hook_for(
                        target,
                        module,
                        self._make_mask_pre_hook(
                            source,
                            _argument_position(module, "attention_mask"),
                            _argument_position(module, _TOKEN_TYPES_ARG),
                        ),
                    ),
                    with_kwargs=True,
                )
            )

    def remove(self) -> None:
        """Remove every hook; the accumulated counts stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._restore_titan_buffers()
        self._record_attention_mask(None)

    def _make_mask_pre_hook(
        self, source: int, position: int | None, types_position: int | None
    ) -> Callable[..., None]:
        """A pre-hook on a transformers model that records its forward's 2-d attention mask
        (``attention_mask=`` or the positional argument at ``position``); any other (none, a 4-d
        mask) clears it, so the routers count every token. Also records the forward's
        ``moe_mm_token_type_ids`` (at ``types_position``), which says the tokens of each
        modality router (:data:`_MODALITY_ROUTER_PARENTS`)."""

        def argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, pos: int | None):
            if name in kwargs:
                return kwargs[name]
            return args[pos] if pos is not None and len(args) > pos else None

        def mask_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.enabled or not module.training:
                return
            self._record_attention_mask(
                argument(args, kwargs, "attention_mask", position),
                argument(args, kwargs, _TOKEN_TYPES_ARG, types_position),
                source,
            )

        return mask_pre_hook

    def _record_attention_mask(
        self, mask: Any, token_types: Any = None, source: int | None = None
    ) -> None:
        """Record the mask of a forward of mask source ``source``; ``None``: forget every
        source's mask (the hooks were removed)."""
        if source is None:
            self._source_masks.clear()
        else:
            recorded: torch.Tensor | None = None
            types: torch.Tensor | None = None  # moe_mm_token_type_ids [B, S] (modality routers)
            if isinstance(mask, torch.Tensor) and mask.ndim == 2:
                recorded = local_tensor(mask).detach()
                if isinstance(token_types, torch.Tensor) and token_types.shape == recorded.shape:
                    types = local_tensor(token_types).detach()
            self._mask_records += 1
            self._source_masks[source] = (self._mask_records, recorded, types)
        self._valid_tokens.clear()

    def _router_mask(self, i: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """``(source, attention mask, token types)`` for router ``i``: the latest recorded by
        the transformers models that contain it (the innermost one in a plain forward; the
        encoder stack's, not the decoder's, for an encoder router), ``(-1, None, None)``
        when none has recorded one."""
        best = (-1, -1, None, None)
        for s in self._router_sources.get(i, ()):
            entry = self._source_masks.get(s)
            if entry is not None and entry[0] > best[1]:
                best = (s, *entry)
        return best[0], best[2], best[3]

    def _hf_valid_tokens(
        self, i: int, num_tokens: int, device: torch.device
    ) -> _ValidTokens | None:
        """``(padding [N, 1] bool, valid [N] float32, number of valid tokens (at least 1),
        1.0 when there is no valid token else 0.0)`` for a Hugging Face router's ``N`` tokens,
        from the recorded attention mask, on ``device``; ``None`` (count every token) without a
        mask or when its size is not the router's token count.

        The router sees the hidden states flattened row-major, ``[B, S, H] -> [B * S, H]``, so
        token ``b * S + s`` is ``mask[b, s]``; a modality router (Ernie 4.5-VL) sees the tokens
        of its modality only, in the same order (:meth:`_modality_mask`). Device kernels only:
        no host synchronisation."""
        source, mask, token_types = self._router_mask(i)
        if mask is None:
            return None
        modality = self.routers[i].modality if token_types is not None else None
        # a modality router sees at most every token (how many are its own is on the device)
        if num_tokens > mask.numel() if modality is not None else mask.numel() != num_tokens:
            if i not in self._mask_mismatch_warned:
                self._mask_mismatch_warned.add(i)
                warnings.warn(
                    f"trainvitals router capture: {self.routers[i].name!r} routed {num_tokens} "
                    f"tokens but the model's attention mask has {mask.numel()} "
                    f"(shape {tuple(mask.shape)}; e.g. a KV cache, or a model that removes "
                    "padding before its routers), so padding cannot be told apart: every token "
                    "it routes is counted",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        derived = self._valid_tokens.get((source, device, modality))
        if derived is None:
            flat = mask.reshape(-1)
            if flat.device != device:
                flat = _copy_to(flat, device)
            if modality is not None:
                assert token_types is not None
                flat = self._modality_mask(flat, token_types, modality, num_tokens)
            padding = (flat == 0).unsqueeze(-1)
            valid = (flat != 0).float()
            num_valid = valid.sum()
            derived = self._valid_tokens[(source, device, modality)] = (
                padding,
                valid,
                num_valid.clamp(min=1.0),
                (num_valid == 0).float(),
            )
        return derived

    def _modality_mask(
        self, flat: torch.Tensor, token_types: torch.Tensor, modality: str, num_tokens: int
    ) -> torch.Tensor:
        """The attention-mask values ``[num_tokens]`` of the tokens a modality router sees:
        those of ``flat`` (``[B * S]``) whose ``moe_mm_token_type_ids`` is 0 (``text``) or
        not 0 (``vision``), in order, as the block's ``hidden_states[mask]`` takes them.

        Without a host read of how many there are: each selected token's rank among them (a
        cumulative sum) is its place in the output; the others go to one spare slot past the
        end, which is dropped. The router's own ``N`` is the number selected."""
        types = token_types.reshape(-1)
        if types.device != flat.device:
            types = _copy_to(types, flat.device)
        selected = types == 0 if modality == "text" else types != 0
        rank = torch.cumsum(selected, 0) - 1
        place = torch.where(selected, rank, num_tokens).clamp_(max=num_tokens)
        out = flat.new_zeros(num_tokens + 1)
        out.scatter_(0, place, flat)
        return out[:num_tokens]

    def _make_pre_hook(self, i: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, inputs: Any) -> None:
            if not self.enabled or not module.training:
                return
            self.fired = True  # (a training forward: an evaluation does not say the hooks run)
            if i in self._broken:
                return
            if not self._runs[i].counts():
                return
            buffer = _torchtitan_buffer(module)
            if buffer is not None:
                # Set the running total aside and count this forward from zero: torchtitan's
                # float32 buffer is never zeroed without a load_balance_coeff, and past 2**24 a
                # difference of its totals loses tokens (a forward's add is rounded to the
                # total's spacing). The post-hook adds the total back.
                values = module._buffers[buffer].detach()
                self._snapshots[i] = values.clone()
                values.zero_()

        return pre_hook

    def _make_hook(self, i: int) -> Callable[..., None]:
        # TopKRouter (the common case) goes straight to its counting, without the dispatch
        # on the router kind: this runs in every forward of a logging step.
        topk = self.routers[i].kind == "topk_router"
        decided_before = self.routers[i].kind == "torchtitan"  # by its pre-hook

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if decided_before:
                self._titan_hook(i, module, output)
                return
            # the cheapest test first (False on steps that are not logged)
            if not self.enabled or not module.training:
                return
            self.fired = True  # (a training forward: an evaluation does not say the hooks run)
            if i in self._broken:
                return
            if not self._runs[i].counts():
                return
            try:
                if topk:
                    self._count_topk_router(i, module, output)
                else:
                    self._count(i, module, inputs, output)
            except Exception as exc:
                self._counting_failed(i, exc)

        return hook

    def _titan_hook(self, i: int, module: nn.Module, output: Any) -> None:
        """A torchtitan MoE's forward ended (``output`` is ``None`` when it raised): count
        what it added to the buffer its pre-hook zeroed, then add the set-aside total back,
        whatever happens (the buffer is the model's: torchtitan's bias update reads it)."""
        before = self._snapshots.pop(i, None)
        if before is None:  # not a counted forward: nothing was set aside
            return
        try:
            if output is not None and self.enabled and i not in self._broken:
                buffer = _torchtitan_buffer(module)
                if buffer is not None:
                    # this forward's counts alone: exact, added into the float64 accumulator
                    # (stream-ordered before the put-back below)
                    self._add_counts(i, local_tensor(module._buffers[buffer].detach()))
        except Exception as exc:
            self._counting_failed(i, exc)
        finally:
            self._put_back(module, before)

    @staticmethod
    def _put_back(module: nn.Module, before: torch.Tensor) -> None:
        """Add a torchtitan buffer's set-aside total back: ``before + counts``, with the one
        float32 rounding torchtitan's own ``add_`` would have made."""
        buffer = _torchtitan_buffer(module)
        if buffer is not None:
            module._buffers[buffer].detach().add_(before)

    def _restore_titan_buffers(self) -> None:
        """Put back every set-aside torchtitan total (none between forwards; a safety net for
        hooks removed or reset in the middle of one)."""
        snapshots, self._snapshots = self._snapshots, {}
        for i, before in snapshots.items():
            self._put_back(self.routers[i].module, before)

    def _counting_failed(self, i: int, exc: Exception) -> None:
        if _strict():
            raise exc
        self._broken.add(i)
        warnings.warn(
            f"trainvitals router capture: counting {self.routers[i].name!r} raised "
            f"{type(exc).__name__}: {exc}; this router is no longer counted",
            RuntimeWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ counting

    def _count(self, i: int, module: nn.Module, inputs: Any, output: Any) -> None:
        r = self.routers[i]
        if r.kind == "hf":
            cls = _hf_class_name(module)
            if cls in _DISPATCH_ROUTERS:
                self._count_hf_dispatch(i, output)
                return
            if cls in _PRODUCT_KEY_ROUTERS:
                self._count_hf_product_keys(i, module, output)
                return
            top_k = r.top_k if r.top_k is not None else getattr(module, "top_k", None)
            logits, indices = _hf_logits_and_indices(cls, output, top_k, module)
            if (
                not isinstance(indices, torch.Tensor)
                or indices.is_floating_point()
                or indices.ndim != 2
                or (isinstance(top_k, int) and indices.shape[-1] != top_k)
                or not isinstance(logits, torch.Tensor)
                or logits.shape[-1] != r.num_experts
            ):
                # shape checks only (host metadata): the counts must be top-k indices
                self._unsupported(
                    i, "expected (router_logits [N, E], scores [N, k], indices [N, k] integer)"
                )
                return
            indices = local_tensor(indices)
            valid = self._hf_valid_tokens(i, indices.shape[0], indices.device)
            if valid is not None:
                # padding tokens go to the overflow column (never reported)
                indices = indices.masked_fill(valid[0], r.num_experts)
            self._add_indices(i, indices)  # the router's own selection: the loads
            layer_term = i in self._modality_layer_rows
            if (r.has_aux_loss or layer_term) and logits.ndim == 2:
                # the loss's own top-k (not the router's) and probabilities, as Hugging Face's
                # load_balancing_loss_func takes them, on the logits' device
                probs, counts = self._hf_loss_counts(local_tensor(logits), indices.shape[-1], valid)
                aux = None
                if r.has_aux_loss:
                    aux = _switch_aux_loss(probs, counts, indices.shape[-1], valid)
                    self._add_aux(i, aux)
                    if aux is not None and valid is not None:
                        self._add_aux_empty(i, valid[3])
                if layer_term:
                    self._add_modality_layer_aux(i, probs, counts, indices.shape[-1], valid, aux)
        elif r.kind == "topk_router":
            self._count_topk_router(i, module, output)
        elif r.kind == "torchtitan":  # counted by its own hook (_titan_hook)
            return
        else:
            result = r.extractor(module, inputs, output)  # type: ignore[misc]
            aux = None
            if isinstance(result, tuple | list):
                result, aux = result[0], (result[1] if len(result) > 1 else None)
            if result is None:
                return
            if not isinstance(result, torch.Tensor) or result.numel() != r.num_experts:
                self._unsupported(
                    i, f"the extractor must return a tensor of {r.num_experts} counts"
                )
                return
            self._add_counts(i, local_tensor(result).detach().reshape(-1))
            self._add_aux(i, aux)

    def _add_modality_layer_aux(
        self,
        i: int,
        probs: torch.Tensor,
        counts: torch.Tensor,
        top_k: int,
        valid: _ValidTokens | None,
        aux: Any,
    ) -> None:
        """Ernie 4.5-VL: make the text router's row hold the layer's loss term as transformers
        computes it. ``Ernie4_5_VLMoeMoeBlock.forward`` (transformers 5.x) scatters both modality
        routers' logits into one ``[B * S, E]`` tensor, each token's row from its own modality's
        router, and ``load_balancing_loss_func`` takes one term of the layer over it: text
        expert ``e`` and vision expert ``e`` share column ``e``. The text router runs first and
        adds its own term (the layer's when the vision router does not run: a text-only
        forward); the vision router, when it runs, adds the difference to the layer's term of
        both routers' sums. Device kernels only."""
        n_raw = (
            torch.tensor(float(probs.shape[0]), device=probs.device)
            if valid is None
            else valid[1].sum().to(probs.device)
        )
        weighted = probs if valid is None else valid[1].to(probs.device).unsqueeze(-1) * probs
        sums = (weighted.sum(dim=0), counts.to(probs.dtype), n_raw)
        block = self._modality_block[i]
        if self.routers[i].modality != "vision":
            self._modality_partial[block] = (i, *sums, aux, valid)
            return
        held = self._modality_partial.pop(block, None)
        if held is None:  # (the text router always runs first in the block)
            return
        text_row, text_probs, text_counts, text_n, text_aux, text_valid = held
        total = text_n + _copy_to(sums[2], text_n.device)
        n = total.clamp(min=1.0)
        probs_sum = text_probs + _copy_to(sums[0], text_probs.device)
        counts_sum = text_counts + _copy_to(sums[1], text_counts.device)
        num_experts = probs_sum.shape[0]
        layer = (counts_sum * probs_sum).sum() * num_experts / (n * n * top_k)
        if text_aux is None:  # every token was an image or video token: no text term
            self._add_aux(text_row, layer)
            if valid is not None:
                self._add_aux_empty(text_row, (total == 0).float())
            return
        self._add_aux_delta(text_row, layer - text_aux)
        if text_valid is not None:
            # the layer has a token when either router had one: undo the text forward's mark
            self._add_aux_empty(text_row, -text_valid[3] * (sums[2] > 0).to(text_valid[3]))

    def _add_aux_delta(self, i: int, delta: torch.Tensor) -> None:
        """Add ``delta`` to row ``i``'s aux sum without counting a forward (device add)."""
        delta = _as_aux_tensor(delta)
        if delta.device != self._acc_device:
            delta = _copy_to(delta, self._acc_device)
        self._aux_rows[i].add_(delta.to(self._aux_rows[i].dtype))
        self._dirty = True

    def _count_hf_dispatch(self, i: int, output: Any) -> None:
        """A router that returns its one-hot dispatch mask after the capacity drop
        (``_DISPATCH_ROUTERS``): ``(dispatch [B, S, E], probs, router_logits [B, S, E])``. The
        counts are the mask's sum over the tokens that are not padding; the aux loss is the
        family's per-sequence Switch loss (:func:`_switch_seq_aux_loss`)."""
        e = self.routers[i].num_experts
        dispatch = output[0] if isinstance(output, tuple | list) and len(output) == 3 else None
        logits = output[2] if dispatch is not None else None
        if (
            not isinstance(dispatch, torch.Tensor)
            or dispatch.is_floating_point()
            or dispatch.shape[-1] != e
            or not isinstance(logits, torch.Tensor)
            or logits.shape != dispatch.shape
            or logits.ndim != 3
        ):
            self._unsupported(
                i, "expected (dispatch mask [B, S, E] integer, probs, router_logits [B, S, E])"
            )
            return
        flat = local_tensor(dispatch).detach().reshape(-1, e)
        valid = self._hf_valid_tokens(i, flat.shape[0], flat.device)
        if valid is not None:
            flat = flat.masked_fill(valid[0], 0)  # padding tokens are not counted
        self._add_counts(i, flat.sum(dim=0))
        if self.routers[i].has_aux_loss:
            self._add_aux(i, _switch_seq_aux_loss(local_tensor(logits)))
        if self.routers[i].has_z_loss:
            self._add_z(i, _switch_z_loss(local_tensor(logits)))

    def _count_hf_product_keys(self, i: int, module: nn.Module, output: Any) -> None:
        """A product-key MoE module (``_PRODUCT_KEY_ROUTERS``, Doge's ``DogeCDMoE``): output
        ``(hidden_states, router_logits [2, N, num_keys])``. The counts are its own selection
        recomputed from the logits (:func:`_product_key_routing`), padding left out; the aux
        loss is the family's ``load_balancing_loss_func`` term of the layer, which divides the
        counts by ``T * k`` and so is already 1.0 at perfect balance."""
        r = self.routers[i]
        logits = output[1] if isinstance(output, tuple | list) and len(output) >= 2 else None
        num_keys, top_k = _int_attr(module, "num_keys"), _int_attr(module, "top_k")
        if (
            not isinstance(logits, torch.Tensor)
            or logits.ndim != 3
            or logits.shape[0] != 2
            or num_keys is None
            or top_k is None
            or logits.shape[-1] < num_keys
            or num_keys * num_keys > r.num_experts
        ):
            self._unsupported(i, "expected (hidden_states, router_logits [2, N, num_keys])")
            return
        indices, probs = _product_key_routing(
            local_tensor(logits).detach(), num_keys, top_k, r.num_experts
        )
        valid = self._hf_valid_tokens(i, indices.shape[0], indices.device)
        if r.has_aux_loss:
            counts = self._selection_counts(indices, valid, r.num_experts)
        if valid is not None:
            indices = indices.masked_fill(valid[0], r.num_experts)  # padding: overflow column
        self._add_indices(i, indices)
        if r.has_aux_loss:
            aux = _switch_aux_loss(probs, counts, top_k, valid)
            self._add_aux(i, aux)
            if aux is not None and valid is not None:
                self._add_aux_empty(i, valid[3])

    @staticmethod
    def _hf_loss_counts(
        logits: torch.Tensor, top_k: int, valid: _ValidTokens | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs [N, E] float32, counts [E])``: the router probabilities and the top-k counts
        of the tokens that are not padding that Hugging Face's ``load_balancing_loss_func`` uses
        (device kernels only).

        As transformers 5.x ``models/mixtral/modeling_mixtral.py::load_balancing_loss_func``
        (the same in every family that copies it): ``softmax(router_logits, dim=-1)`` in the
        logits' own dtype, its top-k, and the probabilities cast ``.float()`` afterwards. So
        with bf16 logits the softmax is bf16, where the router itself (Mixtral, Qwen-MoE,
        OLMoE) takes the top-k of a float32 softmax: near ties (probabilities equal in bf16)
        pick other experts, and these counts are the loss's, not the loads. The call is the
        same as transformers' and runs inside the same model forward, so an autocast context
        turns both into the same float32 softmax."""
        probs = torch.nn.functional.softmax(logits.detach(), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
        return probs.float(), RouterCapture._selection_counts(selected, valid, logits.shape[-1])

    @staticmethod
    def _selection_counts(
        selected: torch.Tensor, valid: _ValidTokens | None, num_experts: int
    ) -> torch.Tensor:
        """Float32 counts ``[num_experts]`` of the top-k selections ``[N, k]``, each weighted by
        its token's mask (0 for padding), as transformers' ``load_balancing_loss_func`` counts
        them (device kernels only)."""
        if valid is None:
            weights = torch.ones(selected.numel(), dtype=torch.float32, device=selected.device)
        else:
            weights = valid[1].float().unsqueeze(-1).expand(selected.shape).reshape(-1)
        counts = torch.zeros(num_experts, dtype=torch.float32, device=selected.device)
        return counts.index_add_(0, selected.reshape(-1), weights)

    def _count_topk_router(self, i: int, module: nn.Module, output: Any) -> None:
        num_experts = self.num_experts
        routing_map = output[1] if isinstance(output, tuple | list) and len(output) >= 2 else None
        if not isinstance(routing_map, torch.Tensor) or routing_map.shape[-1] != num_experts:
            self._unsupported(i, "expected (probs, routing_map [T, E])")
            return
        if type(routing_map) is not torch.Tensor:
            routing_map = local_tensor(routing_map)  # a DTensor: its local tokens
        if routing_map.ndim != 2:
            routing_map = routing_map.reshape(-1, num_experts)
        if module.pad_to_capacity and isinstance(output[0], torch.Tensor):
            # padding slots are marked in the map with weight 0: count routed tokens only
            routing_map = routing_map & (local_tensor(output[0]).reshape(-1, num_experts) > 0)
        aux = module.last_aux_loss
        if aux is not None and module.aux_loss_type == "global_aux_loss":
            # last_aux_loss is this rank's share of the global-batch loss (the shares sum to
            # it over dp_group); the owner averages over data parallel, so hand it share x
            # group size, whose mean over the group is the global loss (the tracker's value).
            ranks = group_size(module.dp_group)
            if ranks > 1:
                aux = aux * ranks
        if i in self._eager:
            self._add_counts(i, routing_map.sum(dim=0))
            self._add_aux(i, aux)
        else:
            self._defer(i, routing_map, aux)

    def _unsupported(self, i: int, why: str) -> None:
        self._broken.add(i)
        warnings.warn(
            f"trainvitals router capture: {self.routers[i].name!r} "
            f"({type(self.routers[i].module).__name__}) returned an unexpected output ({why}); "
            "it is no longer counted. Register an extractor for it with "
            "register_router_extractor().",
            RuntimeWarning,
            stacklevel=3,
        )

    def _accumulator(self, device: torch.device) -> torch.Tensor:
        if self._acc is None:
            dtype = count_dtype(device)
            acc = torch.zeros(len(self.routers), self.num_experts + 1, dtype=dtype, device=device)
            self._aux_sum = torch.zeros(len(self.routers), dtype=dtype, device=device)
            self._aux_empty = torch.zeros(len(self.routers), dtype=dtype, device=device)
            self._aux_empty_rows = list(self._aux_empty.unbind(0))
            # Views made once, so that each forward's hook is one or two kernels, no indexing.
            self._rows = list(acc.unbind(0))
            self._count_rows = list(acc[:, : self.num_experts].unbind(0))
            self._aux_rows = list(self._aux_sum.unbind(0))
            if self.has_z_loss:
                self._z_sum = torch.zeros(len(self.routers), dtype=dtype, device=device)
                self._z_rows = list(self._z_sum.unbind(0))
            self._acc = acc
            self._acc_device = acc.device
        return self._acc

    def _add_indices(self, i: int, indices: torch.Tensor) -> None:
        """Add the forward's counts of the top-k ``indices`` ``[N, k]`` to row ``i``."""
        acc = self._accumulator(indices.device)
        e = self.num_experts
        idx = indices.detach().reshape(-1)
        if idx.device != acc.device:
            idx = _copy_to(idx, acc.device)
        # Out-of-range indices (sentinels) go to the overflow column e.
        idx = idx.clamp(-1, e).remainder_(e + 1)
        self._rows[i].index_add_(0, idx, self._ones_for(acc, idx.numel()))
        self._dirty = True

    def _ones_for(self, acc: torch.Tensor, n: int) -> torch.Tensor:
        ones = self._ones.get(acc.device)
        if ones is None or ones.numel() < n or ones.dtype != acc.dtype:
            ones = torch.ones(max(n, 4096), dtype=acc.dtype, device=acc.device)
            self._ones[acc.device] = ones
        return ones[:n]

    def _on_acc_device(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` on the accumulators' device; the first value added makes them, on its
        own device."""
        if self._acc is None:
            self._accumulator(value.device)
        elif value.device != self._acc_device:
            value = _copy_to(value, self._acc_device)
        return value

    def _add_counts(self, i: int, counts: torch.Tensor) -> None:
        counts = self._on_acc_device(counts)
        self._count_rows[i].add_(counts)  # in-place add casts integer counts to the acc's dtype
        self._dirty = True

    def _defer(self, i: int, routing_map: torch.Tensor, aux: Any) -> None:
        """Keep the forward's routing map (and aux loss) for :meth:`_fold`: no kernel here."""
        if self._acc is None:
            self._accumulator(routing_map.device)
        self._pending_maps.append((i, routing_map, routing_map._version))
        if aux is not None:
            aux = _as_aux_tensor(aux)
            self._pending_aux.append((i, aux, aux._version))
            self._aux_count[i] += 1
        self._pending_numel += routing_map.numel()
        if self._pending_numel > _MAX_PENDING_NUMEL:
            # Long accumulation with large maps: count what is held so far to bound memory.
            self._fold()

    def _fold(self) -> None:
        """Count the deferred routing maps and aux losses into the accumulators: one stack, one
        sum and one ``index_add_`` per map shape (usually one shape per step), one for the aux.

        A held tensor whose version changed since its forward was modified in place by the
        model afterwards, so its values are no longer the routing of that forward: the layer's
        counts of the step are dropped (the layer reports nothing for the step, which is
        better than a wrong number) and that router is counted in its hook from then on."""
        maps, auxs = self._pending_maps, self._pending_aux
        if not maps and not auxs:
            self._drop_invalid()
            return
        self._pending_maps, self._pending_aux, self._pending_numel = [], [], 0
        changed = {i for i, t, version in maps + auxs if t._version != version}
        if changed:
            self._invalidate(changed)
        acc = self._acc
        assert acc is not None and self._aux_sum is not None  # made by the first _defer
        self._dirty = True
        counts = acc[:, : self.num_experts]
        for rows, stacked in self._stack_by_shape(maps, changed):
            sums = stacked.sum(dim=1, dtype=acc.dtype)  # [maps, E], exact integers
            counts.index_add_(0, self._row_index(rows, acc.device), _copy_to(sums, acc.device))
        for rows, stacked in self._stack_by_shape(auxs, changed):
            values = _copy_to(stacked, acc.device).to(acc.dtype)  # float32->float64: exact
            self._aux_sum.index_add_(0, self._row_index(rows, acc.device), values)
        self._drop_invalid()

    @staticmethod
    def _stack_by_shape(
        held: list[tuple[int, torch.Tensor, int]], skip: set[int]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """The held tensors of the rows not in ``skip``, stacked per (shape, device): a list of
        (their rows, in forward order; the stacked tensors)."""
        groups: dict[tuple[Any, ...], tuple[list[int], list[torch.Tensor]]] = {}
        for i, t, _ in held:
            if i not in skip:
                group = groups.setdefault((t.shape, t.device), ([], []))
                group[0].append(i)
                group[1].append(t)
        return [
            (rows, torch.stack(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0))
            for rows, tensors in groups.values()
        ]

    def _invalidate(self, rows: set[int]) -> None:
        for i in sorted(rows - self._eager):
            warnings.warn(
                f"trainvitals router capture: the routing output of {self.routers[i].name!r} "
                "was modified in place after its forward; its counts of this step are "
                "dropped and it is counted in its forward hook from now on",
                RuntimeWarning,
                stacklevel=4,
            )
        self._eager.update(rows)
        self._invalid.update(rows)

    def _drop_invalid(self) -> None:
        """Zero the rows whose counts of this step are unknown (also what was counted in the
        hook after the change was found, so a row never holds part of a step)."""
        for i in self._invalid:
            self._rows[i].zero_()
            self._aux_rows[i].zero_()
            self._aux_empty_rows[i].zero_()
            self._aux_count[i] = 0
            if self._z_rows:
                self._z_rows[i].zero_()
                self._z_count[i] = 0

    def _row_index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """The rows as a device index tensor, cached: the order of the layers' forwards is
        the same at every step, so this is built once."""
        key = (device, tuple(rows))
        index = self._row_indices.get(key)
        if index is None:
            if len(self._row_indices) > 64:
                self._row_indices.clear()
            index = index_on(rows, device)
            self._row_indices[key] = index
        return index

    def _add_aux(self, i: int, aux: Any) -> None:
        if aux is None:
            return
        aux = self._on_acc_device(_as_aux_tensor(aux))
        self._aux_rows[i].add_(aux)
        self._aux_count[i] += 1
        self._dirty = True

    def _add_z(self, i: int, z: Any) -> None:
        """Add one forward's router z-loss to row ``i`` (a device add, as :meth:`_add_aux`)."""
        if z is None:
            return
        self._z_rows[i].add_(self._on_acc_device(z))
        self._z_count[i] += 1
        self._dirty = True

    def _add_aux_empty(self, i: int, empty: torch.Tensor) -> None:
        """Mark the forward just counted by :meth:`_add_aux` as having had no token (``empty``
        a device 0-d 1.0) or not (0.0): one kernel, no host synchronisation."""
        if empty.device != self._acc_device:
            empty = _copy_to(empty, self._acc_device)
        self._aux_empty_rows[i].add_(empty)
        self._aux_empty_dirty = True

    def _aux_count_tensor(self, device: torch.device | None) -> torch.Tensor:
        """The ``[L]`` counts of forwards with an aux loss and a token, on ``device``, in its
        :func:`count_dtype`."""
        count = _host_counts(self._aux_count, device)
        if self._aux_empty_dirty and self._aux_empty is not None:
            count = count - self._aux_empty.to(count.device, count.dtype)
        return count

    # ------------------------------------------------------------------ reading

    def loads(self, device: torch.device | None = None) -> torch.Tensor:
        """Tokens per expert per layer since the last :meth:`reset`: a new ``[L, E]`` tensor
        (rows in :attr:`routers` order) on the accumulator's device (or ``device`` when
        nothing was counted yet), float64 (float32 on ``mps``: :func:`count_dtype`)."""
        self._fold()
        if self._acc is None:
            return torch.zeros(
                len(self.routers), self.num_experts, dtype=count_dtype(device), device=device
            )
        return self._acc[:, : self.num_experts].clone()

    def aux_losses(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum, count)`` of the auxiliary losses recorded per layer since the last reset, two
        ``[L]`` tensors of :func:`count_dtype` (their ratio is the mean over micro-batches;
        count 0 = unknown)."""
        self._fold()
        dev = self._acc.device if self._acc is not None else device
        count = self._aux_count_tensor(dev)
        if self._aux_sum is None:
            return torch.zeros(len(self.routers), dtype=count.dtype, device=dev), count
        return self._aux_sum.clone(), count

    def packed(self, device: torch.device | None = None) -> torch.Tensor:
        """One new tensor (:func:`count_dtype`) of ``L * E + 2 L`` values: the loads of :meth:`loads`
        (row-major), then the aux-loss sums and counts of :meth:`aux_losses`, on the
        accumulator's device (or ``device`` when nothing was counted yet); when a router
        reports a z-loss (:attr:`has_z_loss`), ``2 L`` more: the z-loss sums and the counts
        of the forwards that reported one. For a caller that reads everything in one transfer
        (:func:`unpack_loads`, :func:`unpack_z_losses` split it). The counts are on the device
        because a forward with no token to average over (a Hugging Face micro-batch that is
        all padding) is known there only."""
        self._fold()
        z = self.has_z_loss
        if self._acc is None:
            num_layers = len(self.routers)
            n = num_layers * (self.num_experts + 1)
            loads_and_sums = torch.zeros(n, dtype=count_dtype(device), device=device)
            parts = [loads_and_sums, self._aux_count_tensor(loads_and_sums.device)]
            if z:  # nothing counted: no z-loss either
                parts.append(torch.zeros_like(loads_and_sums[: 2 * num_layers]))
            return torch.cat(parts)
        parts = [
            self._acc[:, : self.num_experts].reshape(-1),
            self._aux_sum,
            self._aux_count_tensor(self._acc.device),
        ]
        if z:
            parts += [self._z_sum, _host_counts(self._z_count, self._acc.device)]
        return torch.cat(parts)  # type: ignore[arg-type]

    def read_host(self) -> tuple[list[list[float]], list[float], list[int]]:
        """:meth:`_read_host`, with a warning (once) when float32 counts (``mps``) reached
        :data:`FLOAT32_EXACT_COUNTS`, where they may have lost tokens."""
        rows, aux_sum, aux_count = self._read_host()
        if (
            self._acc is not None
            and self._acc.dtype == torch.float32
            and not self._float32_warned
            and any(v >= FLOAT32_EXACT_COUNTS for row in rows for v in row)
        ):
            self._float32_warned = True
            warnings.warn(
                f"trainvitals router capture: an expert received {FLOAT32_EXACT_COUNTS} tokens "
                f"or more in one step on {self._acc.device}, which has no float64: its float32 "
                "count is no longer exact and may be too low (log with fewer tokens per step "
                "per device to keep it exact)",
                RuntimeWarning,
                stacklevel=2,
            )
        return rows, aux_sum, aux_count

    def _read_host(self) -> tuple[list[list[float]], list[float], list[int]]:
        """``(loads, aux_sums, aux_counts)`` since the last :meth:`reset`, on the host: ``L``
        rows of ``E`` floats (the values of :meth:`loads`), ``L`` floats and ``L`` ints, read
        with one device-to-host transfer. For a caller with nothing to reduce across ranks
        (without the z-losses: read :meth:`packed` for those).

        The step's held routing maps are summed per forward on the device (a stack and a
        sum, whatever the number of layers and micro-batches) and read back together with
        the aux losses; the per-layer totals of these few values are then added on the host,
        so no accumulator is written (nor zeroed by :meth:`reset`). Large or unusual cases
        (maps of several shapes or devices, a map changed in place, more than a few thousand
        values) go through the device accumulator (:meth:`packed`) instead."""
        e, num_layers = self.num_experts, len(self.routers)
        maps, auxs = self._pending_maps, self._pending_aux
        acc = self._acc
        held = maps + auxs
        if (
            self._invalid
            or len(maps) * e > _HOST_SUM_MAX
            or any(t._version != version for _, t, version in held)
            or (acc is not None and any(t.device != acc.device for _, t, _ in held))
            or len({t.shape for _, t, _ in maps}) > 1
        ):
            host_values = self.packed().cpu().tolist()
            rows, aux_sum = unpack_loads(host_values, num_layers, e)
            counts = host_values[num_layers * (e + 1) : num_layers * (e + 2)]
            return rows, aux_sum, [int(c) for c in counts]
        parts: list[torch.Tensor] = []
        with_acc = self._dirty and acc is not None and self._aux_sum is not None
        if with_acc:
            # counts added in the hooks (routers counted eagerly) or folded early
            parts += [acc[:, :e].reshape(-1), self._aux_sum]  # type: ignore[list-item]
        with_empty = self._aux_empty_dirty and self._aux_empty is not None
        if with_empty:
            parts.append(self._aux_empty)  # type: ignore[arg-type]
        if maps:
            ((_, stacked),) = self._stack_by_shape(maps, set())  # one shape, one device
            parts.append(stacked.sum(dim=1, dtype=count_dtype(stacked.device)).reshape(-1))
        if auxs:
            parts.append(torch.stack([t for _, t, _ in auxs]))
        if not parts:
            return [[0.0] * e for _ in range(num_layers)], [0.0] * num_layers, list(self._aux_count)
        # One transfer; cat promotes float32 parts to float64 (exactly).
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        pos = 0
        if with_acc:
            rows = [host[j : j + e] for j in range(0, num_layers * e, e)]
            pos = num_layers * e
            aux_sum = host[pos : pos + num_layers]
            pos += num_layers
        else:
            rows = [[0.0] * e for _ in range(num_layers)]
            aux_sum = [0.0] * num_layers
        aux_count = list(self._aux_count)
        if with_empty:
            # forwards that had no token do not count (exact small integers in float)
            aux_count = [
                c - int(x) for c, x in zip(aux_count, host[pos : pos + num_layers], strict=True)
            ]
            pos += num_layers
        for i, _, _ in maps:
            rows[i] = [a + b for a, b in zip(rows[i], host[pos : pos + e], strict=True)]
            pos += e
        for i, _, _ in auxs:  # in forward order, as the device accumulator adds them
            aux_sum[i] += host[pos]
            pos += 1
        return rows, aux_sum, aux_count

    def reset(self) -> None:
        """Zero the counts on the device (no synchronisation; no kernel either when nothing
        was counted since the last reset, e.g. on a step that is not logged), and clear
        :attr:`fired`."""
        self.fired = False
        if self._dirty:
            if self._acc is not None:
                self._acc.zero_()
            if self._aux_sum is not None:
                self._aux_sum.zero_()
            if self._z_sum is not None:
                self._z_sum.zero_()
            self._dirty = False
        if self._aux_empty_dirty:
            if self._aux_empty is not None:
                self._aux_empty.zero_()
            self._aux_empty_dirty = False
        self._aux_count = [0] * len(self.routers)
        self._z_count = [0] * len(self.routers)
        self._modality_partial.clear()
        self._restore_titan_buffers()
        for runs in self._runs:  # (a held-back run of this step is not re-run any more)
            runs.held_back = 0
        self._pending_maps.clear()
        self._pending_aux.clear()
        self._pending_numel = 0
        self._invalid.clear()


def unpack_loads(
    host: list[float], num_layers: int, num_experts: int
) -> tuple[list[list[float]], list[float]]:
    """The ``[layers][experts]`` loads and the ``[layers]`` aux-loss sums from the host copy of
    a buffer laid out as :meth:`RouterCapture.packed` makes it (loads row-major, then the aux
    sums; anything after them, e.g. summed aux counts, is ignored)."""
    n = num_layers * num_experts
    rows = [host[i : i + num_experts] for i in range(0, n, num_experts)]
    return rows, host[n : n + num_layers]


def unpack_z_losses(
    host: list[float], num_layers: int, num_experts: int
) -> tuple[list[float], list[float]]:
    """The ``[layers]`` router z-loss sums and counts from the host copy of a buffer laid out as
    :meth:`RouterCapture.packed` makes it with :attr:`RouterCapture.has_z_loss` (after the
    loads and the aux sums and counts); zeros when the buffer has no z-loss part."""
    start = num_layers * (num_experts + 2)
    if len(host) < start + 2 * num_layers:
        return [0.0] * num_layers, [0.0] * num_layers
    return host[start : start + num_layers], host[start + num_layers : start + 2 * num_layers]


def _host_counts(counts: list[int], device: torch.device | None) -> torch.Tensor:
    """Host ints as a ``[L]`` tensor on ``device`` in its :func:`count_dtype`, built on the host
    and copied without waiting for the device."""
    host = torch.tensor(counts, dtype=count_dtype(device))
    return host if device is None else host_to_device(host, device)


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, without waiting for the device where that is safe: a copy to
    an accelerator is stream-ordered before the kernels that read it, but a ``non_blocking``
    copy from an accelerator to host memory may be read by the host before it has landed
    (PyTorch's "non_blocking and pin_memory" guide), so that one waits (a model split over
    devices with routers on the CPU, e.g. ``device_map="auto"`` with offloaded layers)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=torch.device(device).type != "cpu")


def _as_aux_tensor(aux: Any) -> torch.Tensor:
    """A forward's aux loss as a detached 0-d tensor on its device."""
    if type(aux) is not torch.Tensor or aux.requires_grad or aux.dim() != 0:
        # The general case (a number, a DTensor, a tensor attached to the graph); a plain
        # detached 0-d tensor (TopKRouter's last_aux_loss) skips these calls.
        if not isinstance(aux, torch.Tensor):
            aux = torch.tensor(float(aux))
        aux = local_tensor(aux).detach().reshape(())
    return aux


def _hf_logits_and_indices(
    cls: str, output: Any, top_k: Any, module: nn.Module | None = None
) -> tuple[Any, Any]:
    """``(router_logits [N, E], top-k indices [N, k])`` of one forward of a Hugging Face router
    of class ``cls`` (``None`` where the output does not have the family's form; the caller
    checks the shapes). The indices are the router's own output, or its own selection
    recomputed with the same call on the same logits (:data:`_TOPK_OF_LOGITS`, DBRX, Zaya)."""
    seq = isinstance(output, tuple | list)
    if cls in _SKIP_EXPERT_ROUTERS:
        logits = output[0] if seq and len(output) >= 3 else None
        biases = getattr(module, "balancing_biases", None)
        if (
            isinstance(logits, torch.Tensor)
            and logits.ndim == 2
            and isinstance(top_k, int)
            and isinstance(biases, torch.Tensor)
            and biases.shape == logits.shape[-1:]
        ):
            # ZayaRouter.forward: topk(softmax(router_logits).detach().float() + biases, k);
            # its returned indices turn the skip expert (the last class) into expert 0
            probs = torch.softmax(logits.detach(), dim=-1).to(torch.float32)
            biased = probs + local_tensor(biases).detach().to(probs.device)
            return logits, torch.topk(biased, top_k, dim=-1).indices
        return logits, None
    if cls in _TOPK_OF_LOGITS:
        pos = _TOPK_OF_LOGITS[cls]
        logits = output[pos] if seq and len(output) > pos else None
        if isinstance(logits, torch.Tensor) and logits.ndim == 2 and isinstance(top_k, int):
            # the router's own selection: torch.topk(router_logits, top_k, dim=1)
            return logits, torch.topk(logits.detach(), top_k, dim=1).indices
        return logits, None
    if cls in _DBRX_ROUTERS:
        logits = output if isinstance(output, torch.Tensor) else None
        if logits is not None and logits.ndim == 2 and isinstance(top_k, int):
            # DbrxFFN.route_tokens_to_experts: softmax in the logits' dtype, then top-k
            probs = torch.softmax(logits.detach(), dim=1, dtype=logits.dtype)
            return logits, torch.topk(probs, top_k, dim=-1).indices
        return logits, None
    # (router_logits, scores, indices[, ...]): the third output (InklingTopkRouter adds a
    # fourth, its shared experts' gammas)
    indices = output[2] if seq and len(output) >= 3 else None
    return (output[0] if indices is not None else None), indices


def _product_key_routing(
    logits: torch.Tensor, num_keys: int, top_k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [N, k], probs [N, E])`` of a product-key router's logits ``[2, N, num_keys]``,
    as transformers 5.x ``models/doge/modeling_doge.py`` computes them: ``DogeCDMoE.forward``
    takes the top ``num_keys`` of each half, scores the ``num_keys**2`` pairs by the sum of
    their two scores (expert ``x * num_keys + y``) and keeps the top ``k``;
    ``load_balancing_loss_func`` spreads ``softmax`` of the pair scores over those experts
    (columns past ``num_keys**2``, never chosen, get 0)."""
    (scores_x, scores_y), (indices_x, indices_y) = logits.topk(num_keys, dim=-1)
    all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
    all_indices = (indices_x.unsqueeze(-1) * num_keys + indices_y.unsqueeze(-2)).flatten(-2)
    _, position = all_scores.topk(top_k, dim=-1)
    indices = all_indices.gather(-1, position)
    # the softmax in the logits' dtype as Doge's loss takes it, kept in float32 (like
    # _hf_loss_counts): with bf16 logits its sums and counts would not be exact
    probs = torch.zeros(all_scores.shape[0], num_experts, device=logits.device)
    probs.scatter_(-1, all_indices, torch.softmax(all_scores, dim=-1).float())
    return indices, probs


def _switch_seq_aux_loss(logits: torch.Tensor) -> Any:
    """Switch Transformers' load-balancing loss of one layer and forward, before its
    coefficient: transformers 5.x ``models/switch_transformers/modeling_switch_transformers.py
    ::load_balancing_loss_func(softmax(router_logits), router_logits.argmax(-1))`` of this
    layer's ``[B, S, E]`` logits, ``E**2 * mean_{b, e}(f_be * P_be)`` with ``f_be`` the fraction
    of sequence ``b``'s tokens whose top-1 is ``e`` (before the capacity drop) and ``P_be`` their
    mean softmax probability of ``e``: 1.0 at perfect balance. Over every token, padding
    included, as transformers computes it (it takes no attention mask)."""
    if logits.ndim != 3 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return None
    num_experts = logits.shape[-1]
    logits = logits.detach().float()
    probs = logits.softmax(dim=-1)
    top1 = torch.nn.functional.one_hot(logits.argmax(dim=-1), num_experts).float()
    return (top1.mean(dim=1) * probs.mean(dim=1)).mean() * num_experts**2


def _switch_z_loss(logits: torch.Tensor) -> torch.Tensor | None:
    """Switch Transformers' router z-loss of one layer and forward, before its coefficient:
    transformers 5.x ``modeling_switch_transformers.py::router_z_loss_func``, the mean over
    every token of the ``[B, S, E]`` logits, padding included (it takes no mask), of
    ``logsumexp(router_logits, -1) ** 2`` (the z-loss of ST-MoE, Zoph et al. 2022), in float32."""
    if logits.numel() == 0:
        return None
    return torch.logsumexp(logits.detach().float(), dim=-1).square().mean()


def _switch_aux_loss(
    probs: torch.Tensor,
    counts: torch.Tensor | None,
    top_k: int,
    valid: _ValidTokens | None = None,
) -> Any:
    """The Switch load-balancing loss of one layer and forward, before its coefficient, with
    Megatron's normalisation (1.0 at perfect balance): ``E / (k T) * sum_i tokens_i * P_i``,
    ``P_i`` the mean of ``probs`` ``[T, E]`` (the float32 router probabilities of
    :meth:`RouterCapture._hf_loss_counts`) for expert ``i``, over the ``T`` tokens that are not
    padding when ``valid`` (from :meth:`RouterCapture._hf_valid_tokens`) is given (``counts``
    then count only those; a forward with no such token gives 0, where Hugging Face divides
    0 by 0, and the capture leaves it out of the layer's mean over micro-batches with a
    device-side count, :meth:`RouterCapture._add_aux_empty`), else over every token. Hugging
    Face's ``load_balancing_loss_func`` term of the layer is ``top_k`` times this (it divides
    the counts by ``T``, not ``T * k``)."""
    if counts is None or probs.shape[0] == 0:
        return None
    num_tokens, num_experts = probs.shape
    if valid is None:
        mean_probs = probs.mean(dim=0)
        scale: Any = num_experts / (num_tokens * top_k)
    else:
        # transformers 5.x models/mixtral/modeling_mixtral.py::load_balancing_loss_func with an
        # attention mask: top-k counts and router probabilities summed over the tokens whose
        # mask is 1, both divided by their number (a device tensor: no host synchronisation).
        _, weights, num_valid, _ = valid
        mean_probs = (weights.unsqueeze(-1) * probs).sum(dim=0) / num_valid
        scale = num_experts / (num_valid * top_k)
    return (counts.to(mean_probs.dtype) * mean_probs).sum() * scale
