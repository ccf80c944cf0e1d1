"""Sampling's settings (no torch: the CTranslate2 engine and the server read them too)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nmt_cli.errors import NmtError


@dataclass(frozen=True)
class Sampling:
    """Draw each token instead of searching: from the `topk` most probable only (0: all), from the smallest
    set whose probability reaches `topp` (1: all), the distribution sharpened (temperature < 1) or flattened
    (> 1); `seed` makes the draws repeatable."""

    topk: int = 0
    topp: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def check(self) -> None:
        """One line naming the flag for a setting that cannot be sampled with."""
        if not 0 <= self.topk <= 1_000_000:
            raise NmtError(f"--topk must be 0 (all tokens) or more (got {self.topk})")
        if not (math.isfinite(self.topp) and 0 < self.topp <= 1):
            raise NmtError(f"--topp must be in (0, 1] (got {self.topp})")
        if not (math.isfinite(self.temperature) and 0 < self.temperature <= 100):
            raise NmtError(f"--temperature must be more than 0 and at most 100 (got {self.temperature})")
        if not 0 <= self.seed < 2**63:
            raise NmtError(f"--seed must be between 0 and 2**63 - 1 (got {self.seed})")

    def sentence_seed(self, source: list[int]) -> int:
        """The seed of one sentence's draws: from `seed` and the sentence's token ids, so that a sentence
        samples alike alone or in any batch, and two different sentences differently."""
        import zlib

        data = b"".join(i.to_bytes(4, "little") for i in source)
        return (self.seed * 1_000_003 + zlib.crc32(data)) % 2**63
