"""What every translation engine shares: raw text -> pieces (Moses + BPE, or SentencePiece) -> ids, batching,
the option rules, and ids -> raw text. Imports no torch, so an exported CTranslate2 model starts fast."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from nmt_cli.errors import NmtError
from nmt_cli.text.segment import Segmenter
from nmt_cli.text.vocab import Vocabulary

from .lengths import max_output_tokens
from .sampling import Sampling

PAPER_DECODING = {"beam": 4, "lenpen": 0.6}  # section 6.1: beam 4, length penalty alpha 0.6


def stored_decoding(state: dict, path: str | Path = "") -> dict:
    """The decoding settings a model file carries ({"beam": B, "lenpen": A, "chosen": how}, chosen for it, such
    as on val by a recipe), or {} when it carries none; one-line NmtError for settings that are not valid."""
    decoding = state.get("decoding") or {}
    if not isinstance(decoding, dict):
        raise NmtError(f"{path}: its decoding settings are not valid ({decoding!r})")
    beam, lenpen = decoding.get("beam", 4), decoding.get("lenpen", 0.6)
    if not (isinstance(beam, int) and beam >= 1) or not (isinstance(lenpen, (int, float)) and 0 <= lenpen <= 100):
        raise NmtError(f"{path}: its decoding settings are not valid ({decoding!r})")
    return {k: decoding[k] for k in ("beam", "lenpen", "chosen") if k in decoding}


# One hypothesis of the search: output ids (no </s>) and its score.
Hyp = tuple[list[int], float]


class TextTranslator:
    """Pre- and post-processing around a search engine; subclasses implement `search`."""

    constraints_refusal: str | None = None  # why the engine cannot search with constraints, if it cannot

    def __init__(self, vocab: Vocabulary, segmenter: Segmenter, source_lang: str, target_lang: str,
                 max_positions: int, workers: int = 1, target_vocab: Vocabulary | None = None) -> None:
        if workers < 1:
            raise NmtError(f"--workers must be at least 1 (got {workers})")
        self.vocab, self.source_lang, self.target_lang = vocab, source_lang, target_lang
        self.target_vocab = target_vocab or vocab  # the output's, where it is not the source's
        self.workers = workers  # batches searched at once, each on its own thread and share of the cores
        self.segmenter = segmenter  # as at prepare time
        self.target_segmenter = segmenter.target_side()
        self.target_token = ""  # prepended to every source line (a multi-target model's ">>fra<<"), if any
        self.max_positions = max_positions
        # Lines translated truncated: the caller reads (and clears) them after each call, so they never pile up.
        self.warnings: list[str] = []
        self.truncated: list[tuple[int, int]] = []  # (line, source tokens) of the same lines
        self.unmet: list[int] = []  # lines whose constraints were not all met (also in `warnings`)
        self.generated_tokens = 0  # output tokens (</s> included) of the best hypotheses so far
        self.decoding: dict = {}  # the model's own decoding settings (`stored_decoding`), if any

    def search(self, sources: list[list[int]], beam: int, lenpen: float, max_len_a: float, max_len_b: int,
               greedy: bool, nbest: int, sampling: Sampling | None = None, no_repeat_ngram: int = 0,
               prefixes: list[list[int]] | None = None, constraints: list[list[list[int]]] | None = None,
               unmet: list[int] | None = None) -> list[list[Hyp]]:
        """Up to `nbest` hypotheses, best first, for each source (ids without </s>), all in one batch; with
        `sampling`, `nbest` samples each in the order drawn. `prefixes` and `constraints` (target ids per
        source) as `translate_nbest` takes them as text; rows whose constraints were not all met are appended
        to `unmet`."""
        raise NotImplementedError

    def steering_ids(self, sources: list[list[int]], prefixes: Sequence[str] | None,
                     constraints: Sequence[Sequence[str]] | None, max_len_a: float, max_len_b: int,
                     first_line: int = 1, where: tuple[str, str] = ("prefix", "constraints"),
                     ) -> tuple[list[list[int]] | None, list[list[list[int]]] | None]:
        """Target ids of each line's prefix and constraint phrases, tokenized as the model's target side;
        one-line NmtError "WHERE:LINE: ..." for one that cannot be honoured. An empty input line ignores
        its own."""
        n = len(sources)
        for name, items in zip(where, (prefixes, constraints)):
            if items is not None and len(items) != n:
                raise NmtError(f"{name}: {len(items)} lines for {n} input lines; give one per input line (an "
                               "empty one for none)")
        prefix_ids = None
        if prefixes is not None:
            prefix_ids = []
            for line, (text, source) in enumerate(zip(prefixes, sources), start=first_line):
                ids = self.target_ids(text) if text.strip() and source else []
                if len(ids) > self.max_positions - 2:
                    raise NmtError(f"{where[0]}:{line}: the prefix has {len(ids)} tokens, more than the model's "
                                   f"{self.max_positions - 2}")
                prefix_ids.append(ids)
        constraint_ids = None
        if constraints is not None:
            constraint_ids = []
            for line, (phrases, source) in enumerate(zip(constraints, sources), start=first_line):
                limit = self.max_output_tokens(len(source), max_len_a, max_len_b)
                line_ids = []
                for j, phrase in enumerate(phrases, start=1):
                    if not phrase.strip():
                        raise NmtError(f"{where[1]}:{line}: constraint {j} is empty")
                    ids = self.target_ids(phrase)
                    if len(ids) > limit:
                        raise NmtError(f"{where[1]}:{line}: constraint {j} has {len(ids)} tokens, more than the "
                                       f"line's length limit of {limit} (--max-len-a, --max-len-b)")
                    line_ids.append(ids)
                constraint_ids.append(line_ids if source else [])
        return prefix_ids, constraint_ids

    def encode(self, sentences: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Token ids of raw sentences (no </s>); too-long ones are truncated with a warning naming the line."""
        limit = self.max_positions - 2
        out = []
        for n, sentence in enumerate(sentences, start=first_line):
            if not sentence.strip():
                out.append([])
                continue
            if self.target_token:
                sentence = f"{self.target_token} {sentence}"
            ids = self.vocab.encode(self.segmenter.segment(sentence, self.source_lang))
            if len(ids) > limit:
                self.warnings.append(f"line {n}: {len(ids)} tokens exceed the model's {limit}; translated truncated")
                self.truncated.append((n, len(ids)))
                ids = ids[:limit]
            out.append(ids)
        return out

    def target_ids(self, text: str) -> list[int]:
        """Token ids of raw target-side text (a prefix, a constraint, a reference), no </s>."""
        return self.target_vocab.encode(self.target_segmenter.segment(text, self.target_lang))

    def decode(self, ids: Sequence[int]) -> str:
        """Raw (detokenized) text of output ids."""
        return self.segmenter.desegment(self.target_vocab.decode(ids), self.target_lang)

    def max_output_tokens(self, source_len: int, max_len_a: float, max_len_b: int) -> int:
        """The most output tokens before </s> for a source of `source_len` tokens (no </s>): `lengths`' formula,
        which the search uses too."""
        return max_output_tokens(source_len, max_len_a, max_len_b, self.max_positions)

    def batches(self, lengths: list[int], batch_size: int, max_tokens: int | None) -> list[list[int]]:
        """Indices grouped into batches, longest sentences first; by count, or by padded tokens with max_tokens."""
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        current: list[int] = []
        for i in order:
            longest = lengths[current[0] if current else i] + 1  # longest first: a batch's first is its longest
            too_many = max_tokens is not None and longest * (len(current) + 1) > max_tokens
            if current and (too_many or (max_tokens is None and len(current) >= batch_size)):
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        return batches

    @staticmethod
    def check_options(beam: int, lenpen: float, max_len_a: float, max_len_b: int, batch_size: int,
                      max_tokens: int | None, greedy: bool, nbest: int, sampling: Sampling | None = None,
                      no_repeat_ngram: int = 0, constraints: bool = False) -> None:
        """Refuse option combinations the search cannot honour, with one line naming the flag."""
        if sampling is not None:
            sampling.check()
            if greedy:
                raise NmtError("--sampling draws each token, --greedy takes the most probable: choose one")
            beam = max(beam, nbest)  # samples are not limited by a beam
        if constraints and (greedy or sampling is not None):
            raise NmtError("--constraints needs beam search: drop --greedy and --sampling")
        if not 0 <= no_repeat_ngram <= 1000:
            raise NmtError(f"--no-repeat-ngram must be 0 (off) or more (got {no_repeat_ngram})")
        for flag, number in (("--lenpen", lenpen), ("--max-len-a", max_len_a), ("--max-len-b", max_len_b)):
            if not math.isfinite(number):
                raise NmtError(f"{flag} must be a finite number (got {number})")
        for flag, value in (("--beam", beam), ("--nbest", nbest), ("--batch-size", batch_size)):
            if value < 1:
                raise NmtError(f"{flag} must be at least 1 (got {value})")
        if max_tokens is not None and max_tokens < 1:
            raise NmtError(f"--max-tokens must be at least 1 (got {max_tokens})")
        if nbest > beam:
            raise NmtError(f"--nbest {nbest} is larger than --beam {beam}: the search keeps only {beam} hypotheses")
        if greedy and nbest > 1:
            raise NmtError("--nbest needs beam search; greedy search finds one hypothesis (drop --greedy)")
        if lenpen < 0:
            raise NmtError(f"--lenpen must be 0 or more (got {lenpen}): a negative one favours ever longer output "
                           "and the search could not stop early")
        if max_len_a < 0 or max_len_b < 0:
            raise NmtError("--max-len-a and --max-len-b must be 0 or more")
        if max_len_a > 100 or max_len_b > 100_000:
            # the model's positions cap every output anyway; beyond these the limits only overflow integers
            raise NmtError(f"--max-len-a must be at most 100 and --max-len-b at most 100000 (got {max_len_a:g} and "
                           f"{max_len_b:g})")

    def search_settings(self, beam: int | None = None, lenpen: float | None = None) -> tuple[int, float]:
        """The beam and length penalty to search with: those given, else the model's own (chosen for it, such as
        on val by a recipe), else the paper's (beam 4, length penalty 0.6)."""
        settings = {**PAPER_DECODING, **self.decoding}
        return (settings["beam"] if beam is None else beam), (settings["lenpen"] if lenpen is None else lenpen)

    def describe(self) -> dict:
        """What a person trying the model wants to know about it: its languages, its size where known
        ("parameters", "layers", "d_model"), and the decoding settings it searches with by default."""
        beam, lenpen = self.search_settings()
        return {"source_lang": self.source_lang, "target_lang": self.target_lang, "parameters": None,
                "layers": None, "d_model": None, "beam": beam, "lenpen": lenpen,
                "chosen": self.decoding.get("chosen")}

    def settings_note(self, beam: int | None, lenpen: float | None) -> str | None:
        """A line saying which search settings came from the model file (those not given), or None."""
        taken = [f"{name} {self.decoding[key]:g}" for key, name, given in
                 (("beam", "beam", beam), ("lenpen", "length penalty", lenpen))
                 if given is None and key in self.decoding]
        if not taken:
            return None
        how = f" ({self.decoding['chosen']})" if self.decoding.get("chosen") else ""
        return f"{' and '.join(taken)} from the model file{how}; --beam and --lenpen override"

    def translate_nbest(self, sentences: Sequence[str], beam: int | None = None, lenpen: float | None = None,
                        max_len_a: float = 1.0, max_len_b: int = 50, batch_size: int = 64,
                        max_tokens: int | None = None, greedy: bool = False, nbest: int = 1, first_line: int = 1,
                        on_batch: Callable[[int], None] | None = None, ids_out: list | None = None,
                        sampling: Sampling | None = None, no_repeat_ngram: int = 0,
                        prefixes: Sequence[str] | None = None, constraints: Sequence[Sequence[str]] | None = None,
                        where: tuple[str, str] = ("prefix", "constraints")) -> list[list[tuple[str, float]]]:
        """Exactly `nbest` (translation, score) pairs per sentence, best first; empty input gives ("", 0.0)s.
        With `ids_out` (a list), it is filled with (source ids, best output ids) per sentence, in input order.
        `beam` and `lenpen` default to the model's own settings (`search_settings`).

        `sampling`: draw `nbest` outputs per sentence instead (in the order drawn; no beam). `no_repeat_ngram`
        N: no N-gram twice in an output. `prefixes`: per sentence, raw target text its output must start with
        ("" for none). `constraints`: per sentence, raw target phrases that must each appear in its output
        (beam search only); a line where they cannot all be met within its length limit gets the best
        hypothesis found and a warning. `where` names the prefixes and constraints in error messages."""
        if constraints is not None and self.constraints_refusal:
            raise NmtError(self.constraints_refusal)
        if sampling is not None and beam is not None:
            raise NmtError("--sampling draws without a beam: drop --beam (--nbest sets the samples per line)")
        beam, lenpen = self.search_settings(beam, lenpen)
        self.check_options(beam, lenpen, max_len_a, max_len_b, batch_size, max_tokens, greedy, nbest, sampling,
                           no_repeat_ngram, constraints is not None)
        ids = self.encode(sentences, first_line)
        prefix_ids, constraint_ids = self.steering_ids(ids, prefixes, constraints, max_len_a, max_len_b, first_line,
                                                       where)
        results: list[list[tuple[str, float]]] = [[("", 0.0)] * nbest for _ in sentences]
        if ids_out is not None:
            ids_out[:] = [(x, []) for x in ids]
        todo = [i for i, x in enumerate(ids) if x]
        jobs = [[todo[j] for j in batch] for batch in self.batches([len(ids[i]) for i in todo], batch_size, max_tokens)]

        def search(rows: list[int]) -> tuple[list[list[Hyp]], list[int]]:
            unmet: list[int] = []
            hyps = self.search([ids[i] for i in rows], beam, lenpen, max_len_a, max_len_b, greedy, nbest, sampling,
                               no_repeat_ngram, [prefix_ids[i] for i in rows] if prefix_ids else None,
                               [constraint_ids[i] for i in rows] if constraint_ids else None, unmet)
            return hyps, [rows[r] for r in unmet]

        for rows, (hyps, unmet) in self.map_batches(search, jobs):
            for i in sorted(unmet):
                self.warnings.append(f"line {first_line + i}: its constraints could not all be met within the "
                                     "length limit; translated with the best hypothesis found")
                self.unmet.append(first_line + i)
            for i, sentence_hyps in zip(rows, hyps):
                results[i] = [(self.decode(tokens), score) for tokens, score in sentence_hyps]
                # Exactly `nbest` per input: a search that ran out of distinct hypotheses repeats its last one.
                results[i] += results[i][-1:] * (nbest - len(results[i]))
                if ids_out is not None:
                    ids_out[i] = (ids[i], sentence_hyps[0][0])
                self.generated_tokens += len(sentence_hyps[0][0]) + 1
            if on_batch:
                on_batch(len(rows))
        if on_batch:
            on_batch(len(sentences) - len(todo))
        return results

    def map_batches(self, search: Callable[[list[int]], Any],
                    jobs: list[list[int]]) -> Iterator[tuple[list[int], Any]]:
        """(job, search(job)) for each batch job, in the order they finish: `workers` at a time, each on its own
        thread (`start_worker` prepares the thread), the longest batches first."""
        if self.workers == 1 or len(jobs) == 1:
            for job in jobs:
                yield job, search(job)
            return
        with ThreadPoolExecutor(self.workers, initializer=self.start_worker) as pool:
            futures = {pool.submit(search, job): job for job in jobs}
            try:
                for future in as_completed(futures):
                    yield futures[future], future.result()
            finally:
                for future in futures:
                    future.cancel()

    def cache_bytes(self) -> int:
        """Bytes of decoder cache kept between searches (0 where the engine keeps none of its own)."""
        return 0

    def limit_cache(self, max_bytes: int) -> None:
        """Keep at most `max_bytes` of decoder cache between searches (engines without a cache ignore it)."""

    def start_worker(self) -> None:
        """Run on each search thread of `map_batches` before its first batch."""

    def serving(self) -> AbstractContextManager:
        """What a server's batches run under, on its translator thread (`ops.serving_products` for nmt's
        engine: memory that stays level over the many shapes requests bring)."""
        return nullcontext()

    def translate(self, sentences: Sequence[str], **options) -> list[str]:
        """The best translation of each sentence, in input order (see `translate_nbest` for options)."""
        options.pop("nbest", None)
        return [r[0][0] for r in self.translate_nbest(sentences, nbest=1, **options)]


def default_workers(device: str, threads: int) -> int:
    """Batches to search at once when the user did not say: two on a CPU with at least two threads (one
    search's Python and small operations leave a core idle that the other's products use: beam 4 at batch 64
    on 2 cores 25-38% faster with nmt, 17-31% with CTranslate2), one on a GPU."""
    return 2 if device == "cpu" and threads >= 2 else 1
