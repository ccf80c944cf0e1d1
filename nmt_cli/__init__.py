"""nmt: the Transformer of "Attention Is All You Need", end to end from the command line."""

import os
import sys

__version__ = "0.1.0"

# oneDNN (bf16 matmuls on CPU) compiles and caches one kernel per matrix shape, 1024 by default, and reads
# the cache size once, at its first kernel, so the first workload in a process decides it.
TRAINING_KERNEL_CACHE = 128  # variable (batch x length) shapes: 256 held ~190 MB more at the same speed
DECODING_KERNEL_CACHE = 4096  # beam search's shrinking row counts cycle through ~500 shapes; 256 thrashes (-15%)
# A server meets many more (batch x length x beam) shapes than a file: with 4,096 kernels its memory still grew
# after 10 minutes of soak (1.7 -> 2.9 GB); with 1,024 it levels off at ~2.6 GB after 4 minutes, latency unchanged
# (p50 766 vs 782 ms); with 256 at ~1.8 GB, 13% slower (docs/benchmarks.md, "Serving soak"). Float32 serving
# no longer uses oneDNN for its products (ops.keep_float32_off_onednn: ~0.5 GB, level); this is for bfloat16.
SERVING_KERNEL_CACHE = 1024


def size_kernel_cache(capacity: int) -> None:
    """Ask oneDNN to cache `capacity` kernels, unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def use_huge_pages_for_tensors() -> bool:
    """Ask PyTorch's CPU allocator to back tensors of 2 MB and more with transparent huge pages, for training.

    A training update allocates and frees many large tensors; glibc hands freed ones back to the kernel and each
    new one is faulted in again, 4 KB at a time (1.7M minor faults in the 110-update `small` bf16 benchmark,
    0.8M with huge pages). Measured on the 2-core Intel Xeon (AMX): +4% target tokens/s, peak memory 2.4 ->
    2.1 GB. PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first allocation, so this must run before torch is
    imported; returns whether huge pages are on (a user's own THP_MEM_ALLOC_ENABLE wins)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
