"""The output layer with the vocabulary padded or not: the fused loss (forward and backward, `ops.linear_cross_entropy`)
and a decoding step's log-softmax (`ops.linear_log_softmax`) at a real, unaligned vocabulary size, with the
embedding rows as learned (no padding), padded to a multiple of 8 (nmt's default on CPU) and of 64 (on CUDA).

    python benchmarks/vocab_padding.py [--vocab 36997] [--d-model 512] [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, print_table

from nmt_cli.model.ops import linear_cross_entropy, linear_log_softmax, loss_chunk_rows

COLUMNS = ["embedding rows", "loss fwd+bwd (ms)", "decoding step, 256 rows (ms)"]


def best_of(repeats: int, run) -> float:
    """The fastest of `repeats` timed calls (after one warm-up), in milliseconds."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=36_997, help="symbols, as BPE learning gives them")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096, help="target tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model) * 0.1
    target = torch.randint(4, args.vocab, (args.tokens,))
    step = torch.randn(256, args.d_model) * 0.1
    rows = []
    for multiple in (1, 8, 64):
        padded = -(-args.vocab // multiple) * multiple
        weight = torch.zeros(padded, args.d_model)
        weight[: args.vocab] = torch.randn(args.vocab, args.d_model) * args.d_model**-0.5
        weight.requires_grad_(True)
        h = hidden.clone().requires_grad_(True)

        def loss(h: torch.Tensor = h, weight: torch.Tensor = weight) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                linear_cross_entropy(h, weight, target, 0.1, loss_chunk_rows(h.device), args.vocab).backward()

        def decode(weight: torch.Tensor = weight) -> None:
            with torch.no_grad():
                linear_log_softmax(step, weight.detach(), (0, 1), vocab=args.vocab)

        rows.append([f"{padded:,} ({'as learned' if multiple == 1 else f'multiple of {multiple}'})",
                     f"{best_of(args.repeats, loss):.1f}", f"{best_of(args.repeats, decode):.2f}"])
    print_table(f"vocabulary padding: {args.vocab:,} symbols, d_model {args.d_model}, {args.tokens:,} tokens, bf16 "
                f"loss, fp32 decoding ({machine()})", COLUMNS, rows)


if __name__ == "__main__":
    main()
