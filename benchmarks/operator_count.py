"""How many operators one training update launches: every ATen operator that reaches a kernel (views and
other aliasing operators, which launch nothing on a GPU, left out), counted through the real `train_step` and
split by phase (forward, backward, optimizer, the rest) and by kind.

On a GPU each of these is (at least) one kernel launch, each costing the host a few microseconds to issue:
a count in the thousands per micro-batch means the host, not the GPU, can set the pace. The count does not
depend on the device, so a CPU measures it. `base` at 4,096 target tokens per micro-batch, the vocabulary
size BPE gives (36,997, padded to 37,056 rows), synthetic WMT-like batches (`gpu_check.synthetic_batches`).

With --compile, the update is also counted with the layers compiled (`Transformer.compile_layers`, inductor's
CPU backend) through the profiler, which sees inductor's fused kernels: the same update eager and compiled
side by side (both counted the profiler's way: an operator that reaches a kernel, or a fused kernel, once).

    python benchmarks/operator_count.py [--arch base] [--max-tokens 4096] [--precision bf16] [--update-freq 1]
                                        [--compile] [--cuda-path]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
from common import machine, print_table
from torch.utils._python_dispatch import TorchDispatchMode

from nmt_cli.model.transformer import Transformer, make_config
from nmt_cli.training import distributed as D
from nmt_cli.training.gpu_check import VOCAB, synthetic_batches
from nmt_cli.training.options import TrainOptions
from nmt_cli.training.update import TranslationLoss, train_step

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
    if name == "(inductor fused kernel)":
        return "inductor fused kernel"
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


# Operators the profiler records that launch no kernel of their own (views, metadata, allocation).
NO_KERNEL_PROFILED = NO_KERNEL | FILLS - {"zero_", "fill_", "zeros", "zeros_like", "full", "ones_like", "full_like",
                                        "arange", "scalar_tensor"} | {
    "view", "slice", "t", "transpose", "unsqueeze", "squeeze", "as_strided", "expand", "reshape", "permute",
    "select", "split", "unbind", "narrow", "unflatten", "flatten", "split_with_sizes", "chunk", "contiguous", "to",
    "resolve_conj", "resolve_neg", "result_type", "view_as", "expand_as", "set_", "resize_", "numpy_T", "unfold",
    "_local_scalar_dense", "item", "type_as", "lift_fresh_copy", "broadcast_tensors"}


def profiled_counts(run) -> Counter:
    """Operators `run()` launches, from the profiler's tree: an ATen operator that is not a view, metadata
    or a composite one (those are entered, their parts counted), or one of inductor's fused kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    children: dict[int, list] = {}
    roots = []
    for event in prof.events():
        (roots if event.cpu_parent is None else children.setdefault(id(event.cpu_parent), [])).append(event)

    def composite(name: str) -> bool:
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
        except RuntimeError:
            return False

    counts: Counter = Counter()

    def visit(event) -> None:
        name = event.name
        if "cpp_fused" in name or "triton_" in name:
            counts["(inductor fused kernel)"] += 1
        elif name.startswith("aten::") and name[6:] not in NO_KERNEL_PROFILED and not composite(name):
            counts[name[6:]] += 1
        else:
            for child in children.get(id(event), []):
                visit(child)

    for root in roots:
        visit(root)
    return counts


def compare_compiled(args, micro) -> None:
    """The same update eager and with the layers compiled, counted by the profiler, side by side."""
    import torch._inductor.config as inductor

    inductor.cpp.enable_kernel_profile = True  # each fused CPU kernel becomes a profiler event
    inductor.force_disable_caches = True  # the compile time a first run pays
    columns, seconds = {}, 0.0
    for compiled in (False, True):
        torch.manual_seed(1)
        model = Transformer(make_config(args.arch, VOCAB))
        if compiled:
            model.compile_layers()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        opts = TrainOptions(data=Path("."), save_dir=Path("."), arch=args.arch, precision=args.precision)
        runner = TranslationLoss(model, 0.1)

        update = partial(train_step, runner, model, micro, optimizer, scaler, opts, D.DistContext(),
                         torch.device("cpu"))

        start = time.perf_counter()
        update()  # compiles (when compiled); Adam's state exists after it
        if compiled:
            seconds = time.perf_counter() - start
        update()  # the dynamic-shape graphs settled
        columns[compiled] = profiled_counts(update)
    eager, compiled = columns[False], columns[True]
    rows = [[kind_name, sum(n for k, n in eager.items() if kind(k) == kind_name),
             sum(n for k, n in compiled.items() if kind(k) == kind_name)]
            for kind_name in dict.fromkeys(kind(k) for k in [*eager, *compiled])]
    rows.append(["per update", sum(eager.values()), sum(compiled.values())])
    print_table(f"operators per update, eager vs layers compiled (profiler; compile: {seconds:.0f} s)",
                ["kind", "eager", "compiled"], rows)
    print_table(f"the {args.top} most frequent, compiled", ["operator", "count"],
                [[k, n] for k, n in compiled.most_common(args.top)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="base")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--update-freq", type=int, default=1, help="micro-batches per update")
    parser.add_argument("--top", type=int, default=12, help="also list the most frequent operators")
    parser.add_argument("--compile", action="store_true", help="also count the update with the layers compiled")
    parser.add_argument("--cuda-path", action="store_true", help=(
        "take the code path CUDA takes where it differs: scaled_dot_product_attention instead of CPU training's "
        "bf16 matmul + softmax + matmul, and the fused loss in chunks of 4,096 rows instead of 256"))
    args = parser.parse_args()
    if args.cuda_path:
        import nmt_cli.model.ops
        import nmt_cli.model.transformer

        nmt_cli.model.transformer._fp32_attention_on_cpu = lambda x: False
        nmt_cli.model.ops.LOSS_CHUNK_ROWS["cpu"] = nmt_cli.model.ops.LOSS_CHUNK_ROWS["cuda"]
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
    if args.compile:
        compare_compiled(args, micro)


if __name__ == "__main__":
    main()
