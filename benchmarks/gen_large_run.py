"""Write a run folder of a large model's shape for ``trainvitals report`` / ``query`` at scale.

``tensor_stats.jsonl``: ``--layers`` layers x 7 tensors (a Llama block's projections), the four
kinds, ``--steps`` logged steps, in ``TensorStatsMonitor``'s line format (moment vectors taken
from a pool of 61 real ``fused_moments`` rows, so the file is cheap to write); ``metrics.jsonl``
through ``JsonlSink``: ``moe/layer_<i>/{cv,aux_loss,dead_expert_frac,max_overload_factor,
expert_diversity}`` for every layer plus ``train/loss`` and ``l2_norm/grad/global``.

    python benchmarks/gen_large_run.py /tmp/large_run --steps 2000 --layers 80   # ~730 MiB
    /usr/bin/time -v trainvitals report /tmp/large_run -o /tmp/large_run/report.html

(docs/benchmarks.md, "Session 21: the report at 80 layers x 2000 steps").
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from trainvitals.adapters import JsonlSink
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_rows

KINDS = ("param", "grad", "activation", "dgrad")
PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
LAYER_KEYS = ("cv", "aux_loss", "dead_expert_frac", "max_overload_factor", "expert_diversity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=2000, help="logged steps")
    parser.add_argument("--layers", type=int, default=80)
    args = parser.parse_args()
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{i}.{p}.weight" for i in range(args.layers) for p in PARTS]
    g = torch.Generator().manual_seed(0)
    pool = moments_to_rows(
        fused_moments([torch.randn(256, generator=g) * (1 + i / 8) for i in range(61)])
    )
    pool_text = [json.dumps(r, separators=(",", ":")) for r in pool]
    keyed = [json.dumps(n) + ":" for n in names]
    fields = json.dumps(list(FIELDS), separators=(",", ":"))
    with open(run / "tensor_stats.jsonl", "w") as f:
        for step in range(args.steps):
            for k, kind in enumerate(KINDS):
                body = ",".join(
                    keyed[i] + pool_text[(i * 7 + step * 3 + k) % 61] for i in range(len(names))
                )
                tail = ',"micro_batches":1' if kind in ("activation", "dgrad") else ""
                f.write(
                    f'{{"version":1,"step":{step},"kind":"{kind}","time":{1.7e9 + step},'
                    f'"fields":{fields},"tensors":{{{body}}}{tail}}}\n'
                )
    rng = random.Random(0)
    keys = [f"moe/layer_{i}/{m}" for i in range(args.layers) for m in LAYER_KEYS]
    keys += ["train/loss", "l2_norm/grad/global"]
    sink = JsonlSink(run / "metrics.jsonl")
    for step in range(args.steps):
        sink.write(step, {k: rng.gauss(1.0, 0.1) for k in keys}, 1.7e9 + step)
    sink.close()
    print(f"wrote {run}")


if __name__ == "__main__":
    main()
