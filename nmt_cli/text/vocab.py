"""The shared source/target vocabulary: special symbols first, then BPE pieces by frequency."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.textio import read_lines, write_lines

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)


class Vocabulary:
    """Maps symbols to ids and back; ids 0-3 are <pad>, <s>, </s>, <unk>."""

    pad, bos, eos, unk = 0, 1, 2, 3

    def __init__(self, symbols: Sequence[str]) -> None:
        if tuple(symbols[: len(SPECIALS)]) != SPECIALS:
            raise NmtError(f"vocabulary must start with {' '.join(SPECIALS)}")
        self.symbols = list(symbols)
        self.index = {s: i for i, s in enumerate(self.symbols)}
        if len(self.index) != len(self.symbols):
            raise NmtError("vocabulary has duplicate symbols")

    def __len__(self) -> int:
        return len(self.symbols)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.symbols == other.symbols

    @classmethod
    def build(cls, lines: Iterable[str], threshold: int = 1) -> Vocabulary:
        """Count the pieces of whitespace-split lines; keep those seen at least `threshold` times.

        Order: frequency descending, ties broken alphabetically, so the result is deterministic.
        """
        return cls.from_counts(Counter(piece for line in lines for piece in line.split()), threshold)

    @classmethod
    def from_counts(cls, counts: Counter[str], threshold: int = 1) -> Vocabulary:
        """The vocabulary of pieces counted at least `threshold` times, most frequent first (ties alphabetical)."""
        counts = Counter(counts)
        for special in SPECIALS:
            counts.pop(special, None)
        kept = sorted((s for s, c in counts.items() if c >= threshold), key=lambda s: (-counts[s], s))
        return cls(list(SPECIALS) + kept)

    def encode(self, line: str) -> list[int]:
        """Ids of a whitespace-split line (no </s> appended); unknown pieces become <unk>."""
        get, unk = self.index.get, self.unk
        return [get(piece, unk) for piece in line.split()]

    def decode(self, ids: Iterable[int]) -> str:
        """The pieces of `ids` up to the first </s>, special symbols left out."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos:
                break
            if i >= self.unk:
                out.append(self.symbols[i])
        return " ".join(out)

    def save(self, path: str | Path) -> None:
        """Write one symbol per line."""
        write_lines(path, self.symbols)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read a vocabulary written by `save`."""
        return cls(read_lines(path))
