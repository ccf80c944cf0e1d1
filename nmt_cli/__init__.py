"""nmt: the Transformer of "Attention Is All You Need", end to end from the command line."""

__version__ = "0.1.0"
