"""How many operators one training update launches: every ATen operator that reaches a kernel (views and
other aliasing operators, which launch nothing on a GPU, left out), counted through the real `train_step` and
split by phase (forward, backward, optimizer, the rest) and by kind.

On a GPU each of these is (at least) one kernel launch, each costing the host a few microseconds to issue:
a count in the thousands per micro-batch means the host, not the GPU, can set the pace. The count does not
depend on the device, so a CPU measures it. `base` at 4,096 target tokens per micro-batch, the vocabulary
size BPE gives (36,997, padded to 37,056 rows), synthetic WMT-like batches (`gpu_check.synthetic_batches`).

    python benchmarks/operator_count.py [--arch base] [--max-tokens 4096] [--precision bf16] [--update-freq 1]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from common import machine, print_table
from torch.utils._python_dispatch import TorchDispatchMode

from nmt_cli import distributed as D
from nmt_cli.gpu_check import VOCAB, synthetic_batches
from nmt_cli.model import Transformer, make_config
from nmt_cli.train_options import TrainOptions
from nmt_cli.update import TranslationLoss, train_step

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_efficient_attention_backward"}
COPIES = {"_to_copy", "copy_", "clone", "contiguous", "_copy_from", "to"}
NO_KERNEL = {"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh"}  # views by another name
FILLS = {"zero_", "fill_", "zeros", "zeros_like", "empty", "empty_like", "new_empty", "new_zeros", "full",
         "empty_strided", "new_empty_strided", "ones_like", "full_like", "scalar_tensor", "arange"}


def kind(name: str) -> str:
    """A coarse class of an ATen operator's name (without overload)."""
    if name in MATMUL:
        return "matrix product / attention"
    if name in COPIES:
        return "copy or cast"
    if name in FILLS:
        return "allocation or fill"
    if name.startswith("_fused_adam") or name.startswith("_foreach"):
        return "optimizer (fused / foreach)"
    return "element-wise, reduction, other"


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched to kernels on this thread, by the current `phase` and by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.by_phase: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in NO_KERNEL:
            self.by_phase[self.phase] += 1
            self.by_kind[kind(name)] += 1
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="base")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--update-freq", type=int, default=1, help="micro-batches per update")
    parser.add_argument("--top", type=int, default=12, help="also list the most frequent operators")
    args = parser.parse_args()
    torch.manual_seed(1)
    model = Transformer(make_config(args.arch, VOCAB))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opts = TrainOptions(data=Path("."), save_dir=Path("."), arch=args.arch, precision=args.precision)
    runner, device = TranslationLoss(model, 0.1), torch.device("cpu")
    micro = synthetic_batches(args.update_freq, args.max_tokens, seed=1)
    train_step(runner, model, micro, optimizer, scaler, opts, D.DistContext(), device)  # Adam's state exists now
    counter = OperatorCounter()

    def phase(name: str):
        def hook(*_) -> None:
            counter.phase = name
        return hook

    handles = [runner.register_forward_pre_hook(phase("forward")), runner.register_forward_hook(phase("backward")),
               optimizer.register_step_pre_hook(phase("optimizer")),
               optimizer.register_step_post_hook(phase("other"))]
    with counter:
        train_step(runner, model, micro, optimizer, scaler, opts, D.DistContext(), device)
    for handle in handles:
        handle.remove()
    total = sum(counter.by_phase.values())
    per_micro = (counter.by_phase["forward"] + counter.by_phase["backward"]) / args.update_freq
    print(f"{machine()}; {args.arch}, {args.precision}, {args.max_tokens} tokens per micro-batch, "
          f"{args.update_freq} micro-batch(es) per update, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters in {len(list(model.parameters()))} tensors")
    rows = [[name, counter.by_phase[name]] for name in ("forward", "backward", "optimizer", "other")]
    rows += [["per micro-batch (forward + backward)", round(per_micro)], ["per update", total]]
    print_table("operators launched (eager)", ["phase", "operators"], rows)
    print_table("by kind, per update", ["kind", "operators"], [[k, n] for k, n in counter.by_kind.most_common()])
    print_table(f"the {args.top} most frequent", ["operator", "count"],
                [[k, n] for k, n in counter.names.most_common(args.top)])


if __name__ == "__main__":
    main()
