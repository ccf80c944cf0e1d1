"""Greedy and beam search over an ensemble of Transformers, with incremental (KV-cached) decoding."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .model import CachePool, DecoderState, Transformer
from .ops import linear_log_softmax_topk, topk_rows


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al., 2016, eq. 14)."""
    return ((5 + length) / 6.0) ** alpha


@dataclass
class Hypothesis:
    """A finished translation: token ids (without </s>) and its length-normalized log-probability."""

    tokens: list[int]
    score: float


class EnsembleModel:
    """N models behind one decoder interface; their log-probabilities are averaged (in probability space)."""

    def __init__(self, models: Sequence[Transformer], searches: int = 1) -> None:
        self.models = list(models)
        first = self.models[0].config
        self.pad, self.vocab_size = first.pad, first.vocab_size
        self.max_positions = min(m.config.max_positions for m in self.models)
        self.pool = CachePool(keep=len(self.models) * searches)  # each model's cache, per search at once

    def start(self, src: Tensor, beam: int, max_len: int) -> list[DecoderState]:
        """Encode src (B, S) with every model; decoding state for B x beam hypotheses (give it back with
        `release` when the search ends)."""
        states = []
        for model in self.models:
            memory, mask = model.encode(src)
            states.append(model.start_decoding(memory, mask, beam, max_len, self.pool))
        return states

    @staticmethod
    def release(states: list[DecoderState]) -> None:
        """Return the states' cache buffers to the pool for the next search."""
        for state in states:
            state.release()

    def step(self, tokens: Tensor, states: list[DecoderState], k: int, at_limit: Tensor, bos: int,
             eos: int) -> tuple[Tensor, Tensor]:
        """The k most probable next tokens of each row and their log-probabilities, (N, k) each, float32.

        tokens (N,) are the rows' last tokens. <pad> and <s> are never proposed; rows where `at_limit`
        (N,) is true may only end: </s> at the model's own probability, then -inf candidates.
        """
        pad = self.pad
        limited = at_limit.nonzero().squeeze(1) if bool(at_limit.any()) else None
        if len(self.models) == 1:
            model = self.models[0]
            hidden = model.decode_step(tokens, states[0])  # (N, d)
            top, index, scores = linear_log_softmax_topk(hidden, model.embed.weight, k, exclude=(pad, bos),
                                                         packed=model.packed_output)
        else:
            lprobs = [torch.log_softmax(m.logits(m.decode_step(tokens, s)).float(), dim=-1)
                      for m, s in zip(self.models, states)]
            scores = torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))
            scores[:, pad] = -math.inf
            scores[:, bos] = -math.inf
            top, index = topk_rows(scores, k)
        if limited is not None:
            top[limited] = -math.inf
            top[limited, 0] = scores[limited, eos]
            index[limited, 0] = eos
        return top, index

    @staticmethod
    def reorder(states: list[DecoderState], rows: Tensor, sentences: Tensor | None = None) -> None:
        for state in states:
            state.reorder(rows, sentences)


def staying_order(done: list[bool], device: torch.device) -> Tensor:
    """The sentences that stay after the `done` ones leave, in their new order: each leaving sentence's place
    goes to the last staying one beyond the new batch size, so the others keep their places (and their
    cached keys and values stay where they are; see `model.keep_rows`)."""
    n = len(done) - sum(done)
    holes = [i for i in range(n) if done[i]]
    movers = [i for i in range(n, len(done)) if not done[i]]
    order = list(range(n))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    return torch.tensor(order, dtype=torch.long, device=device)


def max_lengths(src: Tensor, pad: int, eos: int, a: float, b: int, limit: int) -> Tensor:
    """Per sentence, the most output tokens before </s>: a * source length + b, within the model's positions."""
    src_len = ((src != pad) & (src != eos)).sum(1)
    return (src_len.float() * a + b).floor().long().clamp(min=0, max=limit - 2)


@torch.inference_mode()
def greedy_search(ensemble: EnsembleModel, src: Tensor, bos: int, eos: int, max_len_a: float = 1.0,
                  max_len_b: int = 50) -> list[Hypothesis]:
    """Most likely token at each step; finished sentences leave the batch. src (B, S) -> one hypothesis each.

    A greedy hypothesis's score is its plain log-probability (no length penalty).
    """
    bsz = src.shape[0]
    limits = max_lengths(src, ensemble.pad, eos, max_len_a, max_len_b, ensemble.max_positions)
    states = ensemble.start(src, 1, int(limits.max()) + 1)
    active = torch.arange(bsz, device=src.device)  # original index of each row
    tokens = torch.full((bsz,), bos, dtype=torch.long, device=src.device)
    outputs: list[list[int]] = [[] for _ in range(bsz)]
    scores = [0.0] * bsz
    try:
        for step in range(int(limits.max()) + 1):
            best_lp, best = ensemble.step(tokens, states, 1, limits[active] <= step, bos, eos)  # (N, 1) each
            best_lp, tokens = best_lp[:, 0], best[:, 0]
            done = tokens == eos
            for i, tok, lp in zip(active.tolist(), tokens.tolist(), best_lp.tolist()):
                scores[i] += lp
                if tok != eos:
                    outputs[i].append(tok)
            if done.all():
                break
            if done.any():
                keep = staying_order(done.tolist(), src.device)
                ensemble.reorder(states, keep, keep)
                active, tokens = active[keep], tokens[keep]
    finally:
        ensemble.release(states)
    return [Hypothesis(out, s) for out, s in zip(outputs, scores)]


@torch.inference_mode()
def beam_search(ensemble: EnsembleModel, src: Tensor, bos: int, eos: int, beam: int = 4, lenpen: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1,
                exhaustive: bool = False) -> list[list[Hypothesis]]:
    """Batched beam search; src (B, S) -> the `nbest` best finished hypotheses per sentence, best first.

    A hypothesis's score is its log-probability divided by the GNMT length penalty of its length
    (</s> included). A sentence stops once it holds `beam` finished hypotheses (the rule of fairseq and
    CTranslate2), or sooner when no open hypothesis can still beat its `nbest`-th finished one, which
    changes nothing in the result: an open hypothesis with log-probability s can at best reach
    s / lp(max length), since s only falls. `exhaustive` searches until only that bound stops it.
    """
    nbest = min(nbest, beam)
    bsz, device = src.shape[0], src.device
    limits = max_lengths(src, ensemble.pad, eos, max_len_a, max_len_b, ensemble.max_positions)
    states = ensemble.start(src, beam, int(limits.max()) + 1)
    finished: list[list[Hypothesis]] = [[] for _ in range(bsz)]
    active = torch.arange(bsz, device=device)  # original index of each active sentence, (B',)
    # Each hypothesis proposes its k best continuations; the sentence keeps the 2 * beam best of those
    # (2 * beam, as in fairseq, so that `beam` remain open even if up to `beam` of them end in </s>).
    k = min(2 * beam, ensemble.vocab_size)
    # All of a sentence's hypotheses start identical, so the first step decodes one row per sentence (the
    # others would only repeat it); with a vocabulary too small to fill the beam from one row, all `beam`.
    width = 1 if k >= beam else beam  # open hypotheses per active sentence
    scores = torch.full((bsz, width), -math.inf, device=device)  # log-probability of each open hypothesis
    scores[:, 0] = 0.0  # one live start per sentence, so the first step does not pick duplicates
    history = torch.full((bsz * width, 1), bos, dtype=torch.long, device=device)  # (N, t)
    try:
        for step in range(int(limits.max()) + 1):
            n_active = active.shape[0]
            at_limit = (limits[active] <= step).repeat_interleave(width)
            lprobs, proposals = ensemble.step(history[:, -1], states, k, at_limit, bos, eos)  # (N, k) each
            candidates = (scores.unsqueeze(-1) + lprobs.view(n_active, width, k)).view(n_active, width * k)
            top_scores, top_index = candidates.topk(min(2 * beam, width * k), dim=1)  # (B', 2*beam)
            top_beam, top_token = top_index // k, proposals.view(n_active, width * k).gather(1, top_index)
            is_eos = (top_token == eos) & torch.isfinite(top_scores)
            # Finished hypotheses: </s> candidates among the `beam` best (fairseq's rule; the other `beam` are only
            # there to refill the open beam), so that beam 1 is exactly greedy search.
            is_eos[:, beam:] = False

            penalty = length_penalty(step + 1, lenpen)
            if is_eos.any():
                sentences, beams, totals = active.tolist(), top_beam.tolist(), top_scores.tolist()
                for b, j in is_eos.nonzero().tolist():
                    tokens = history[b * width + beams[b][j], 1:].tolist()
                    finished[sentences[b]].append(Hypothesis(tokens, totals[b][j] / penalty))

            # Open hypotheses: the `beam` best candidates that do not end in </s>.
            open_scores = top_scores.masked_fill(top_token == eos, -math.inf)
            open_scores, pick = open_scores.topk(beam, dim=1)  # (B', beam)
            open_beam, open_token = top_beam.gather(1, pick), top_token.gather(1, pick)

            # A sentence is done with `beam` finished hypotheses (unless exhaustive), or when no open
            # hypothesis can beat its nbest-th finished one.
            best_open = open_scores[:, 0]
            bounds = (best_open / length_penalty(limits[active].float() + 1, lenpen)).tolist()
            done = []
            for sentence, best, bound in zip(active.tolist(), best_open.tolist(), bounds):
                hyps = finished[sentence]
                enough = len(hyps) >= beam and not exhaustive
                if len(hyps) >= nbest:
                    hyps.sort(key=lambda h: -h.score)
                    del hyps[beam:]
                done.append(enough or not math.isfinite(best)
                            or (len(hyps) >= nbest and bound <= hyps[nbest - 1].score))
            if all(done):
                break
            keep = staying_order(done, device)  # (B'',)
            rows = ((keep * width).unsqueeze(1) + open_beam[keep]).view(-1)  # (B'' * beam,)
            history = torch.cat([history.index_select(0, rows), open_token[keep].view(-1, 1)], dim=1)
            scores = open_scores[keep]
            ensemble.reorder(states, rows, keep if len(keep) < n_active else None)
            active = active[keep]
            width = beam
    finally:
        ensemble.release(states)
    out = []
    for hyps in finished:
        hyps.sort(key=lambda h: -h.score)
        out.append(hyps[:nbest])
    return out
