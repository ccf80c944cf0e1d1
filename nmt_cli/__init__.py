"""nmt: the Transformer of "Attention Is All You Need", end to end from the command line."""

import os

# oneDNN (bf16 matmuls on CPU) caches a compiled kernel per matrix shape, 1024 by default; with
# variable-length batches that cache grows by gigabytes. 256 keeps memory bounded at no measured speed cost.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")

__version__ = "0.1.0"
