"""The toy task the tests and `make gpu-check` train on: a model that learns it has learned to translate."""

from __future__ import annotations

import random
from pathlib import Path


def write_word_mapping_task(prefix: str | Path, n: int, seed: int) -> None:
    """n pairs at prefix.en / prefix.de: each source word w<i> maps to the target word v<i>, order kept (2-7
    words of 24)."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.randrange(24) for _ in range(rng.randint(2, 7))]
        src.append(" ".join(f"w{i}" for i in words).capitalize() + ".")
        tgt.append(" ".join(f"v{i}" for i in words).capitalize() + ".")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    Path(f"{prefix}.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")
