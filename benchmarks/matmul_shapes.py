"""The matrix products of a `small` training update, one shape at a time, against this CPU's best: GFLOP/s of
each product as autograd runs it (forward x @ W^T, input gradient g @ W, weight gradient g^T @ x with g^T a
transposed view) and with the weight gradient's operand made contiguous first, in bf16 and fp32.

    python benchmarks/matmul_shapes.py [--rows 4096] [--dtypes bf16,fp32]

Rows are target (or source) tokens of one update (`--max-tokens 4096`); the output layer runs on chunks of 256
rows in the fused loss (`ops.linear_cross_entropy`), so it is timed at 256 too.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import machine, print_table

SHAPES = [("attention in_proj", 256, 768), ("attention out_proj", 256, 256), ("FFN w1", 256, 1024),
          ("FFN w2", 1024, 256), ("output layer (chunk)", 256, 9806)]


def seconds(fn, repeats: int = 20) -> float:
    """Median wall time of `fn` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    rows_out = []
    for dtype_name in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        for name, fan_in, fan_out in SHAPES:
            rows = 256 if name.startswith("output") else args.rows
            x = torch.randn(rows, fan_in, dtype=dtype)
            w = torch.randn(fan_out, fan_in, dtype=dtype)
            g = torch.randn(rows, fan_out, dtype=dtype)
            g_t = g.t().contiguous()
            flop = 2 * rows * fan_in * fan_out
            products = [(F.linear, (x, w)), (torch.mm, (g, w)), (torch.mm, (g.t(), x)), (torch.mm, (g_t, x))]
            rates = [flop / seconds(lambda f=f, a=a: f(*a)) / 1e9 for f, a in products]
            rows_out.append([name, dtype_name, f"{rows} x {fan_in} x {fan_out}", *rates])
    print_table(f"matrix products of a small training update, GFLOP/s ({machine()})",
                ["product", "dtype", "rows x in x out", "forward", "input grad", "weight grad (as autograd)",
                 "weight grad (contiguous g^T)"], rows_out)


if __name__ == "__main__":
    main()
