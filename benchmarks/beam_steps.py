"""Beam search on long outputs: the cost of one step (decoder step, top-k, following the backpointers) as the
output grows, at batch 64 and beam 4, and whole searches that run every sentence to its length limit.

Multi30k's outputs are short (~14 tokens), so `translate.py` hardly sees what grows with the length: the
self-attention cache each step reads, and whatever beam reordering does with it. Here the first table runs
120 steps of one batch of 64 test_2016_flickr sentences with random backpointers (seeded, as beam search
produces them: each hypothesis continues one of its own sentence's), the second translates 256 sentences
with the same model's weights re-drawn at random, so that no hypothesis ends before source + `max_len_b`
tokens. Best of `--rounds` (default 2).

    python benchmarks/beam_steps.py [--model exp/multi30k/model.pt] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import REPO, flickr_test_sources, machine, print_table

BATCH, BEAM, STEPS, SPAN = 64, 4, 120, 20


def step_times(translator, sources: list[str], generator) -> list[float]:
    """Seconds of each of STEPS beam steps (step + reorder) for one batch, with random backpointers."""
    import torch

    ensemble, vocab = translator.ensemble, translator.vocab
    ids = translator.encode(sources[:BATCH])
    src = torch.full((BATCH, max(map(len, ids)) + 1), vocab.pad, dtype=torch.long)
    for row, sentence in enumerate(ids):
        src[row, : len(sentence)] = torch.tensor(sentence)
        src[row, len(sentence)] = vocab.eos
    rows = BATCH * BEAM
    with torch.inference_mode():
        states = ensemble.start(src, BEAM, STEPS + 1)
        try:
            ensemble.step(torch.full((BATCH,), vocab.bos), states, 2 * BEAM, torch.zeros(BATCH, dtype=torch.bool),
                          vocab.bos, vocab.eos)
            ensemble.reorder(states, torch.arange(BATCH).repeat_interleave(BEAM))
            tokens, at_limit = torch.full((rows,), ids[0][0]), torch.zeros(rows, dtype=torch.bool)
            times = []
            for _ in range(STEPS):
                parents = (torch.arange(BATCH)[:, None] * BEAM
                           + torch.randint(0, BEAM, (BATCH, BEAM), generator=generator)).view(-1)
                start = time.perf_counter()
                ensemble.step(tokens, states, 2 * BEAM, at_limit, vocab.bos, vocab.eos)
                ensemble.reorder(states, parents)
                times.append(time.perf_counter() - start)
        finally:
            ensemble.release(states)
    return times


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO / "exp" / "multi30k" / "model.pt"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"benchmark: {args.model} not found; run `make multi30k` first or pass --model")
    import torch

    from nmt_cli.decode.translate import Translator

    sources = flickr_test_sources()
    translator = Translator.from_checkpoint(args.model, device="cpu")
    translator.translate(sources[:BATCH])  # warm-up
    generator = torch.Generator().manual_seed(0)
    rounds = [step_times(translator, sources, generator) for _ in range(max(1, args.rounds))]
    best = [min(times) for times in zip(*rounds)]
    rows = [[f"{lo + 1}-{lo + SPAN}", f"{1000 * sum(best[lo : lo + SPAN]) / SPAN:.2f}"]
            for lo in range(0, STEPS, SPAN)]
    print_table(f"beam steps: batch {BATCH} x beam {BEAM}, fp32, ms per step by output length ({machine()})",
                ["output tokens so far", "ms per step (best round)"], rows)

    torch.manual_seed(0)
    for model in translator.ensemble.models:
        model.reset_parameters()  # random weights: every hypothesis runs to the length limit
    subset = sources[:256]
    translator.translate(subset[:8], max_len_b=10)
    whole = []
    for max_len_b in (20, 50):
        seconds = []
        for _ in range(max(1, args.rounds)):
            translator.generated_tokens = 0
            start = time.perf_counter()
            translator.translate(subset, beam=BEAM, batch_size=BATCH, max_len_b=max_len_b)
            seconds.append(time.perf_counter() - start)
        whole.append([max_len_b, f"{translator.generated_tokens / len(subset):.0f}",
                      f"{len(subset) / min(seconds):.1f}"])
    print_table(f"beam 4, batch 64, 256 sentences, random weights (every output runs to its limit) ({machine()})",
                ["max_len_b", "output tokens per sentence", "sent/s (best)"], whole)
    return rows + whole


if __name__ == "__main__":
    main()
