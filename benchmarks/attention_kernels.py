"""What the source padding mask costs the encoder self-attention and the cross-attention, on real batches.

The encoder self-attention and the cross-attention pass `scaled_dot_product_attention` a boolean key mask
(True where a source token is not padding); the decoder's training self-attention passes only `is_causal`.
On CUDA a mask rules out the FlashAttention kernel (the memory-efficient kernel takes masks), so this
measures, on the batches training really forms (length-sorted, --max-tokens per batch, from a data dir of
`nmt prepare`): how much of a source batch is padding, and the attention's time (forward and backward, base
shapes: 8 heads of 64) with the boolean mask, with the same mask as an additive float tensor, and without a
mask (what a batch with no padding at all would cost: the lower bound any padding-free kernel could reach),
through `scaled_dot_product_attention` in float32 (what CUDA and CPU inference call) and through nmt's
explicit bf16 matmul + softmax + matmul (what bf16 training on a CPU runs, `model.explicit_attention`).

    python benchmarks/attention_kernels.py --data exp/multi30k/data [--max-tokens 4096] [--batches 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import machine, print_table

from nmt_cli.data.binarized import DataDir, make_batches
from nmt_cli.model.transformer import explicit_attention

COLUMNS = ["attention", "kernel", "mask", "fwd+bwd (ms per batch)", "vs no mask"]


def padding_share(src: np.ndarray, batches: list[np.ndarray]) -> float:
    """Padded source positions over all source positions of `batches` (each sentence with its </s>)."""
    real = sum(int(src[b].sum()) + len(b) for b in batches)
    padded = sum(int(src[b].max() + 1) * len(b) for b in batches)
    return 1 - real / padded


def time_attention(shapes: list[tuple[int, int, int, list[int]]], kind: str, kernel: str, repeats: int,
                   heads: int = 8, dk: int = 64) -> float:
    """Best-of-`repeats` milliseconds for fwd+bwd of one attention per batch of `shapes` (sentences, queries,
    keys, the keys' real lengths drawn from the batch), summed over the batches, divided by their number."""
    generator = torch.Generator().manual_seed(0)
    dtype = torch.float32 if kernel == "sdpa fp32" else torch.bfloat16
    attention = F.scaled_dot_product_attention if kernel == "sdpa fp32" else explicit_attention
    inputs = []
    for n, lq, lk, lengths in shapes:
        q = torch.randn(n, heads, lq, dk, generator=generator, dtype=dtype, requires_grad=True)
        k = torch.randn(n, heads, lk, dk, generator=generator, dtype=dtype, requires_grad=True)
        v = torch.randn(n, heads, lk, dk, generator=generator, dtype=dtype, requires_grad=True)
        keep = (torch.arange(lk)[None, :] < torch.as_tensor(lengths)[:, None])[:, None, None, :]
        mask = {"boolean": keep, "additive float": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -torch.inf),
                "none": None}[kind]
        inputs.append((q, k, v, mask))

    def run() -> None:
        for q, k, v, mask in inputs:
            (attention(q, k, v, mask) if mask is not None else attention(q, k, v)).sum().backward()

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 1000 * best / len(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a data dir of nmt prepare (its train split)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=20, help="batches timed, drawn evenly from all")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    corpus = DataDir.open(args.data).split("train")
    src, tgt = corpus.src.sizes, corpus.tgt.sizes
    batches = make_batches(src, tgt, args.max_tokens, seed=1)
    print(f"{machine()}; {len(batches):,} batches of <= {args.max_tokens} tokens; source padding "
          f"{100 * padding_share(src, batches):.1f}% of source positions (encoder and cross-attention keys)")
    picked = [batches[i] for i in np.linspace(0, len(batches) - 1, args.batches).astype(int)]
    rows = []
    for name, queries in (("encoder self-attention", "src"), ("cross-attention", "tgt")):
        shapes = []
        for b in picked:
            lengths = src[b] + 1
            lk = int(lengths.max())
            lq = lk if queries == "src" else int(tgt[b].max() + 1)
            shapes.append((len(b), lq, lk, lengths.tolist()))
        for kernel, kinds in (("sdpa fp32", ("none", "boolean", "additive float")),
                              ("explicit bf16", ("none", "boolean"))):
            times = {kind: time_attention(shapes, kind, kernel, args.repeats) for kind in kinds}
            for kind, ms in times.items():
                rows.append([name, kernel, kind, ms, f"{ms / times['none']:.2f}x"])
    print_table(f"attention over {len(picked)} real batches (8 heads of 64)", COLUMNS, rows)


if __name__ == "__main__":
    main()
