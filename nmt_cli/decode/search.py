"""Greedy and beam search over an ensemble of Transformers, with incremental (KV-cached) decoding."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt_cli.model.ops import linear_log_softmax, topk_rows
from nmt_cli.model.transformer import CachePool, DecoderState, Transformer

from .constraints import START, Candidate, Phrases, allocate
from .lengths import max_output_tokens
from .sampling import Sampling
from .steering import Steering, StepRules, draw


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al., 2016, eq. 14)."""
    return ((5 + length) / 6.0) ** alpha


@dataclass
class Hypothesis:
    """A finished translation: token ids (without </s>) and its length-normalized log-probability."""

    tokens: list[int]
    score: float
    complete: bool = True  # False: its sentence's constraints could not all be met within the length limit


class EnsembleModel:
    """N models behind one decoder interface; their log-probabilities are averaged (in probability space)."""

    def __init__(self, models: Sequence[Transformer], searches: int = 1) -> None:
        self.models = list(models)
        first = self.models[0].config
        self.pad, self.vocab_size = first.pad, first.target_vocab
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

    def log_probs(self, tokens: Tensor, states: list[DecoderState], bos: int) -> Tensor:
        """Log-probabilities of every next token after tokens (N,), (N, V) float32; <pad> and <s> are -inf."""
        pad = self.pad
        if len(self.models) == 1:
            model = self.models[0]
            hidden = model.decode_step(tokens, states[0])  # (N, d)
            return linear_log_softmax(hidden, model.output_matrix, exclude=(pad, bos), packed=model.packed_output,
                                      vocab=model.config.target_vocab, bias=model.logit_bias)
        lprobs = [torch.log_softmax(m.logits(m.decode_step(tokens, s)).float(), dim=-1)
                  for m, s in zip(self.models, states)]
        scores = torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))
        scores[:, pad] = -math.inf
        scores[:, bos] = -math.inf
        return scores

    def step(self, tokens: Tensor, states: list[DecoderState], k: int, at_limit: Tensor, bos: int,
             eos: int, adjust: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The k most probable next tokens of each row and their log-probabilities, (N, k) each, float32, and
        all log-probabilities (N, V) after `adjust` (which edits them in place: `StepRules.apply`).

        tokens (N,) are the rows' last tokens. <pad> and <s> are never proposed; rows where `at_limit`
        (N,) is true may only end: </s> at the model's own probability, then -inf candidates.
        """
        limited = at_limit.nonzero().squeeze(1) if bool(at_limit.any()) else None
        scores = self.log_probs(tokens, states, bos)
        if adjust is not None:
            adjust(scores)
        top, index = topk_rows(scores, k)
        if limited is not None:
            top[limited] = -math.inf
            top[limited, 0] = scores[limited, eos]
            index[limited, 0] = eos
        return top, index, scores

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
    """Per sentence, the most output tokens before </s> (`lengths.max_output_tokens`), as a tensor."""
    src_len = ((src != pad) & (src != eos)).sum(1).tolist()  # once per search
    return torch.tensor([max_output_tokens(n, a, b, limit) for n in src_len], dtype=torch.long, device=src.device)


@torch.inference_mode()
def greedy_search(ensemble: EnsembleModel, src: Tensor, bos: int, eos: int, max_len_a: float = 1.0,
                  max_len_b: int = 50, steering: Steering | None = None) -> list[Hypothesis]:
    """Most likely token at each step; finished sentences leave the batch. src (B, S) -> one hypothesis each.

    A greedy hypothesis's score is its plain log-probability (no length penalty). `steering`: forced
    prefixes and no repeated n-grams.
    """
    bsz = src.shape[0]
    rules = StepRules(steering, bsz, src.device)
    limits = rules.lengthen(max_lengths(src, ensemble.pad, eos, max_len_a, max_len_b, ensemble.max_positions))
    states = ensemble.start(src, 1, int(limits.max()) + 1)
    active = torch.arange(bsz, device=src.device)  # original index of each row
    tokens = torch.full((bsz,), bos, dtype=torch.long, device=src.device)
    history = tokens[:, None]  # (N, t + 1): kept only for the rules
    outputs: list[list[int]] = [[] for _ in range(bsz)]
    scores = [0.0] * bsz
    try:
        for step in range(int(limits.max()) + 1):
            adjust = (lambda lp: rules.apply(lp, history, active, step)) if rules else None  # noqa: B023
            best_lp, best, _ = ensemble.step(tokens, states, 1, limits[active] <= step, bos, eos, adjust)
            best_lp, tokens = best_lp[:, 0], best[:, 0]
            done = tokens == eos
            for i, tok, lp in zip(active.tolist(), tokens.tolist(), best_lp.tolist()):
                scores[i] += lp
                if tok != eos:
                    outputs[i].append(tok)
            if done.all():
                break
            if rules:
                history = torch.cat([history, tokens[:, None]], dim=1)
            if done.any():
                keep = staying_order(done.tolist(), src.device)
                ensemble.reorder(states, keep, keep)
                active, tokens, history = active[keep], tokens[keep], history[keep]
    finally:
        ensemble.release(states)
    return [Hypothesis(out, s) for out, s in zip(outputs, scores)]


@torch.inference_mode()
def sample_search(ensemble: EnsembleModel, src: Tensor, bos: int, eos: int, sampling: Sampling, samples: int = 1,
                  seeds: Sequence[int] | None = None, max_len_a: float = 1.0, max_len_b: int = 50,
                  steering: Steering | None = None) -> list[list[Hypothesis]]:
    """`samples` outputs per sentence of src (B, S), each token drawn from the model's distribution as
    `sampling` shapes it, in the order drawn. A sample's score is its plain log-probability under the model.

    Sentence i's draws come from its own generator, seeded with `seeds[i]`, so it samples alike alone or in
    any batch. Its rows that ended wait (their further steps unused) until all of the sentence's have.
    """
    bsz, device = src.shape[0], src.device
    rules = StepRules(steering, bsz, device)
    limits = rules.lengthen(max_lengths(src, ensemble.pad, eos, max_len_a, max_len_b, ensemble.max_positions))
    steps = int(limits.max()) + 1
    seeds = list(seeds) if seeds is not None else [sampling.seed] * bsz
    # Step by step (not sample by sample), so that the numbers of a step do not depend on the batch's longest limit.
    uniforms = torch.stack([torch.rand((steps, samples), dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(seed)).t() for seed in seeds])
    uniforms = uniforms.view(bsz * samples, steps).to(device)
    states = ensemble.start(src, samples, steps)
    row_id = torch.arange(bsz * samples, device=device)  # each row's original index: sentence * samples + s
    active = torch.arange(bsz, device=device)
    history = torch.full((bsz * samples, 1), bos, dtype=torch.long, device=device)
    ended = torch.zeros(bsz * samples, dtype=torch.bool, device=device)
    totals = torch.zeros(bsz * samples, dtype=torch.float64, device=device)
    out: list[list[Hypothesis]] = [[Hypothesis([], 0.0)] * samples for _ in range(bsz)]

    def collect(rows: Tensor) -> None:
        for r, tokens, total in zip(row_id[rows].tolist(), history[rows, 1:].tolist(), totals[rows].tolist()):
            out[r // samples][r % samples] = Hypothesis(tokens[: tokens.index(eos)] if eos in tokens else tokens,
                                                        total)

    try:
        for step in range(steps):
            sentence_of_row = active.repeat_interleave(samples)
            log_probs = ensemble.log_probs(history[:, -1], states, bos)
            if rules:
                rules.apply(log_probs, history, sentence_of_row, step)
            at_limit = limits[sentence_of_row] <= step
            if bool(at_limit.any()):
                eos_scores = log_probs[at_limit, eos]
                log_probs[at_limit] = -math.inf
                log_probs[at_limit, eos] = eos_scores
            tokens = draw(log_probs, uniforms[row_id, step], sampling)
            tokens = torch.where(ended, eos, tokens)
            totals += torch.where(ended, 0.0, log_probs.gather(1, tokens[:, None]).squeeze(1).double())
            history = torch.cat([history, tokens[:, None]], dim=1)
            ended |= tokens == eos
            done = ended.view(-1, samples).all(1)
            if bool(done.all()):
                collect(torch.arange(row_id.shape[0], device=device))
                break
            if bool(done.any()):
                leaving = done.repeat_interleave(samples).nonzero().squeeze(1)
                collect(leaving)
                keep = staying_order(done.tolist(), device)
                rows = ((keep * samples).unsqueeze(1) + torch.arange(samples, device=device)).view(-1)
                ensemble.reorder(states, rows, keep)
                active, row_id, history, ended, totals = (active[keep], row_id[rows], history[rows], ended[rows],
                                                          totals[rows])
        else:
            collect(torch.arange(row_id.shape[0], device=device))
    finally:
        ensemble.release(states)
    return out


@torch.inference_mode()
def beam_search(ensemble: EnsembleModel, src: Tensor, bos: int, eos: int, beam: int = 4, lenpen: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1, exhaustive: bool = False,
                steering: Steering | None = None,
                constraints: Sequence[Sequence[Sequence[int]]] | None = None) -> list[list[Hypothesis]]:
    """Batched beam search; src (B, S) -> the `nbest` best finished hypotheses per sentence, best first.

    A hypothesis's score is its log-probability divided by the GNMT length penalty of its length
    (</s> included). A sentence stops once it holds `beam` finished hypotheses (the rule of fairseq and
    CTranslate2), or sooner when no open hypothesis can still beat its `nbest`-th finished one, which
    changes nothing in the result: an open hypothesis with log-probability s can at best reach
    s / lp(max length), since s only falls. `exhaustive` searches until only that bound stops it.

    `steering`: forced prefixes and no repeated n-grams. `constraints`: per sentence, target phrases (token
    ids) that must each appear in its output; a sentence with some keeps its beam by dynamic beam allocation
    (`constraints.allocate`) and may only end once all are met. If none of its hypotheses meets them all
    within the length limit, it gets its best ones with `complete` False. Sentences without constraints
    search exactly as they would without the argument.
    """
    nbest = min(nbest, beam)
    bsz, device = src.shape[0], src.device
    rules = StepRules(steering, bsz, device)
    limits = rules.lengthen(max_lengths(src, ensemble.pad, eos, max_len_a, max_len_b, ensemble.max_positions))
    phrases = {i: Phrases(tuple(tuple(p) for p in c)) for i, c in enumerate(constraints or []) if c}
    progress = {i: [START] for i in phrases}  # a constrained sentence's open hypotheses' progress, by slot
    unmet: dict[int, list[Hypothesis]] = {i: [] for i in phrases}  # ended at the limit with phrases unmet
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
            adjust = ((lambda lp: rules.apply(lp, history, active.repeat_interleave(width), step))  # noqa: B023
                      if rules else None)
            lprobs, proposals, full = ensemble.step(history[:, -1], states, k, at_limit, bos, eos, adjust)
            candidates = (scores.unsqueeze(-1) + lprobs.view(n_active, width, k)).view(n_active, width * k)
            top_scores, top_index = candidates.topk(min(2 * beam, width * k), dim=1)  # (B', 2*beam)
            top_beam, top_token = top_index // k, proposals.view(n_active, width * k).gather(1, top_index)
            is_eos = (top_token == eos) & torch.isfinite(top_scores)
            # Finished hypotheses: </s> candidates among the `beam` best (fairseq's rule; the other `beam` are only
            # there to refill the open beam), so that beam 1 is exactly greedy search.
            is_eos[:, beam:] = False
            constrained = [b for b, i in enumerate(active.tolist()) if i in phrases] if phrases else []
            if constrained:
                is_eos[constrained] = False

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
            if constrained:
                _constrained_step(constrained, active.tolist(), width, beam, scores, lprobs, proposals, full,
                                  history, (limits[active] <= step).tolist(), eos, penalty, phrases, progress,
                                  finished, unmet, (open_scores, open_beam, open_token))

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
    for i, hyps in enumerate(finished):
        if not hyps and unmet.get(i):
            hyps = [Hypothesis(h.tokens, h.score, complete=False) for h in unmet[i]]
        hyps.sort(key=lambda h: -h.score)
        out.append(hyps[:nbest])
    return out


def _constrained_step(positions: list[int], sentences: list[int], width: int, beam: int, scores: Tensor,
                      lprobs: Tensor, proposals: Tensor, full: Tensor, history: Tensor, at_limit: list[bool],
                      eos: int, penalty: float, phrases: dict[int, Phrases], progress: dict[int, list],
                      finished: list[list[Hypothesis]], unmet: dict[int, list[Hypothesis]],
                      opened: tuple[Tensor, Tensor, Tensor]) -> None:
    """Beam search's step for the constrained sentences at `positions` of the active ones: their candidates
    are each open hypothesis's k proposals plus the tokens that advance its constraints (`Phrases.wanted`);
    an </s> ends a hypothesis only with every phrase met (then it competes with the other complete
    candidates, among which it must rank in the `beam` best, fairseq's rule), or at the length limit, where
    it is kept aside in `unmet`. The open beam is allocated across banks (`allocate`) and written into the
    rows of `opened` (scores, slots, tokens)."""
    k = proposals.shape[1]
    open_scores, open_beam, open_token = opened
    rows = torch.tensor(positions, device=scores.device)
    slot_scores = scores[rows].tolist()  # (P, width)
    proposed_lp = lprobs.view(-1, width, k)[rows].tolist()
    proposed = proposals.view(-1, width, k)[rows].tolist()
    # The log-probabilities of the wanted tokens, read in one gather.
    wanted: list[tuple[int, int, int, int]] = []  # (position index, slot, token, row)
    for p, b in enumerate(positions):
        sentence = sentences[b]
        if at_limit[b]:
            continue
        for slot, state in enumerate(progress[sentence][:width]):
            for token in phrases[sentence].wanted(state):
                wanted.append((p, slot, token, b * width + slot))
    wanted_lp = full[[w[3] for w in wanted], [w[2] for w in wanted]].tolist() if wanted else []
    extra: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for (p, slot, token, _), lp in zip(wanted, wanted_lp):
        extra.setdefault((p, slot), []).append((lp, token))

    new_scores, new_beam, new_token = [], [], []
    for p, b in enumerate(positions):
        sentence, rule = sentences[b], phrases[sentences[b]]
        all_met = rule.all_met
        candidates: list[Candidate] = []
        endings: list[Candidate] = []
        for slot in range(width):
            base = slot_scores[p][slot]
            if not math.isfinite(base):
                continue
            state = progress[sentence][slot]
            seen = set()
            for lp, token in [*zip(proposed_lp[p][slot], proposed[p][slot]), *extra.get((p, slot), [])]:
                if token in seen or lp == -math.inf:
                    continue
                seen.add(token)
                if token == eos:
                    endings.append((base + lp, slot, eos, state))
                else:
                    candidates.append((base + lp, slot, token, rule.advance(state, token)))
        # Complete hypotheses that end compete with those that go on: an ending among the `beam` best of them
        # is finished.
        complete = sorted([c[0] for c in candidates if c[3][0] == all_met]
                          + [c[0] for c in endings if c[3][0] == all_met], reverse=True)
        bar = complete[beam - 1] if len(complete) >= beam else -math.inf
        for score, slot, _, state in endings:
            tokens = history[b * width + slot, 1:].tolist()
            if state[0] == all_met:
                if score >= bar:
                    finished[sentence].append(Hypothesis(tokens, score / penalty))
            elif at_limit[b]:
                unmet[sentence].append(Hypothesis(tokens, score / penalty, complete=False))
        chosen = allocate(candidates, beam)
        progress[sentence] = [c[3] for c in chosen] + [START] * (beam - len(chosen))
        new_scores.append([c[0] for c in chosen] + [-math.inf] * (beam - len(chosen)))
        new_beam.append([c[1] for c in chosen] + [0] * (beam - len(chosen)))
        new_token.append([c[2] for c in chosen] + [eos] * (beam - len(chosen)))
    open_scores[rows] = torch.tensor(new_scores, dtype=open_scores.dtype, device=open_scores.device)
    open_beam[rows] = torch.tensor(new_beam, dtype=open_beam.dtype, device=open_beam.device)
    open_token[rows] = torch.tensor(new_token, dtype=open_token.dtype, device=open_token.device)
