"""What kind of machine this is, in the words speed figures and test margins are labelled with."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (the platform's name and no flags without it)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    return model, frozenset(info.get("flags", "").split())


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AMX or avx512_bf16); without it PyTorch emulates bf16
    products, several times slower than float32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags()[1])


def cpu_kind() -> str:
    """A short name for the kind of CPU: 'Intel Xeon (AMX)', 'AMD EPYC (avx512_bf16, no AMX)', or the model name
    with what it offers for bf16. Speed ratios are taken only between figures of one kind."""
    model, flags = cpu_flags()
    if "amx_bf16" in flags:
        bf16 = "AMX"
    elif "avx512_bf16" in flags:
        bf16 = "avx512_bf16, no AMX"
    else:
        bf16 = "no bf16 instructions"
    name = "Intel Xeon" if "Xeon" in model else "AMD EPYC" if "EPYC" in model else model
    return f"{name} ({bf16})"


def describe_machine() -> str:
    """One line: the kind of CPU, its model name, core count and torch version."""
    import torch

    return f"{cpu_kind()}: {cpu_flags()[0]}, {os.cpu_count()} cores, torch {torch.__version__}"


def device_kind(device: torch.device) -> str:
    """The machine a run trains on, in the words of its log: the GPU's name, or the kind of CPU with its model
    name."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_kind()}: {cpu_flags()[0]}"


def resolve_device(requested: str | None, local_rank: int = 0) -> torch.device:
    """`cpu`, `cuda` (this process's GPU under torchrun) or None for CUDA when present; clear error without CUDA."""
    import torch

    from nmt_cli.errors import NmtError

    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise NmtError("--device cuda asked for, but no CUDA device is available (use --device cpu)")
        if requested == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device(requested)
    raise NmtError(f"unknown --device {requested!r} (use cpu or cuda)")
