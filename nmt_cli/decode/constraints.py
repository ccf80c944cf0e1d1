"""Lexical constraints in beam search: how far a hypothesis is through its sentence's target phrases, and
dynamic beam allocation (Post & Vilar, 2018): the beam is shared out among hypotheses that have met
different numbers of constraint tokens, so that those forced towards a phrase survive their lower scores.
Pure Python: it decides among a few dozen candidates per sentence and step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A hypothesis's progress: (bitmask of the phrases met, its last output tokens (as many as the longest phrase
# less one: enough to hold any partial match), constraint tokens met in all: its bank).
Progress = tuple[int, tuple[int, ...], int]
START: Progress = (0, (), 0)


def bank(progress: Progress) -> int:
    """Constraint tokens met: every token of the phrases met, and the longest partial match of an unmet one."""
    return progress[2]


@dataclass(frozen=True)
class Phrases:
    """One sentence's constraints: target phrases (token ids) that must each appear in its output."""

    phrases: tuple[tuple[int, ...], ...]

    @property
    def all_met(self) -> int:
        return (1 << len(self.phrases)) - 1

    def _partial(self, met: int, tail: tuple[int, ...]) -> list[tuple[int, int]]:
        """(phrase, tokens of it matched) for every unmet phrase whose first tokens end `tail`, however many
        (0 included): overlapping matches are all kept, as an Aho-Corasick automaton's states would be, so a
        failed match falls back to the longest one still alive ("a a a b" meets "a a b")."""
        return [(c, k) for c, phrase in enumerate(self.phrases) if not met >> c & 1
                for k in range(min(len(phrase) - 1, len(tail)), -1, -1) if tail[len(tail) - k :] == phrase[:k]]

    def advance(self, progress: Progress, token: int) -> Progress:
        """The progress after `token`: every unmet phrase that the output now ends with is met (several at once
        with "x" and "x y" after "x y"), and the bank counts the met phrases' tokens and the longest partial
        match of an unmet one."""
        met, tail, _ = progress
        keep = max(map(len, self.phrases)) - 1
        tail = (*tail, token)
        for c, phrase in enumerate(self.phrases):
            if not met >> c & 1 and tail[-len(phrase) :] == phrase:
                met |= 1 << c
        tail = tail[-keep:] if keep else ()
        matched = max((k for _, k in self._partial(met, tail)), default=0)
        return met, tail, sum(len(p) for c, p in enumerate(self.phrases) if met >> c & 1) + matched

    def wanted(self, progress: Progress) -> list[int]:
        """Tokens that make progress: the next token of each partial match, the first of each unmet phrase."""
        met, tail, _ = progress
        return list(dict.fromkeys(self.phrases[c][k] for c, k in self._partial(met, tail)))

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
        tokens_met = bank(c[3])
        rank = seen.get(tokens_met, 0)
        seen[tokens_met] = rank + 1
        order.append((rank, -tokens_met, c))
    order.sort(key=lambda t: (t[0], t[1]))
    return sorted((c for _, _, c in order[:beam]), key=lambda c: -c[0])
