"""Which kind of model a path holds (an nmt checkpoint, a save dir, a CTranslate2 or a Transformers folder),
told without torch, so that each engine can refuse the others' files in one line."""

from __future__ import annotations

from pathlib import Path


def checkpoint_hint(folder: str | Path) -> str:
    """'; did you mean FOLDER/checkpoint_best.pt?' for a save dir given where a checkpoint file belongs, else ''."""
    names = ("checkpoint_best.pt", "checkpoint_last.pt", "model.pt")
    return next((f"; did you mean {Path(folder) / name}?" for name in names if (Path(folder) / name).is_file()), "")


def is_transformers_folder(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face Transformers model folder (`nmt export transformers` writes one)."""
    folder = Path(path)
    return folder.is_dir() and (folder / "config.json").is_file() and not (folder / "model.bin").is_file()


TRANSFORMERS_FOLDER = ("a Hugging Face Transformers folder: nmt does not run those; load it in Python with "
                       "AutoTokenizer and AutoModelForSeq2SeqLM.from_pretrained (its README.md shows how), or give "
                       "nmt the checkpoint (.pt) it was exported from")


def is_exported_model(path: str | Path) -> bool:
    """Whether `path` is a folder written by `nmt export ctranslate2`."""
    return Path(path).is_dir() and (Path(path) / "model.bin").is_file()
