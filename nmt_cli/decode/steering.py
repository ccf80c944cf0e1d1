"""What a search's choices must follow besides the model: forced target prefixes, no repeated n-grams, and
drawing a token from a (truncated, tempered) distribution for sampling."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt_cli.model.ops import topk_rows

from .sampling import Sampling


@dataclass(frozen=True)
class Steering:
    """Rules for a batch of sentences: `prefixes` (token ids per sentence, [] for none) that each output
    must start with, and no n-gram of `no_repeat_ngram` tokens twice in an output (fairseq's
    --no-repeat-ngram-size; 0: no rule)."""

    no_repeat_ngram: int = 0
    prefixes: Sequence[Sequence[int]] | None = None


class StepRules:
    """A `Steering` made into tensors for one search: `apply` edits a step's log-probabilities in place."""

    def __init__(self, steering: Steering | None, sentences: int, device: torch.device) -> None:
        self.ngram = steering.no_repeat_ngram if steering else 0
        self.prefix: Tensor | None = None
        self.prefix_len: Tensor | None = None
        prefixes = steering.prefixes if steering else None
        if prefixes and any(prefixes):
            if len(prefixes) != sentences:
                raise ValueError(f"{len(prefixes)} prefixes for {sentences} sentences")
            table = torch.zeros((sentences, max(map(len, prefixes))), dtype=torch.long)
            for i, ids in enumerate(prefixes):
                table[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            self.prefix = table.to(device)
            self.prefix_len = torch.tensor([len(p) for p in prefixes], dtype=torch.long, device=device)

    def __bool__(self) -> bool:
        return bool(self.ngram) or self.prefix is not None

    def lengthen(self, limits: Tensor) -> Tensor:
        """Per-sentence output limits raised to at least the prefix's length (a prefix is always whole)."""
        return limits if self.prefix_len is None else torch.maximum(limits, self.prefix_len)

    def apply(self, log_probs: Tensor, history: Tensor, sentence_of_row: Tensor, step: int) -> None:
        """Edit log_probs (N, V) in place for the rows' next token: -inf for a token that would repeat an
        n-gram of the row's output so far (history (N, step + 1): <s>, then the output), and every token but
        the prefix's at a step inside the row's sentence's prefix. A forced token keeps its log-probability and
        is exempt from the n-gram rule: a prefix that itself repeats an n-gram is still followed whole."""
        forced: tuple[Tensor, Tensor, Tensor] | None = None
        if self.prefix is not None and self.prefix_len is not None and step < self.prefix.shape[1]:
            forcing = self.prefix_len[sentence_of_row] > step
            if bool(forcing.any()):
                rows = forcing.nonzero().squeeze(1)
                token = self.prefix[sentence_of_row[rows], step]
                forced = rows, token, log_probs[rows, token]  # read before the n-gram rule can ban the token
        if self.ngram:
            ban_repeated_ngrams(log_probs, history[:, 1:], self.ngram)
        if forced is not None:
            rows, token, kept = forced
            log_probs[rows] = -math.inf
            log_probs[rows, token] = kept


def ban_repeated_ngrams(log_probs: Tensor, output: Tensor, n: int) -> None:
    """Set log_probs[r, w] = -inf for each token w that would complete, after row r's `output` (N, L), an
    n-gram the row already holds: its last n - 1 tokens followed by w appear earlier."""
    length = output.shape[1]
    if length < n:
        return
    if n == 1:
        log_probs.scatter_(1, output, -math.inf)
        return
    last = output[:, length - n + 1 :]  # (N, n-1)
    windows = output.unfold(1, n - 1, 1)[:, : length - n + 1]  # (N, L-n+1, n-1): each window with a follower
    rows, starts = (windows == last[:, None, :]).all(-1).nonzero(as_tuple=True)
    if rows.numel():
        log_probs[rows, output[rows, starts + n - 1]] = -math.inf


def draw(log_probs: Tensor, uniforms: Tensor, sampling: Sampling) -> Tensor:
    """One token per row of log_probs (N, V), by the inverse of the (truncated, tempered) distribution's
    cumulative sum at uniforms (N,) in [0, 1): a draw that depends only on the row's own uniform number, so
    a sentence samples alike in any batch. Rows may hold -inf (banned tokens), never all of them."""
    scaled = log_probs / sampling.temperature
    columns: Tensor | None = None  # the columns of `values`, where they are not the vocabulary's own order
    if sampling.topk:
        values, columns = topk_rows(scaled, min(sampling.topk, scaled.shape[1]))  # largest first
    elif sampling.topp < 1:
        values, columns = scaled.sort(dim=-1, descending=True, stable=True)
    else:  # the whole distribution: any fixed order draws alike, so no sort
        values = scaled
    probs = torch.softmax(values, dim=-1)
    if sampling.topp < 1:
        # The smallest prefix (most probable first) whose mass reaches topp: a token is kept if the mass
        # before it is still below topp.
        probs = probs * ((probs.cumsum(-1) - probs) < sampling.topp)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # The first column whose cumulative mass exceeds u * total. Kept below the total (a float64 uniform near 1
    # rounds to 1.0 in float32), so a column with mass is always found: one whose mass is zero (a banned token,
    # a padding row, one cut by top-k or top-p) can never come out, whatever the uniform.
    target = torch.minimum(uniforms.to(cdf.dtype).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target, right=True)
    return (pick if columns is None else columns.gather(1, pick)).squeeze(1)
