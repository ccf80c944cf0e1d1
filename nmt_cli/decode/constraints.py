"""Lexical constraints in beam search: how far a hypothesis is through its sentence's target phrases, and
dynamic beam allocation (Post & Vilar, 2018): the beam is shared out among hypotheses that have met
different numbers of constraint tokens, so that those forced towards a phrase survive their lower scores.
Pure Python: it decides among a few dozen candidates per sentence and step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A hypothesis's progress: (bitmask of the phrases met, the phrase it is inside or -1, tokens of it matched,
# constraint tokens met in all: its bank).
Progress = tuple[int, int, int, int]
START: Progress = (0, -1, 0, 0)


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
        met, current, matched, bank = progress
        if current >= 0:
            phrase = self.phrases[current]
            if token == phrase[matched]:
                if matched + 1 == len(phrase):
                    return met | (1 << current), -1, 0, bank + 1
                return met, current, matched + 1, bank + 1
            bank -= matched
        for c, phrase in enumerate(self.phrases):
            if not met >> c & 1 and phrase[0] == token:
                return (met | (1 << c), -1, 0, bank + 1) if len(phrase) == 1 else (met, c, 1, bank + 1)
        return met, -1, 0, bank

    def wanted(self, progress: Progress) -> list[int]:
        """Tokens that make progress: the next of the phrase being matched, the first of each unmet one."""
        met, current, matched, _ = progress
        tokens = [self.phrases[current][matched]] if current >= 0 else []
        tokens += [p[0] for c, p in enumerate(self.phrases) if not met >> c & 1 and c != current]
        return list(dict.fromkeys(tokens))

    def complete(self, progress: Progress) -> bool:
        return progress[0] == self.all_met


# A candidate continuation: (log-probability of the hypothesis with the token, the open hypothesis it extends,
# the token, the progress after it).
Candidate = tuple[float, int, int, Progress]


def allocate(candidates: Sequence[Candidate], beam: int) -> list[Candidate]:
    """Up to `beam` candidates, best first: banks (constraint tokens met) take turns, each giving its best
    remaining candidate, the bank with most tokens met first (as fairseq's vectorized version ranks
    them), so every bank that has candidates keeps some of the beam."""
    ranked = sorted(candidates, key=lambda c: -c[0])
    seen: dict[int, int] = {}
    order = []
    for c in ranked:
        bank = c[3][3]
        rank = seen.get(bank, 0)
        seen[bank] = rank + 1
        order.append((rank, -bank, c))
    order.sort(key=lambda t: (t[0], t[1]))
    return sorted((c for _, _, c in order[:beam]), key=lambda c: -c[0])
