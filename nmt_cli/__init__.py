"""nmt: the Transformer of "Attention Is All You Need", end to end from the command line.

The Python API's names (docs/python-api.md) are importable from here, each loaded on first use so that
`import nmt_cli` stays free of torch: `from nmt_cli import Translator`."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
API = {
    "Translator": "nmt_cli.decode.translate",
    "load_translator": "nmt_cli.export.engines",
    "attention_maps": "nmt_cli.model.attention",
    "plot_attention": "nmt_cli.model.attention",
    "PrepareOptions": "nmt_cli.data.options",
    "prepare": "nmt_cli.data.prepare",
    "TrainOptions": "nmt_cli.training.options",
    "train": "nmt_cli.training.trainer",
    "average_checkpoints": "nmt_cli.model.checkpoint",
    "score": "nmt_cli.decode.score",
    "export_ctranslate2": "nmt_cli.export.ct2",
    "export_transformers": "nmt_cli.export.hf",
    "import_transformers": "nmt_cli.export.hf_import",
    "create_app": "nmt_cli.serve.app",
    "translator_thread": "nmt_cli.serve.batching",
}
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name in API:
        value = getattr(importlib.import_module(API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nmt_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
