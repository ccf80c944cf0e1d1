"""nmt: the Transformer of "Attention Is All You Need", end to end from the command line."""

import os

__version__ = "0.1.0"

# oneDNN (bf16 matmuls on CPU) compiles and caches one kernel per matrix shape, 1024 by default, and reads
# the cache size once, at its first kernel, so the first workload in a process decides it.
TRAINING_KERNEL_CACHE = 128  # variable (batch x length) shapes: 256 held ~190 MB more at the same speed
DECODING_KERNEL_CACHE = 4096  # beam search's shrinking row counts cycle through ~500 shapes; 256 thrashes (-15%)


def size_kernel_cache(capacity: int) -> None:
    """Ask oneDNN to cache `capacity` kernels, unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
