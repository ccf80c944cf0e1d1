"""Lexical constraints in beam search: how far a hypothesis is through its sentence's target phrases, and
dynamic beam allocation (Post & Vilar, 2018): the beam is shared out among hypotheses that have met
different numbers of constraint tokens, so that those forced towards a phrase survive their lower scores.
Pure Python: it decides among a few dozen candidates per sentence and step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A hypothesis's progress: (bitmask of the phrases met, the phrase it is inside or -1, tokens of it matched).
Progress = tuple[int, int, int]
START: Progress = (0, -1, 0)


@dataclass(frozen=True)
class Phrases:
    """One sentence's constraints: target phrases (token ids) that must each appear in its output."""

    phrases: tuple[tuple[int, ...], ...]

    @property
    def all_met(self) -> int:
        return (1 << len(self.phrases)) - 1

    def advance(self, progress: Progress, token: int) -> Progress:
        """The progress after `token`. Inside a phrase, the next token of it moves on (the last one meets
        it); any other token drops the partial match, and may start an unmet phrase itself."""
        met, current, matched = progress
        if current >= 0:
            phrase = self.phrases[current]
            if token == phrase[matched]:
                if matched + 1 == len(phrase):
                    return met | (1 << current), -1, 0
                return met, current, matched + 1
        for c, phrase in enumerate(self.phrases):
            if not met >> c & 1 and phrase[0] == token:
                return (met | (1 << c), -1, 0) if len(phrase) == 1 else (met, c, 1)
        return met, -1, 0

    def wanted(self, progress: Progress) -> list[int]:
        """Tokens that make progress: the next of the phrase being matched, the first of each unmet one."""
        met, current, matched = progress
        tokens = [self.phrases[current][matched]] if current >= 0 else []
        tokens += [p[0] for c, p in enumerate(self.phrases) if not met >> c & 1 and c != current]
        return list(dict.fromkeys(tokens))

    def bank(self, progress: Progress) -> int:
        """Constraint tokens met so far (the partial phrase's included): the hypothesis's bank."""
        met, _, matched = progress
        return sum(len(p) for c, p in enumerate(self.phrases) if met >> c & 1) + matched

    def complete(self, progress: Progress) -> bool:
        return progress[0] == self.all_met


@dataclass
class Candidate:
    score: float  # log-probability of the hypothesis with the token
    slot: int  # the open hypothesis it extends
    token: int
    progress: Progress


def allocate(candidates: Sequence[Candidate], phrases: Phrases, beam: int) -> list[Candidate]:
    """Up to `beam` candidates, best first: banks (constraint tokens met) take turns, each giving its best
    remaining candidate, the bank with most tokens met first (as fairseq's vectorized version ranks
    them), so every bank that has candidates keeps some of the beam."""
    banks: dict[int, list[Candidate]] = {}
    for c in sorted(candidates, key=lambda c: -c.score):
        banks.setdefault(phrases.bank(c.progress), []).append(c)
    order = sorted(((rank, -bank, c) for bank, cs in banks.items() for rank, c in enumerate(cs)),
                   key=lambda t: (t[0], t[1]))
    chosen = [c for _, _, c in order[:beam]]
    return sorted(chosen, key=lambda c: -c.score)
