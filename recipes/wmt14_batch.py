"""The WMT14 recipe's batch for any number of GPUs: --max-tokens per GPU and --update-freq such that an update
holds what the paper's did (section 5.1: ~25k source and ~25k target tokens per update, 8 P100s).

    python recipes/wmt14_batch.py --gpus 8 --nnodes 2      # prints "MAX_TOKENS UPDATE_FREQ": 2048 1

The paper's batch is 8 GPUs x 4096 padded tokens = 32,768 (--max-tokens counts padding: ~25k real target
tokens). With n = GPUS x NNODES processes: up to 8, --update-freq ceil(8 / n) and --max-tokens 32,768 /
(n x update-freq) (4096 where n divides 8); above 8, --update-freq 1 and --max-tokens 32,768 / n, so 16 GPUs
train on the paper's batch instead of twice it. Rounded down, the update stays within 0.5% under 32,768 for
every n from 1 to 64. Bad input (not a positive integer, or so
many GPUs that a micro-batch could not hold one longest sentence): one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

PAPER_TOKENS = 8 * 4096  # per update, padding included
LONGEST = 251  # the recipe's --max-len 250, plus </s>


def batch(gpus: int, nnodes: int) -> tuple[int, int]:
    """(--max-tokens, --update-freq) for `gpus` processes on each of `nnodes` nodes."""
    n = gpus * nnodes
    update_freq = -(-8 // n) if n < 8 else 1
    max_tokens = PAPER_TOKENS // (n * update_freq)
    return max_tokens, update_freq


def positive(name: str, text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer (got {text!r})")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", required=True, help="processes (GPUs) per node: the recipe's GPUS")
    parser.add_argument("--nnodes", default="1", help="nodes: the recipe's NNODES")
    parser.add_argument("--node-rank", default="0", help="this node's NODE_RANK (checked: 0 to NNODES - 1)")
    args = parser.parse_args()
    try:
        gpus, nnodes = positive("GPUS", args.gpus), positive("NNODES", args.nnodes)
        if not args.node_rank.strip().isdigit() or int(args.node_rank) >= nnodes:
            raise ValueError(f"NODE_RANK must be 0 to NNODES - 1 = {nnodes - 1} (got {args.node_rank!r})")
        max_tokens, update_freq = batch(gpus, nnodes)
        if max_tokens < LONGEST:
            raise ValueError(f"GPUS x NNODES = {gpus * nnodes} splits the paper's {PAPER_TOKENS:,}-token update into "
                             f"micro-batches of {max_tokens} tokens, below one {LONGEST}-token sentence; set "
                             "WMT14_MAX_TOKENS and WMT14_UPDATE_FREQ yourself (a larger batch)")
    except ValueError as e:
        print(f"wmt14: {e}", file=sys.stderr)
        return 2
    print(max_tokens, update_freq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
