"""The engine choice: which translator runs a checkpoint or an exported folder. It sits above both engines
(`translate` for nmt's own, `ct2` for CTranslate2) and the text pipeline they share, so none of those
imports another upward."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nmt_cli.decode.pipeline import TextTranslator
from nmt_cli.errors import NmtError
from nmt_cli.model.files import TRANSFORMERS_FOLDER, checkpoint_hint, is_exported_model, is_transformers_folder
from nmt_cli.textio import describe_path

ENGINES = ("auto", "nmt", "ctranslate2")


def load_translator(paths: Sequence[str | Path], device: str | None = None, precision: str = "fp32",
                    threads: int = 0, engine: str = "auto", workers: int = 1) -> TextTranslator:
    """A translator for nmt checkpoints (several: an ensemble) or one exported CTranslate2 folder, searching
    `workers` batches at once on CPU (0: two where there are at least two cores; one on a GPU).

    engine "auto" runs a checkpoint with nmt and a folder with CTranslate2; "ctranslate2" also runs a
    checkpoint with CTranslate2 (exported, float32, to a temporary folder); "nmt" refuses a folder."""
    paths = list(paths)
    if engine not in ENGINES:
        raise NmtError(f"unknown --engine {engine!r} (choose from {', '.join(ENGINES)})")
    exported = [p for p in paths if is_exported_model(p)]
    for path in paths:
        if is_transformers_folder(path):
            raise NmtError(f"{path}: {TRANSFORMERS_FOLDER}")
        if Path(path).is_dir() and path not in exported:
            raise NmtError(f"{path}: {describe_path(Path(path))}, not a model: give a checkpoint (.pt) or an "
                           "`nmt export` folder" + checkpoint_hint(path))
    if exported and engine == "nmt":
        raise NmtError(f"{exported[0]}: an exported CTranslate2 folder; --engine nmt needs the checkpoint (.pt) "
                       "it was exported from")
    if exported or engine == "ctranslate2":
        if len(paths) > 1:
            hint = "" if exported else " (or use --engine nmt)"  # --engine nmt cannot run an exported folder
            raise NmtError(f"{paths[0]}: CTranslate2 runs one model, not an ensemble; give it alone{hint}")
        if precision not in ("fp32", "auto"):
            raise NmtError(f"--precision {precision}: CTranslate2 computes in the type the model was exported with "
                           "(nmt export ctranslate2 --quantization)")
        from .ct2 import CTranslate2Translator  # imported when used: an exported folder runs without torch

        if exported:
            return CTranslate2Translator.from_dir(paths[0], device=device, threads=threads, workers=workers)
        return CTranslate2Translator.from_checkpoint(paths[0], device=device, threads=threads, workers=workers)
    from nmt_cli.decode.translate import Translator  # torch, imported only for nmt's engine

    return Translator.from_checkpoint(paths, device=device, precision=precision, threads=threads, workers=workers)
