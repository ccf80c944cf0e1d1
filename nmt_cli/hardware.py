"""What kind of machine this is, in the words speed figures and test margins are labelled with."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its feature flags, as /proc/cpuinfo gives them (empty where it is missing)."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def has_amx() -> bool:
    """Whether the CPU multiplies bf16 on AMX tiles (Intel Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_flags()[1]


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
    for vendor, name in (("Intel", "Intel Xeon"), ("AMD", "AMD EPYC")):
        if vendor in model and ("Xeon" in model or "EPYC" in model):
            return f"{name} ({bf16})"
    return f"{model} ({bf16})"


def describe_machine() -> str:
    """One line: the kind of CPU, its model name, core count and torch version."""
    import torch

    return f"{cpu_kind()}: {cpu_flags()[0]}, {os.cpu_count()} cores, torch {torch.__version__}"
