"""Settings PyTorch and oneDNN read once per process, at their first use: the kernel cache and huge pages."""

import os
import sys

# oneDNN (bf16 matmuls on CPU) compiles and caches one kernel per matrix shape, 1024 by default, and reads
# the cache size once, at its first kernel, so the first workload in a process decides it.
TRAINING_KERNEL_CACHE = 128  # variable (batch x length) shapes: 256 held ~190 MB more at the same speed
DECODING_KERNEL_CACHE = 4096  # beam search's shrinking row counts cycle through ~500 shapes; 256 thrashes (-15%)
# A server meets many more (batch x length x beam) shapes than a file, so it keeps fewer, for bfloat16 (its
# float32 products do not use oneDNN: ops.serving_products); docs/benchmarks.md, "Serving soak".
SERVING_KERNEL_CACHE = 1024


def size_kernel_cache(capacity: int) -> None:
    """Ask oneDNN to cache `capacity` kernels, unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def use_huge_pages_for_tensors() -> bool:
    """Ask PyTorch's CPU allocator to back tensors of 2 MB and more with transparent huge pages, for training.

    A training update allocates and frees many large tensors; glibc hands freed ones back to the kernel and each
    new one is faulted in again, 4 KB at a time (docs/benchmarks.md, "Training speed"). PyTorch reads
    THP_MEM_ALLOC_ENABLE once, at its first allocation, so this must run before torch is imported; returns
    whether huge pages are on (a user's own THP_MEM_ALLOC_ENABLE wins)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
