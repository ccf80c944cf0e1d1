"""Which floating-point type a run computes in: the names `--precision` takes, `auto`'s choice for this device,
and the one-line refusals for a type the device cannot run."""

from __future__ import annotations

import torch

from nmt_cli.errors import NmtError
from nmt_cli.hardware import cpu_has_bf16

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHOICES = ("auto", *PRECISIONS)


def auto_precision(device: torch.device) -> str:
    """What `--precision auto` runs on `device`: bf16 on a GPU that has it (fp16 with loss scaling on older
    ones) and on a CPU that multiplies bf16 in hardware (AMX or avx512_bf16, with oneDNN kernels for it);
    fp32 elsewhere, where bf16 would be emulated and several times slower."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu":
        from .ops import ONEDNN_BF16

        return "bf16" if cpu_has_bf16() and ONEDNN_BF16 else "fp32"
    return "fp32"


def resolve_precision(requested: str, device: torch.device) -> str:
    """`requested` ('auto' resolved for `device`), after refusing in one line a type the device cannot run."""
    if requested not in CHOICES:
        raise NmtError(f"unknown --precision {requested!r} (use {', '.join(CHOICES)})")
    precision = auto_precision(device) if requested == "auto" else requested
    if precision == "fp16" and device.type != "cuda":
        raise NmtError("--precision fp16 needs CUDA; on CPU use bf16 or fp32 (or auto)")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise NmtError("--precision bf16: this GPU does not support bfloat16; use fp16")
    return precision
