"""The output length limit: one formula for every engine, search and check (no torch)."""

from __future__ import annotations

import math


def max_output_tokens(source_len: int, max_len_a: float, max_len_b: int, max_positions: int) -> int:
    """The most output tokens before </s> for a source of `source_len` tokens (</s> not counted): a * len + b
    rounded down in double precision (as fairseq's `int(a * len + b)`), within the model's positions (two are
    kept for <s> and </s>)."""
    return max(0, min(math.floor(source_len * max_len_a + max_len_b), max_positions - 2))
