"""Three gaps of the Vitals driver: a checkpoint taken inside a gradient-accumulation window on
two ranks whose micro-batches differ in size (each rank restores its own sizes),
``accelerator.end_training()`` called on rank 0 only (the other ranks close at their exit, so
the last step is neither lost nor waited for forever), and an evaluation inside a WGAN batch
after every optimizer stepped while the critic steps again (the batch stays one step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed, torchrun
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, RuntimeMonitor, ThroughputMonitor
from trainvitals.callbacks.base import VitalsCallback

ROOT = Path(__file__).resolve().parents[1]
TWO_RANK_GAN = ROOT / "tests" / "scripts" / "two_rank_gan_end.py"

# ---------------------------------------------------------------- 1. checkpoint, two ranks

ACC = 4  # micro-batches per optimizer step
N = 12  # micro-batches: 3 optimizer steps
SPLITS = (5, 6, 7)  # checkpoints after micro-batch 1, 2, 3 of step 1


def _samples(rank: int, i: int) -> int:
    return 2 + i % 3 + 5 * rank  # rank 1's micro-batches are bigger


def _tokens(rank: int, i: int) -> int:
    return _samples(rank, i) * (3 + rank)  # and its sequences longer


def _window_run(rank: int, world_size: int) -> dict:
    """An uninterrupted run, then one per split: trained up to the split, ``state_dict()`` on
    every rank, rank 0's copy (the one a checkpoint keeps) loaded on every rank by a fresh
    driver, trained to the end. Rank 0's written rows and the ThroughputMonitor window of each."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def driver(writer: RecordingWriter) -> Vitals:
        callbacks = [RuntimeMonitor(max_steps=N // ACC), ThroughputMonitor(warmup_steps=0)]
        vitals = Vitals(callbacks, writer=writer, log_every_n_steps=1, accumulate_grad_batches=ACC)
        return vitals.attach(model, optimizer)

    def train(vitals: Vitals, micro_batches: range) -> None:
        for i in micro_batches:
            x = torch.randn(_samples(rank, i), 4)
            vitals.batch(x, num_tokens=_tokens(rank, i))
            model(x).pow(2).mean().backward()
            if i % ACC == ACC - 1:
                optimizer.step()
                optimizer.zero_grad()

    out = {}
    for split in (None, *SPLITS):
        writer = RecordingWriter()
        vitals = driver(writer)
        if split is None:
            train(vitals, range(N))
        else:
            train(vitals, range(split))
            box = [vitals.state_dict()]
            vitals.close()  # the process ends here
            dist.broadcast_object_list(box, src=0)
            vitals = driver(writer)
            vitals.load_state_dict(box[0])
            train(vitals, range(split, N))
        vitals.close()
        window = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["window"]
        keys = ("time/batches", "time/samples", "time/tokens")
        out[str(split)] = {
            "rows": {s: [writer.rows[s][k] for k in keys] for s in sorted(writer.rows)},
            "window": window["globals"],  # per step: batches, samples, tokens, ... (global)
        }
    # A driver whose callbacks' state is not collective: state_dict() on rank 0 alone returns
    # (no gather of the window's sizes there).
    vitals = Vitals([NormMonitor()], writer=RecordingWriter(), accumulate_grad_batches=ACC)
    vitals.attach(model, optimizer)
    train(vitals, range(2))
    if rank == 0:
        out["rank0_only"] = vitals.state_dict()["micro_batches_in_step"]
    dist.barrier()
    vitals.close()
    return out


@pytest.mark.timeout(300)
def test_checkpoint_inside_a_window_on_two_ranks_restores_each_ranks_own_sizes():
    """Rank 1's micro-batches are bigger than rank 0's. Before, every rank restored rank 0's
    carried sizes (the checkpoint's copy): at step 1 the global samples/tokens were short by
    rank 1's excess over rank 0 on the carried micro-batches (127/469 for 132/492 at the end,
    split 5). Now each rank takes its own row: the uninterrupted run's counts, from an
    independent sum."""
    result = run_distributed(_window_run, world_size=2, timeout=240)[0]
    steps = N // ACC
    cumulative = {
        s: [
            float(2 * ACC * (s + 1)),
            float(sum(_samples(r, i) for r in (0, 1) for i in range(ACC * (s + 1)))),
            float(sum(_tokens(r, i) for r in (0, 1) for i in range(ACC * (s + 1)))),
        ]
        for s in range(steps)
    }
    per_step = [
        [
            float(2 * ACC),
            float(sum(_samples(r, i) for r in (0, 1) for i in range(ACC * s, ACC * (s + 1)))),
            float(sum(_tokens(r, i) for r in (0, 1) for i in range(ACC * s, ACC * (s + 1)))),
        ]
        for s in range(steps)
    ]
    for split in ("None", *map(str, SPLITS)):
        got = result[split]
        assert got["rows"] == cumulative, split
        # the window's global counts of each step (step 0 restored from the checkpoint, step 1
        # restored inside its window)
        assert [row[:3] for row in got["window"]] == per_step, split
    assert result["rank0_only"] == [
        {"NormMonitor": [_samples(0, i), _tokens(0, i)]} for i in range(2)
    ]


# ---------------------------------------------------------------- 2. end_training on rank 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizers", ["one", "several"])
def test_end_training_on_rank_0_only_keeps_the_last_step(tmp_path, optimizers):
    """``if accelerator.is_main_process: accelerator.end_training()`` closes rank 0's driver
    alone. With several optimizers the last batch's step ends there, with collectives that
    rank 1 never joined: rank 0's waited until rank 1 exited, then failed ("Connection closed
    by peer"; a hang while rank 1 lives on), and step 2 was not written. Now rank 1's driver
    closes at its exit and joins them: every step is written, the samples summed over both
    ranks (an independent sum)."""
    proc = torchrun(TWO_RANK_GAN, str(tmp_path), optimizers, "rank0_end_training")
    assert "Connection closed" not in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_step = sum(2 + 3 * r for r in (0, 1))
    got = {r["step"]: (r["metrics"]["time/batches"], r["metrics"]["time/samples"]) for r in rows}
    assert got == {s: (2.0 * (s + 1), float(per_step * (s + 1))) for s in range(3)}


# ---------------------------------------------------------------- 3. evaluation inside a batch

K = 3  # critic steps per batch


class _Steps(VitalsCallback):
    """Records step ends and validations with ``ctx.step``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def step_end(self, ctx):
        self.events.append(("end", ctx.step))

    def validation_start(self, ctx):
        self.events.append(("val", ctx.step))


def _wgan(validate: set[tuple[int, int]], generator_first: bool, batches: int = 5):
    """A WGAN in a loop that calls ``vitals.batch()``: per batch the generator steps, then the
    critic K times (``generator_first``), or the critic K times, then the generator. An
    evaluation after the critic's step k of batch b for each (b, k) in ``validate`` (k == K:
    after the generator's step that ends a critic-first batch)."""
    torch.manual_seed(0)
    gen, dis = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"gen": gen, "dis": dis})
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(dis.parameters(), lr=0.01)
    writer, steps = RecordingWriter(), _Steps()
    callbacks = [RuntimeMonitor(max_steps=10), ThroughputMonitor(window_size=2), NormMonitor()]
    vitals = Vitals([*callbacks, steps], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_d, opt_g])

    def evaluate(b: int, k: int) -> None:
        if (b, k) in validate:
            with vitals.validating(), torch.no_grad():
                dis(torch.ones(2, 4))

    def generator_step() -> None:
        opt_g.zero_grad()
        (-dis(gen(torch.randn(5, 3))).mean()).backward()
        opt_g.step()

    for b in range(batches):
        vitals.batch(torch.randn(5, 4))
        if generator_first:
            generator_step()
        for k in range(K):
            opt_d.zero_grad()
            fake = gen(torch.randn(5, 3)).detach()
            (dis(fake).mean() - dis(torch.randn(5, 4)).mean()).backward()
            opt_d.step()
            evaluate(b, k)
        if not generator_first:
            generator_step()
            evaluate(b, K)
    vitals.close()
    return vitals, writer, steps.events


def _counted(writer: RecordingWriter) -> dict[int, dict[str, float]]:
    timed = ("per_sec", "seconds", "hours", "mfu")
    return {
        step: {k: v for k, v in row.items() if not any(t in k for t in timed)}
        for step, row in writer.rows.items()
    }


def test_evaluation_after_every_optimizer_stepped_inside_a_batch_keeps_it_one_step():
    """Generator, then the critic K times; an evaluation after the critic's first step of batch
    2, when both optimizers have stepped but the critic steps again. Before, the step ended at
    the evaluation: batch 2 was two steps (6 steps for 5 batches; the split-off step had no
    micro-batch, and time/batches stopped after step 2). Now it stays one step: the step count
    and every step-keyed value not read off a clock are those of the run without it."""
    plain_vitals, plain, plain_events = _wgan(set(), generator_first=True)
    vitals, writer, events = _wgan({(2, 0)}, generator_first=True)
    assert plain_vitals.step == vitals.step == 5
    assert writer.key("time/batches") == {s: s + 1.0 for s in range(5)}
    assert writer.key("time/samples") == {s: 5.0 * (s + 1) for s in range(5)}
    assert _counted(writer) == _counted(plain)
    assert [e for e in events if e[0] != "val"] == plain_events
    i = events.index(("val", 2))  # inside step 2, which ends after the batch
    assert events[i - 1 : i + 2] == [("end", 1), ("val", 2), ("end", 2)]


def test_evaluation_between_batches_still_ends_the_stepped_step_before_it():
    """The documented case, kept: critic K times, then the generator, then the evaluation
    (between batches, as Lightning validates): the step ends before it and ``ctx.step`` inside
    it is the next step's, in the first batch and in a later one."""
    plain_vitals, plain, _ = _wgan(set(), generator_first=False)
    vitals, writer, events = _wgan({(0, K), (2, K)}, generator_first=False)
    assert plain_vitals.step == vitals.step == 5
    assert _counted(writer) == _counted(plain)
    assert events[:2] == [("end", 0), ("val", 1)]
    i = events.index(("end", 2))
    assert events[i : i + 3] == [("end", 2), ("val", 3), ("end", 3)]
