"""Where one training update spends its time: torch.profiler's per-op table over a few timed updates.

Builds the real `Trainer` (model, optimizer, batches) on prepared data, runs warm-up updates (oneDNN
builds its kernels for new shapes then), then profiles `--updates` more through the real `train_step`
and prints the ops by self CPU time, with the share of matrix products versus everything else.

    python benchmarks/profile_train.py DATA_DIR [--arch small] [--precision bf16] [--updates 20] [--rows 30]
                                       [--by-shape]   # also each op's time by input shapes

DATA_DIR is an `nmt prepare` output folder (for example exp/multi30k/data after `make multi30k`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--arch", default="small")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--warmup-updates", type=int, default=30)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    parser.add_argument("--by-shape", action="store_true", help="also list the ops by input shapes")
    args = parser.parse_args()

    from nmt_cli.torch_env import use_huge_pages_for_tensors

    use_huge_pages_for_tensors()  # as `nmt train` does, before torch is imported
    from torch.profiler import ProfilerActivity, profile

    from nmt_cli.data.binarized import collate, shuffled
    from nmt_cli.training.trainer import Trainer, TrainOptions
    from nmt_cli.training.update import train_step

    with tempfile.TemporaryDirectory() as tmp:
        opts = TrainOptions(data=args.data, save_dir=Path(tmp), arch=args.arch, precision=args.precision,
                            max_tokens=args.max_tokens, device="cpu", quiet=True)
        trainer = Trainer(opts)
        batches = shuffled(trainer.batches, 1, 0)

        def run(first: int, count: int) -> tuple[float, int]:
            tokens, start = 0, time.perf_counter()
            for indices in batches[first : first + count]:
                batch = collate(trainer.train_corpus, indices, trainer.data.vocab)
                for group in trainer.optimizer.param_groups:
                    group["lr"] = 1e-4
                train_step(trainer.runner, trainer.model, [batch], trainer.optimizer, trainer.scaler, opts,
                           trainer.ctx, trainer.device)
                tokens += batch.ntokens
            return time.perf_counter() - start, tokens

        run(0, args.warmup_updates)
        seconds, tokens = run(args.warmup_updates, args.updates)  # unprofiled, for the tokens/s figure
        first = args.warmup_updates + args.updates
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
            run(first, args.updates)
    print(f"{args.arch} {args.precision}: {tokens / seconds:,.0f} target tokens/s over {args.updates} updates "
          f"(unprofiled), {seconds / args.updates * 1000:.1f} ms per update")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    print(f"self CPU time: {total / 1e3 / args.updates:.1f} ms per update; matrix products and attention "
          f"kernels {100 * matmul / total:.0f}%, everything else {100 * (total - matmul) / total:.0f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.by_shape:
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                                 max_name_column_width=30, max_shapes_column_width=90))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
