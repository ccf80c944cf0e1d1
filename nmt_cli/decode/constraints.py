"""Lexical constraints in beam search: how far a hypothesis is through its sentence's target phrases, and
dynamic beam allocation (Post & Vilar, 2018): the beam is shared out among hypotheses that have met
different numbers of constraint tokens, so that those forced towards a phrase survive their lower scores.
Pure Python: it decides among a few dozen candidates per sentence and step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A hypothesis's progress: (bitmask of the phrases met, per phrase the tokens of it matched so far (the longest
# prefix of it that the output ends with; () at the start: none), constraint tokens met in all: its bank).
Progress = tuple[int, tuple[int, ...], int]
START: Progress = (0, (), 0)


def bank(progress: Progress) -> int:
    """Constraint tokens met: every token of the phrases met, and the longest partial match of an unmet one."""
    return progress[2]


def borders(phrase: Sequence[int]) -> tuple[int, ...]:
    """Knuth-Morris-Pratt's failure function: per prefix phrase[:i + 1], the length of its longest proper prefix
    that is also its suffix, where a match that fails after i + 1 tokens goes on from."""
    found = [0] * len(phrase)
    k = 0
    for i in range(1, len(phrase)):
        while k and phrase[i] != phrase[k]:
            k = found[k - 1]
        if phrase[i] == phrase[k]:
            k += 1
        found[i] = k
    return tuple(found)


@dataclass(frozen=True)
class Phrases:
    """One sentence's constraints: target phrases (token ids) that must each appear in its output. Each unmet
    phrase is matched as Knuth-Morris-Pratt matches it, so a failed partial match falls back to the longest one
    still alive ("a a a b" meets "a a b") and phrases that overlap are all met ("x" and "x y" by "x y")."""

    phrases: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fallbacks", tuple(borders(p) for p in self.phrases))
        object.__setattr__(self, "lengths", tuple(len(p) for p in self.phrases))
        object.__setattr__(self, "alphabet", frozenset(t for p in self.phrases for t in p))
        object.__setattr__(self, "firsts", {})  # met mask -> the first tokens of the phrases not met

    @property
    def all_met(self) -> int:
        return (1 << len(self.phrases)) - 1

    def advance(self, progress: Progress, token: int) -> Progress:
        """The progress after `token`: each unmet phrase's match moves on, falls back, or is complete."""
        met, matched, _ = progress
        if token not in self.alphabet:  # most tokens: every match starts over (the common case, kept cheap)
            if not matched:
                return progress
            return met, (), sum(n for c, n in enumerate(self.lengths) if met >> c & 1)
        after = []
        longest = 0
        for c, phrase in enumerate(self.phrases):
            if met >> c & 1:
                after.append(0)
                continue
            k = matched[c] if matched else 0
            while k and phrase[k] != token:
                k = self.fallbacks[c][k - 1]
            if phrase[k] == token:
                k += 1
            if k == self.lengths[c]:
                met |= 1 << c
                k = 0
            after.append(k)
            longest = max(longest, k)
        done = sum(n for c, n in enumerate(self.lengths) if met >> c & 1)
        return met, tuple(after), done + longest

    def wanted(self, progress: Progress) -> list[int]:
        """Tokens that make progress: the next token of each unmet phrase's match, and each one's first."""
        met, matched, _ = progress
        firsts = self.firsts.get(met)
        if firsts is None:
            firsts = list(dict.fromkeys(p[0] for c, p in enumerate(self.phrases) if not met >> c & 1))
            self.firsts[met] = firsts  # shared by the calls with this mask: callers only read it
        if not matched:
            return firsts
        tokens = [p[matched[c]] for c, p in enumerate(self.phrases) if matched[c] and not met >> c & 1]
        return list(dict.fromkeys(tokens + firsts))

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
