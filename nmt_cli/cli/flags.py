"""The flag types, help panels and flags that several `nmt` commands declare alike."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

Arch = Enum("Arch", {name: name for name in ("tiny", "small", "base", "big")}, type=str)
Precision = Enum("Precision", {name: name for name in ("auto", "fp32", "bf16", "fp16")}, type=str)
CommPrecision = Enum("CommPrecision", {name: name for name in ("fp32", "bf16", "fp16")}, type=str)
Device = Enum("Device", {name: name for name in ("cpu", "cuda")}, type=str)
Engine = Enum("Engine", {name: name for name in ("auto", "nmt", "ctranslate2")}, type=str)
Tokenizer = Enum("Tokenizer", {name: name for name in ("moses", "sentencepiece")}, type=str)
SpmType = Enum("SpmType", {name: name for name in ("unigram", "bpe")}, type=str)
# --help panels of the commands with many flags
P_DATA = "Data and batches"
P_MODEL = "Model"
P_OPTIM = "Optimisation"
P_STOP = "Stopping and checkpoints"
P_LOG = "Logging"
P_DEVICE = "Devices and precision"
P_IO = "Input and output"
P_SEARCH = "Search"
P_STEER = "Sampling, prefixes and constraints"
ENGINE_HELP = ("auto: nmt for a checkpoint, CTranslate2 for an exported folder; ctranslate2 also runs a checkpoint "
               "(exported, float32, to a temporary folder at start-up).")

# Flags that translate and serve (and train, for --device) declare alike.
DeviceFlag = Annotated[Optional[Device], typer.Option(
    rich_help_panel=P_DEVICE, help="Default: cuda when available, else cpu.")]
ModelsFlag = Annotated[list[Path], typer.Option("--model", "-m", rich_help_panel=P_IO, help=(
    "Checkpoint (repeat for an ensemble), or a folder written by `nmt export ctranslate2`."))]
InferencePrecisionFlag = Annotated[Precision, typer.Option(rich_help_panel=P_DEVICE, help=(
    "Precision (fp16: CUDA only; auto: bf16 where the device multiplies it in hardware, else fp32). fp32 by "
    "default, unlike nmt train's auto: outputs exactly as the model scores them (bf16 is faster on such a "
    "device and changes a few outputs)."))]
ThreadsFlag = Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help=(
    "CPU threads in all (0: torch's default; an exported model up to 4)."))]
EngineFlag = Annotated[Engine, typer.Option(rich_help_panel=P_DEVICE, help=ENGINE_HELP)]
# Training-pair filters that nmt prepare and nmt binarize apply alike (the counts are in meta.json).
RemoveDuplicatesFlag = Annotated[bool, typer.Option(
    "--remove-duplicates/--keep-duplicates", help="Drop a training pair seen before (both sides equal).")]
RemoveCopiesFlag = Annotated[bool, typer.Option(
    "--remove-copies/--keep-copies", help="Drop a training pair whose source equals its target (untranslated).")]
