"""Training throughput of the paper's base and big models on GPUs: target tokens/s per GPU, MFU, peak memory.

    python benchmarks/gpu.py [--archs base,big] [--precisions bf16,fp16] [--updates 300] [--json]
    python benchmarks/gpu.py --estimate          # no GPU needed: time to train base/big from the FLOPs formula

On a machine with CUDA it relaunches itself under torchrun across all visible GPUs (NCCL) and runs the
real training step (`nmt_cli.training.trainer.train_step`: DDP, autocast, fused loss, gradient accumulation) on
synthetic batches at the WMT14 recipe's budget: --max-tokens 4096 per GPU and --update-freq 8 / GPUs,
with WMT-like sentence lengths and a 37k vocabulary. Warm-up updates are not timed.

Model FLOPs per target token (training = 3 x forward; source and target of equal length L, dense
attention counted as computed, with the decoder's causal half):
    6 * (P_enc + P_dec + d * V) + 6 * layers * d * (2 * L + 2 * L + L)
where P_enc / P_dec are the encoder / decoder weight-matrix parameters (12 d^2 + ... per layer as built)
and d * V the output projection; the second term is QK^T and AV of encoder self-attention (2L), cross-
attention (2L) and causal decoder self-attention (L). MFU = achieved FLOP/s / the GPU's dense peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nmt_cli.training.gpu_check import (  # noqa: E402  (the FLOPs formula and batches gpu-check times too)
    PEAK_TFLOPS,
    VOCAB,
    flops_per_target_token,
    synthetic_batches,
)

RECIPE = {"base": (100_000, 25_000), "big": (300_000, 25_000)}  # updates, target tokens per update


def estimate() -> list[dict]:
    """Expected wall-clock time of the recipes on 8 GPUs of a few kinds, at a stated MFU."""
    rows = []
    for arch, (updates, tokens) in RECIPE.items():
        total = flops_per_target_token(arch) * updates * tokens
        for gpu, mfu in (("H100", 0.30), ("A100", 0.35), ("P100", 0.13)):
            seconds = total / (8 * PEAK_TFLOPS[gpu] * 1e12 * mfu)
            rows.append({"arch": arch, "gpu": f"8x {gpu}", "mfu": mfu, "updates": updates,
                         "gflop_per_token": flops_per_target_token(arch) / 1e9, "total_eflop": total / 1e18,
                         "hours": seconds / 3600})
    return rows


def worker(archs: list[str], precisions: list[str], updates: int, warmup: int) -> None:
    """One torchrun process: time `updates` updates per (arch, precision); rank 0 prints JSON lines."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nmt_cli.hardware import resolve_device
    from nmt_cli.model.transformer import Transformer, make_config
    from nmt_cli.training import distributed as D
    from nmt_cli.training.trainer import TrainOptions, TranslationLoss, train_step

    device = resolve_device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    ctx = D.init_distributed(device)
    world = ctx.world_size
    update_freq = max(1, (8 + world - 1) // world)
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    for arch in archs:
        for precision in precisions:
            torch.manual_seed(1)
            model = Transformer(make_config(arch, VOCAB)).to(device)
            loss_module = TranslationLoss(model, 0.1)
            runner = (DistributedDataParallel(loss_module, device_ids=[device.index], broadcast_buffers=False)
                      if ctx.enabled else loss_module)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
            scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
            opts = TrainOptions(data=Path("."), save_dir=Path("."), arch=arch, precision=precision)
            batches = [b.pin_memory() for b in synthetic_batches(64, 4096, seed=ctx.rank)]
            torch.cuda.reset_peak_memory_stats(device)
            tokens = 0
            for step in range(warmup + updates):
                if step == warmup:
                    torch.cuda.synchronize(device)
                    if ctx.enabled:
                        dist.barrier()
                    start, tokens = time.perf_counter(), 0
                micro = [batches[(step * update_freq + i) % len(batches)].to(device, non_blocking=True)
                         for i in range(update_freq)]
                train_step(runner, model, micro, optimizer, scaler, opts, ctx, device)
                tokens += sum(b.ntokens for b in micro)
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            per_gpu = tokens / seconds
            (total,) = D.all_reduce([per_gpu], ctx, device)
            flops = flops_per_target_token(arch)
            if ctx.is_main:
                print(json.dumps({"arch": arch, "precision": precision, "gpus": world, "gpu": name,
                                  "update_freq": update_freq, "timed_updates": updates,
                                  "tgt_tokens_per_s_per_gpu": total / world,
                                  "mfu": (total / world) * flops / (peak * 1e12) if peak else None,
                                  "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30}), flush=True)
            del model, runner, optimizer, loss_module
            torch.cuda.empty_cache()
    D.shutdown(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="base,big")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--estimate", action="store_true", help="print the time-to-train estimate and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    archs, precisions = args.archs.split(","), args.precisions.split(",")
    if args.worker:
        worker(archs, precisions, args.updates, args.warmup)
        return
    from common import print_table

    if args.estimate:
        rows = estimate()
        if args.json:
            print(json.dumps(rows))
            return
        print_table("estimated time to train the WMT14 recipes (FLOPs formula in benchmarks/gpu.py)",
                    ["model", "GPUs", "assumed MFU", "updates", "GFLOP / tgt token", "EFLOP", "hours"],
                    [[r["arch"], r["gpu"], f"{r['mfu']:.0%}", f"{r['updates']:,}", f"{r['gflop_per_token']:.2f}",
                      f"{r['total_eflop']:.1f}", f"{r['hours']:.1f}"] for r in rows])
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu benchmark: no CUDA device here (try --estimate)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(torch.cuda.device_count()), __file__, "--worker", "--archs", args.archs, "--precisions",
           args.precisions, "--updates", str(args.updates), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"gpu benchmark failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if args.json:
        print(json.dumps(rows))
        return
    print_table(f"GPU training: {rows[0]['gpus']}x {rows[0]['gpu']}, 4096 tokens/GPU x update-freq "
                f"{rows[0]['update_freq']}, {args.updates} timed updates",
                ["model", "precision", "tgt tok/s per GPU", "MFU", "peak memory GB"],
                [[r["arch"], r["precision"], f"{r['tgt_tokens_per_s_per_gpu']:,.0f}",
                  f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a", f"{r['peak_memory_gb']:.1f}"] for r in rows])


if __name__ == "__main__":
    main()
