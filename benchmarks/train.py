"""Training throughput on CPU: target tokens/s and peak memory for `small` and `base`, fp32 and bf16.

Each configuration runs `nmt train` on Multi30k (10k joint BPE, --max-tokens 4096) in a fresh process:
a few warm-up updates, then a fixed number of timed updates (validation and saving excluded); with
--repeats N each configuration runs N times and the table gives the median and the spread (min-max).
The matmul bound is the speed of updates that were only their matrix products, each timed alone at its shape
on this machine (`matmul_bound`); the share says how close training comes to it.

    python benchmarks/train.py [--archs small,base] [--precisions fp32,bf16] [--repeats 3]
                               [--attention-dropout P] [--activation-dropout P]   # the multi30k recipe: 0.1 0.1
                               [--cpu-allocator auto|tcmalloc|jemalloc|system]   # as nmt train's
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, prepare_multi30k, print_table

from nmt_cli.torch_env import allocator_environment

COLUMNS = ["model", "precision", "params", "timed updates", "tgt tok/s (median)", "spread", "peak MB",
           "matmul bound tok/s", "share of bound"]
UPDATES = {"small": (10, 100), "base": (3, 20), "tiny": (10, 100), "big": (2, 8)}  # (warm-up, timed)


def worker(data_dir: str, arch: str, precision: str, save_dir: str, dropouts: str = "0,0") -> None:
    """Run inside the child: train warm-up + timed updates, print tokens/s and peak RSS as JSON.

    Every update is logged, and tokens/s is the timed updates' target tokens over their wall-clock time
    (each log record covers exactly one update; the last validation and save come after them).
    """
    from nmt_cli.torch_env import use_huge_pages_for_tensors

    use_huge_pages_for_tensors()  # as `nmt train` does, before torch is imported
    from nmt_cli.training.trainer import TrainOptions, train

    warm, timed = UPDATES[arch]
    attention_dropout, activation_dropout = (float(p) for p in dropouts.split(","))
    train(TrainOptions(data=Path(data_dir), save_dir=Path(save_dir), arch=arch, precision=precision,
                       max_tokens=4096, max_updates=warm + timed, log_interval=1, warmup=4000, device="cpu",
                       quiet=True, keep_last=1, attention_dropout=attention_dropout,
                       activation_dropout=activation_dropout))
    records = [json.loads(x) for x in (Path(save_dir) / "train.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    timed_steps = steps[warm:]
    seconds = timed_steps[-1]["time"] - steps[warm - 1]["time"]
    tokens = sum(r["tgt_tokens_per_s"] * (r["time"] - prev["time"]) for prev, r in zip(steps[warm - 1 :], timed_steps))
    start = [r for r in records if r["event"] == "start"][0]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bound = matmul_bound(start["config"], precision, round(tokens / len(timed_steps)))
    print(json.dumps({"tok_s": tokens / seconds, "peak_mb": peak_mb, "params": start["parameters"],
                      "bound_tok_s": bound}))


def matmul_bound(config: dict, precision: str, target_tokens: int, batch: int = 256, length: int = 16) -> float:
    """Target tokens/s of updates that were nothing but their matrix products, each at the speed torch reaches
    for its shape on this machine: every linear's forward, input-gradient and weight-gradient product,
    attention's batched products (forward and backward), and the output projection's three products per
    chunk of 256 target tokens; `batch` sentences padded to `length`, `target_tokens` real target tokens."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    d, ffn, layers, heads, vocab = (config[k] for k in ("d_model", "ffn", "layers", "heads", "vocab_size"))
    rows = batch * length
    linears = layers * [(d, 3 * d), (d, d), (d, ffn), (ffn, d)]  # encoder: self-attention in/out, FFN
    linears += layers * [(d, 3 * d), (d, d), (d, d), (d, 2 * d), (d, d), (d, ffn), (ffn, d)]  # + cross-attention
    products = []
    for fan_in, fan_out in linears:
        products += [((rows, fan_in), (fan_in, fan_out)), ((rows, fan_out), (fan_out, fan_in)),
                     ((fan_out, rows), (rows, fan_in))]
    bh, dk = batch * heads, d // heads
    scores, weighted = ((bh, length, dk), (bh, dk, length)), ((bh, length, length), (bh, length, dk))
    products += 3 * layers * 3 * [scores, weighted]  # 3 attentions per layer pair; backward = 2x forward
    chunk = 256
    products += -(-target_tokens // chunk) * [((chunk, d), (d, vocab)), ((chunk, vocab), (vocab, d)),
                                              ((vocab, chunk), (chunk, d))]
    seconds: dict[tuple, float] = {}
    for shapes in set(products):
        a, b = torch.randn(shapes[0], dtype=dtype), torch.randn(shapes[1], dtype=dtype)
        for _ in range(3):
            torch.matmul(a, b)
        times = []
        for _ in range(7):
            begin = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - begin)
        seconds[shapes] = statistics.median(times)
    return target_tokens / sum(seconds[shapes] for shapes in products)


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--archs", default="small,base")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (median and spread)")
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--activation-dropout", type=float, default=0.0)
    parser.add_argument("--cpu-allocator", default="auto", help="as nmt train's (auto: tcmalloc where installed)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare_multi30k(Path(tmp) / "data")
        for arch in args.archs.split(","):
            for precision in args.precisions.split(","):
                runs = []
                for repeat in range(args.repeats):
                    save = Path(tmp) / f"{arch}-{precision}-{repeat}"
                    dropouts = f"{args.attention_dropout},{args.activation_dropout}"
                    out = subprocess.run([sys.executable, __file__, "--worker", str(prepared), arch, precision,
                                          str(save), dropouts], check=True, capture_output=True, text=True,
                                         env=allocator_environment(args.cpu_allocator)).stdout
                    runs.append(json.loads(out.strip().splitlines()[-1]))
                speeds = sorted(r["tok_s"] for r in runs)
                bound = statistics.median(r["bound_tok_s"] for r in runs)
                rows.append([arch, precision, f"{runs[0]['params'] / 1e6:.1f}M", UPDATES[arch][1],
                             statistics.median(speeds), f"{speeds[0]:,.0f}-{speeds[-1]:,.0f}",
                             max(r["peak_mb"] for r in runs), bound,
                             f"{100 * statistics.median(speeds) / bound:.0f}%"])
                print_table("(partial)", COLUMNS, rows[-1:])
    extra = (f", attention/activation dropout {args.attention_dropout}/{args.activation_dropout}"
             if args.attention_dropout or args.activation_dropout else "")
    allocator = Path((allocator_environment(args.cpu_allocator) or {}).get("LD_PRELOAD", "system:").split(":")[0])
    print_table(f"train: Multi30k en-de, max-tokens 4096, CPU, {args.repeats} run(s) each{extra}, allocator "
                f"{allocator.name} ({machine()})",
                COLUMNS, rows)
    return rows


if __name__ == "__main__":
    main()
