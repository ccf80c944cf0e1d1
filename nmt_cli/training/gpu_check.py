"""`make gpu-check`: does nmt train correctly on this GPU, and how fast? One table, PASS/FAIL per line.

    python -m nmt_cli.training.gpu_check [--device cuda|cpu] [--json FILE]

Nothing to download: it writes its own synthetic task (source word w<i> -> target word v<i>, order kept) and
prepares it with `nmt prepare`. Then, through the real training code:
  (a) a small model learns the task in bf16 and in fp16 (loss scaling; CUDA only): validation perplexity after
      a fixed number of updates must fall below LEARN_PPL (the floor under label smoothing 0.1 is 1/0.9 = 1.11;
      an untrained model's is the vocabulary size);
  (b) stop and resume: N/2 updates, then a resumed run to N, against N updates straight: the same weights
      (bit-identical on CPU; on CUDA, where index_add's atomics sum in any order, within RESUME_ATOL for every
      weight but the attention key biases, which only receive rounding noise, and the same per-update losses);
  (c) the 2-rank path: torchrun with 2 processes (NCCL on 2 GPUs; gloo on CPU where fewer GPUs) against one
      process with --update-freq 2: the same per-update losses within TWO_RANK_RTOL;
  (d) throughput of base and big (tiny with --device cpu) on synthetic WMT-like batches, bf16, at
      the recipe's 4096 tokens per micro-batch and at 4x that (is 4096 launch-bound?), eager and with the layers
      compiled (CUDA; eager only on CPU): target tokens/s, MFU against the GPU's dense bf16 peak, peak memory.
With --device cpu the same code runs at tiny sizes in about a minute (CI runs it: tests/test_recipes.py), in
fp32 instead of bf16 on a CPU without bf16 instructions (where PyTorch emulates bf16 products, many times slower).
Exit code 0 when every line passes (or is skipped: fp16 on CPU), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .toy_task import write_word_mapping_task

LEARN_PPL = 1.5
RESUME_ATOL = 1e-4
TWO_RANK_RTOL = 1e-3
# A joint BPE vocabulary's size as learning gives it (the paper's "about 37000"): not a multiple of 8, so the
# model pads its embedding rows (`ModelConfig.vocab_multiple`) as a real one would.
VOCAB = 36_997
MEAN_LEN = 27  # BPE tokens per WMT14 en-de sentence (~25 words) plus </s>
# Dense bf16/fp16 tensor-core peaks (TFLOP/s), from the vendors' data sheets (SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0,
               "P100": 21.2}
SIZES = {  # device -> learning model and updates, throughput models, warm-up and timed updates, vocabulary
    "cuda": {"learn": ("small", 500), "speed": ("base", "big"), "updates": (5, 20), "vocab": VOCAB,
             "compile": (False, True)},
    # the code path, not a CPU figure: an unaligned vocabulary a tenth the size keeps the output layer's share
    # compiled layers: slower than eager on CPU (benchmarks/compile.py measures them there), so eager only
    "cpu": {"learn": ("tiny", 300), "speed": ("tiny",), "updates": (1, 4), "vocab": 3_997, "compile": (False,)},
}


def matrix_parameters(arch: str) -> tuple[int, int, int, int]:
    """(encoder, decoder, output projection) weight-matrix parameter counts and d_model of a preset."""
    from nmt_cli.model.transformer import PRESETS

    p = PRESETS[arch]
    d, f, n = p["d_model"], p["ffn"], p["layers"]
    encoder = n * (4 * d * d + 2 * d * f)  # in_proj (3 d^2) + out_proj (d^2), two FFN matrices
    decoder = n * (8 * d * d + 2 * d * f)  # self- and cross-attention, FFN
    return encoder, decoder, d * VOCAB, d


def flops_per_target_token(arch: str, length: int = MEAN_LEN) -> float:
    """Training FLOPs per target token (training = 3 x forward; source and target of equal length L, dense
    attention counted as computed, with the decoder's causal half):
        6 * (P_enc + P_dec + d * V) + 6 * layers * d * (2 * L + 2 * L + L)
    P_enc / P_dec: the weight-matrix parameters; d * V the output projection; the second term QK^T and AV of
    encoder self-attention (2L), cross-attention (2L) and causal decoder self-attention (L)."""
    from nmt_cli.model.transformer import PRESETS

    encoder, decoder, output, d = matrix_parameters(arch)
    layers = PRESETS[arch]["layers"]
    return 6 * (encoder + decoder + output) + 6 * layers * d * (5 * length)


def synthetic_batches(count: int, max_tokens: int, seed: int, vocab: int = VOCAB) -> list:
    """`count` batches of random ids below `vocab` at WMT-like lengths (log-normal around MEAN_LEN),
    `max_tokens` each."""
    import numpy as np
    import torch

    from nmt_cli.data.binarized import Batch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        length = int(np.clip(rng.lognormal(np.log(MEAN_LEN) - 0.18, 0.6), 4, 250))
        rows = max(1, max_tokens // (length + 1))
        src = torch.from_numpy(rng.integers(4, vocab, (rows, length + 1)))
        tgt = torch.from_numpy(rng.integers(4, vocab, (rows, length + 1)))
        index = torch.arange(tgt.numel())
        out.append(Batch(src, tgt, index, tgt.flatten().clone(), int(tgt.numel())))
    return out


def prepare_task(root: Path) -> Path:
    from nmt_cli.data.prepare import PrepareOptions, prepare

    write_word_mapping_task(root / "raw" / "train", 1200, seed=1)
    write_word_mapping_task(root / "raw" / "valid", 60, seed=2)
    prepare(PrepareOptions("en", "de", str(root / "raw" / "train"), str(root / "raw" / "valid"), root / "data",
                           bpe_merges=30, workers=1, quiet=True))
    return root / "data"


def options(data: Path, save: Path, device: str, **kw):
    from .trainer import TrainOptions

    base = dict(data=data, save_dir=save, arch="tiny", dropout=0.1, max_tokens=1024, warmup=100, lr_scale=1.0,
                device=device, quiet=True, seed=3, valid_interval=100_000)
    return TrainOptions(**{**base, **kw})


def log(save: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (save / "train.jsonl").read_text().splitlines()) if r["event"] == event]


def check_learns(data: Path, work: Path, device: str, precision: str) -> dict:
    """(a): validation perplexity of a model trained on the task."""
    from .trainer import train

    if precision == "fp16" and device != "cuda":
        return {"check": "learns the task, fp16", "status": "SKIP", "figure": "fp16 needs CUDA"}
    arch, updates = SIZES[device]["learn"]
    save = work / f"learn-{precision}"
    start = time.monotonic()
    train(options(data, save, device, arch=arch, dropout=0.0, precision=precision, max_updates=updates,
                  cooldown=0.3, valid_interval=updates))
    ppl = log(save, "valid")[-1]["valid_ppl"]
    return {"check": f"learns the task, {precision} ({arch}, {updates} updates)",
            "status": "PASS" if ppl < LEARN_PPL else "FAIL",
            "figure": f"valid ppl {ppl:.3f} (< {LEARN_PPL}), {time.monotonic() - start:.0f} s"}


def fast_precision(device: str) -> str:
    """What `--precision auto` trains in on this device (bf16 where it runs fast, else fp32)."""
    import torch

    from nmt_cli.model.precision import auto_precision

    return auto_precision(torch.device(device))


def key_bias_free(weights: dict) -> dict:
    """The weights with every attention's key bias (the middle third of `in_proj.bias`) left out: its gradient
    is exactly zero (softmax ignores a shift shared by all keys), so it receives only rounding noise, which
    Adam turns into learning-rate-sized steps; on CUDA that noise is not deterministic (index_add's atomics)."""
    out = {}
    for name, w in weights.items():
        if name.endswith("in_proj.bias"):
            d = w.shape[0] // 3
            w = w[[*range(d), *range(2 * d, 3 * d)]]
        out[name] = w
    return out


def check_resume(data: Path, work: Path, device: str) -> dict:
    """(b): stopped at N/2 and resumed to N equals N straight: bit-identical on CPU; on CUDA, where sums by
    atomics (index_add_ in the embedding's backward) change with the order threads finish, every weight but the
    attention key biases (`key_bias_free`) within RESUME_ATOL and the per-update losses within TWO_RANK_RTOL."""
    import torch

    from nmt_cli.model.checkpoint import load_checkpoint

    from .trainer import train

    n, precision = 12, fast_precision(device)
    train(options(data, work / "straight", device, max_updates=n, precision=precision, log_interval=1))
    train(options(data, work / "resumed", device, max_updates=n // 2, precision=precision, log_interval=1))
    train(options(data, work / "resumed", device, max_updates=n, precision=precision, log_interval=1))
    a = load_checkpoint(work / "straight" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(work / "resumed" / "checkpoint_last.pt")["model"]
    check = f"stop at {n // 2}, resume to {n} == {n} straight ({precision}, dropout 0.1)"
    if device == "cpu":
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        same = all(torch.equal(a[k], b[k]) for k in a)
        return {"check": check, "status": "PASS" if same else "FAIL",
                "figure": f"max |weight difference| {diff:.2e} (bit-identical)"}
    a, b = key_bias_free(a), key_bias_free(b)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    straight = {r["update"]: r["loss"] for r in log(work / "straight", "train")}
    resumed = {r["update"]: r["loss"] for r in log(work / "resumed", "train")}
    common = sorted(set(straight) & set(resumed))
    worst = max((abs(straight[u] - resumed[u]) / abs(straight[u]) for u in common), default=float("inf"))
    ok = diff <= RESUME_ATOL and worst <= TWO_RANK_RTOL and len(common) == n
    return {"check": check, "status": "PASS" if ok else "FAIL",
            "figure": f"max |weight difference| {diff:.2e} (<= {RESUME_ATOL:g}; key biases left out: their "
                      f"gradient is 0, they move by rounding noise), losses within {worst:.1e} "
                      f"(<= {TWO_RANK_RTOL:g})"}


def check_two_ranks(data: Path, work: Path, device: str) -> dict:
    """(c): 2 processes under torchrun == 1 process with --update-freq 2, update by update."""
    import torch

    from .trainer import train

    n = 6
    rank_device = "cuda" if device == "cuda" and torch.cuda.device_count() >= 2 else "cpu"
    train(options(data, work / "one", rank_device, max_updates=n, update_freq=2, dropout=0.0, max_tokens=256,
                  log_interval=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "nmt_cli",
           "train", str(data), "--save-dir", str(work / "two"), "--arch", "tiny", "--max-tokens", "256", "--warmup",
           "100", "--device", rank_device, "--quiet", "--seed", "3", "--max-updates", str(n), "--dropout", "0",
           "--log-interval", "1", "--valid-interval", "100000"]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    backend = "NCCL" if rank_device == "cuda" else "gloo"
    if result.returncode != 0:
        return {"check": f"2 ranks ({backend}) == 1 with --update-freq 2", "status": "FAIL",
                "figure": result.stderr.strip().splitlines()[-1][:100] if result.stderr.strip() else "failed"}
    one = [r["loss"] for r in log(work / "one", "train")]
    two = [r["loss"] for r in log(work / "two", "train")]
    worst = max(abs(x - y) / abs(x) for x, y in zip(one, two)) if len(one) == len(two) == n else float("inf")
    return {"check": f"2 ranks ({backend}, {rank_device}) == 1 with --update-freq 2, {n} updates",
            "status": "PASS" if worst <= TWO_RANK_RTOL else "FAIL",
            "figure": f"largest relative loss difference {worst:.1e} (<= {TWO_RANK_RTOL:g})"}


def check_speed(device_name: str, arch: str, max_tokens: int, compiled: bool) -> dict:
    """(d): target tokens/s of the real update on synthetic batches, bf16 (`fast_precision`), eager or with the
    layers compiled (`nmt train`'s default on CUDA; the compiling update is among the warm-up ones), under DDP
    and fed from pinned memory as training is."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nmt_cli.model.transformer import Transformer, make_config

    from . import distributed as D
    from .trainer import BUFFER_SYNC_FLAG, TrainOptions, TranslationLoss, train_step

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    warm, timed = SIZES[device.type]["updates"]
    vocab = SIZES[device.type]["vocab"]
    torch.manual_seed(1)
    model = Transformer(make_config(arch, vocab)).to(device)
    if compiled:
        model.compile_layers()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    precision = fast_precision(device.type)
    opts = TrainOptions(data=Path("."), save_dir=Path("."), arch=arch, precision=precision)
    # As training feeds a GPU: page-locked batches copied without blocking (pinned once here; training pins
    # on its collating thread).
    batches = synthetic_batches(8, max_tokens, seed=1, vocab=vocab)
    batches = [b.pin_memory() for b in batches] if cuda else batches
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # Under DDP as multi-GPU training runs (a 1-process group: its gradient buckets and hooks, no network).
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = DistributedDataParallel(TranslationLoss(model, 0.1), device_ids=[device.index or 0] if cuda else None,
                                         gradient_as_bucket_view=True, **{BUFFER_SYNC_FLAG: False})
        tokens, start = 0, 0.0
        for step in range(warm + timed):
            if step == warm:
                if cuda:
                    torch.cuda.synchronize(device)
                start, tokens = time.perf_counter(), 0
            micro = [batches[step % len(batches)].to(device, non_blocking=cuda)]
            train_step(runner, model, micro, optimizer, scaler, opts, D.DistContext(), device)
            tokens += micro[0].ntokens
    finally:
        if own_group:
            dist.destroy_process_group()
    seconds = time.perf_counter() - start  # train_step's host read waits for the update
    speed = tokens / seconds
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        mfu = f"{speed * flops_per_target_token(arch) / (peak * 1e12):.1%}" if peak else "n/a (unknown GPU)"
        memory = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GB"
    else:
        mfu, memory = "n/a (CPU)", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB RSS"
    del model, optimizer, runner
    if cuda:
        torch.cuda.empty_cache()
    mode = "compiled" if compiled else "eager"
    return {"check": f"speed: {arch}, {precision}, {mode}, {max_tokens} tokens per micro-batch, vocabulary {vocab:,}",
            "status": "PASS",
            "figure": f"{speed:,.0f} tgt tok/s, MFU {mfu}, peak {memory}", "tok_s": speed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    from nmt_cli.hardware import describe_machine

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; `make gpu-check DEVICE=cpu` runs the same checks on the CPU",
              file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else describe_machine()
    rows = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_task(work / "task")
        for precision in (fast_precision(args.device), "fp16"):
            rows.append(check_learns(data, work, args.device, precision))
        rows.append(check_resume(data, work, args.device))
        rows.append(check_two_ranks(data, work, args.device))
    for arch in SIZES[args.device]["speed"]:
        for compiled in SIZES[args.device]["compile"]:
            for max_tokens in (4096, 16384):
                try:
                    rows.append(check_speed(args.device, arch, max_tokens, compiled))
                except torch.OutOfMemoryError:
                    rows.append({"check": f"speed: {arch}, {fast_precision(args.device)}, {max_tokens} tokens per "
                                 "micro-batch", "status": "FAIL", "figure": "out of memory"})
    table = Table(title=f"gpu-check on {where}: {time.monotonic() - began:.0f} s")
    for column in ("check", "result", "figures"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["check"], r["status"], r["figure"])
    Console(width=max(Console().width, 140)).print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": where, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0 if all(r["status"] in ("PASS", "SKIP") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
