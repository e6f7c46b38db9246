"""What the callbacks cost a ``torch.compile``d model on the steps that do not log.

A compiled model runs its graphs on every step; a module hook that Dynamo cannot trace splits
them (a graph break per hooked module), and the pieces run with Python between them whether
or not the step logs. This benchmark trains the same model compiled (each block, torchtitan
style, or the whole model) without trainvitals and with callbacks attached before the first
forward, ``log_every_n_steps`` larger than the run (the timed steps never log), and reports
the median step time of each variant against the baseline of the same repetition (variants
interleaved, their order rotating), and how many graphs Dynamo compiled for each.

Variants: ``baseline`` (the compiled model, no trainvitals), ``driver`` (the ``Vitals`` driver
with no callback), ``TensorStatsMonitor`` (all four kinds: its activation/dgrad hooks stay on a
compiled model), ``LoadBalanceMonitor`` (``--model moe`` only: hooks on the routers) and
``all`` (every public callback with its defaults; the two MoE ones
for ``--model moe`` only).

Run::

    .venv/bin/python -m benchmarks.bench_compiled --device cuda --how block --reps 5 --steps 20
    .venv/bin/python -m benchmarks.bench_compiled --device cuda --model moe --how whole

Each variant has its own model instance (the same weights); Dynamo's cache limits are raised
and its guards on module hooks turned on (``skip_nnmodule_hook_guards=False``), so that the
variants' compiled code lives side by side and each instance runs its own.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Callable

import torch
import torch._dynamo
from torch import nn

from benchmarks.common import (
    DiscardWriter,
    build_lm,
    count_parameters,
    format_params,
    interleaved_ratios,
    lm_batch,
    timed,
)
from trainvitals import callbacks as tv_callbacks
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import TinyMoELM, destroy_moe_metrics_tracker

NEVER = 10**9  # log_every_n_steps: only step 0 (the warm-up) logs


def _moe(device: str) -> nn.Module:
    torch.manual_seed(0)
    return TinyMoELM(
        vocab_size=6144,
        hidden_size=512,
        num_layers=6,
        num_experts=8,
        top_k=2,
        ffn_hidden_size=512,
        num_heads=8,
        max_seq_len=512,
    ).to(device)


def _compile(model: nn.Module, how: str) -> nn.Module:
    if how == "whole":
        return torch.compile(model)
    for block in model.layers:  # torchtitan style: each transformer block
        block.compile()
    return model


def _all_callbacks(moe: bool) -> list[tv_callbacks.VitalsCallback]:
    names = sorted(tv_callbacks._MODULES)
    if not moe:
        names = [n for n in names if n not in ("LoadBalanceMonitor", "MoEMetricsMonitor")]
    return [getattr(tv_callbacks, name)() for name in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), default="dense")
    parser.add_argument("--how", choices=("block", "whole"), default="block")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    # Dynamo does not guard on module hooks by default: the variants' instances would share
    # the graphs compiled first (without hooks) and their hooks would never run.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    run_dir = tempfile.TemporaryDirectory()

    moe = args.model == "moe"
    base_model = _moe(args.device) if moe else build_lm(device=args.device)
    ids = lm_batch(args.batch_size, args.seq_len, 6144, device=args.device)

    def loss_of(run: nn.Module) -> torch.Tensor:
        return run(ids, labels=ids).loss if moe else run(ids)

    factories: dict[str, Callable[[], list] | None] = {
        "baseline": None,
        "driver": list,
        "TensorStatsMonitor": lambda: [
            tv_callbacks.TensorStatsMonitor(kinds=("param", "grad", "activation", "dgrad"))
        ],
    }
    if moe:
        factories["LoadBalanceMonitor"] = lambda: [tv_callbacks.LoadBalanceMonitor()]
    factories["all"] = lambda: _all_callbacks(moe)
    graphs: dict[str, int] = {}

    def variant(name: str, factory: Callable[[], list] | None) -> Callable[[int], float]:
        destroy_moe_metrics_tracker()
        model = copy.deepcopy(base_model)
        run = _compile(model, args.how)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        vitals = None
        if factory is not None:
            vitals = Vitals(
                factory(),
                writer=DiscardWriter(),
                log_every_n_steps=NEVER,
                run_dir=f"{run_dir.name}/{name}",
            )
            vitals.attach(run, optimizer)

        def one_step() -> None:
            if vitals is not None:
                vitals.batch(ids)
            loss_of(run).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(3):  # step 0 logs (and measures flops); compile and warm up
            one_step()
        graphs[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before

        def run_steps(steps: int) -> float:
            return timed(lambda: [one_step() for _ in range(steps)], args.device)

        return run_steps

    variants = {name: variant(name, f) for name, f in factories.items()}
    results = interleaved_ratios(variants, baseline="baseline", reps=args.reps, steps=args.steps)
    print(
        f"{args.model} model {format_params(count_parameters(base_model))} parameters compiled "
        f"({args.how}), batch {args.batch_size} x {args.seq_len} tokens, {args.device}, torch "
        f"{torch.__version__}, {args.reps} reps x {args.steps} steps, none of them logging"
    )
    print()
    print("| variant | graphs compiled | median ms/step | ratio to baseline (median) | min-max |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {graphs[name]} | {1e3 * r['median_step_s']:.2f} "
            f"| {r['median_ratio']:.3f} | {r['min_ratio']:.3f}-{r['max_ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
