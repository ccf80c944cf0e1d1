"""Lexical constraints' Python step: microseconds per `Phrases.advance` + `Phrases.wanted` call, the pair the
constrained beam search makes for every candidate continuation of every hypothesis at every step.

2,000 made-up sentences, each with 1-2 phrases of 1-3 tokens (ids 4-60) and an output of 20 tokens, half of
them the first token of one of its phrases (more constraint tokens than real outputs hold: the slow path);
best of `--rounds`. To compare two versions, run it in each checkout, one after the other.

    python benchmarks/constraints.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402
from nmt_cli.decode.constraints import START, Phrases  # noqa: E402


def cases(seed: int = 5, sentences: int = 2000) -> list[tuple[tuple[tuple[int, ...], ...], list[int]]]:
    rng = random.Random(seed)
    found = []
    for _ in range(sentences):
        phrases = tuple(tuple(rng.randint(4, 60) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2)))
        output = [rng.choice([rng.randint(4, 60), rng.choice(phrases)[0]]) for _ in range(20)]
        found.append((phrases, output))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = cases()
    best, calls = float("inf"), 0
    for _ in range(args.rounds):
        start, calls = time.perf_counter(), 0
        for phrases, output in work:
            rule, progress = Phrases(phrases), START
            for token in output:
                rule.wanted(progress)
                progress = rule.advance(progress, token)
                calls += 1
        best = min(best, time.perf_counter() - start)
    print(f"| machine | calls | us per advance + wanted |\n|---|---|---|\n"
          f"| {machine()} | {calls:,} | {best / calls * 1e6:.2f} |")


if __name__ == "__main__":
    main()
