"""Raw text -> Moses tokens -> BPE -> ids -> search -> detokenized text; the `Translator` API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from . import DECODING_KERNEL_CACHE, size_kernel_cache, text
from .checkpoint import load_checkpoint, model_from_checkpoint
from .distributed import resolve_device
from .errors import NmtError
from .model import Transformer
from .search import EnsembleModel, Hypothesis, beam_search, greedy_search
from .vocab import Vocabulary

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Translator:
    """Translates raw sentences with one model or an ensemble.

    >>> t = Translator.from_checkpoint("model.pt")
    >>> t.translate(["A man is riding a bike."], beam=4)
    """

    def __init__(self, models: Sequence[Transformer], vocab: Vocabulary, bpe_codes: str, source_lang: str,
                 target_lang: str, device: torch.device, precision: str = "fp32", normalize: bool = False) -> None:
        if precision not in PRECISIONS:
            raise NmtError(f"unknown --precision {precision!r} (use fp32, bf16 or fp16)")
        if precision == "fp16" and device.type != "cuda":
            raise NmtError("--precision fp16 needs CUDA; on CPU use bf16 or fp32")
        size_kernel_cache(DECODING_KERNEL_CACHE)
        self.ensemble = EnsembleModel(models)
        self.vocab, self.source_lang, self.target_lang = vocab, source_lang, target_lang
        self.bpe = text.BpeApplier(bpe_codes)
        self.device, self.precision = device, precision
        self.normalize = normalize  # Moses punctuation normalization before tokenizing, as at prepare time
        self.warnings: list[str] = []
        self.generated_tokens = 0  # output tokens (</s> included) of the best hypotheses so far

    @classmethod
    def from_checkpoint(cls, paths: str | Path | Sequence[str | Path], device: str | None = "cpu",
                        precision: str = "fp32") -> Translator:
        """Load one checkpoint (or several, as an ensemble); it carries vocabulary, BPE codes and languages."""
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        dev = resolve_device(device)
        models, first = [], None
        for path in paths:
            state = load_checkpoint(path)
            needed = ("model", "config", "vocab", "bpe_codes", "source_lang", "target_lang")
            missing = [k for k in needed if k not in state]
            if missing:
                raise NmtError(f"{path}: checkpoint lacks {', '.join(missing)}")
            if first is None:
                first = state
            elif state["vocab"] != first["vocab"] or state["bpe_codes"] != first["bpe_codes"]:
                raise NmtError(f"{path}: vocabulary or BPE codes differ from {paths[0]}; cannot ensemble")
            model, vocab = model_from_checkpoint(state)
            if precision != "fp32":
                model = model.to(PRECISIONS.get(precision, torch.float32))
            models.append(model.to(dev))
        assert first is not None
        normalize = bool((first.get("tokenizer") or {}).get("normalize_punctuation", False))
        return cls(models, vocab, first["bpe_codes"], first["source_lang"], first["target_lang"], dev, precision,
                   normalize)

    def _autocast(self):
        params = next(self.ensemble.models[0].parameters())
        if self.precision == "fp32" or params.dtype != torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=PRECISIONS[self.precision])

    def encode(self, sentences: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Token ids of raw sentences (no </s>); too-long ones are truncated with a warning naming the line."""
        limit = self.ensemble.max_positions - 2
        out = []
        for n, sentence in enumerate(sentences, start=first_line):
            if not sentence.strip():
                out.append([])
                continue
            if self.normalize:
                sentence = text.normalize_punctuation(sentence, self.source_lang)
            ids = self.vocab.encode(self.bpe(text.tokenize(sentence, self.source_lang)))
            if len(ids) > limit:
                self.warnings.append(f"line {n}: {len(ids)} tokens exceed the model's {limit}; translated truncated")
                ids = ids[:limit]
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of output ids."""
        return text.detokenize(text.remove_bpe(self.vocab.decode(ids)), self.target_lang)

    def _batches(self, lengths: list[int], batch_size: int, max_tokens: int | None) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        current: list[int] = []
        for i in order:
            longest = max([lengths[j] for j in current] + [lengths[i]]) + 1
            too_many = max_tokens is not None and longest * (len(current) + 1) > max_tokens
            if current and (too_many or (max_tokens is None and len(current) >= batch_size)):
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        return batches

    def translate_nbest(self, sentences: Sequence[str], beam: int = 4, lenpen: float = 0.6, max_len_a: float = 1.0,
                        max_len_b: int = 50, batch_size: int = 64, max_tokens: int | None = None,
                        greedy: bool = False, nbest: int = 1, first_line: int = 1,
                        on_batch: Callable[[int], None] | None = None) -> list[list[tuple[str, float]]]:
        """Exactly `nbest` (translation, score) pairs per sentence, best first; empty input gives ("", 0.0)s."""
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
        ids = self.encode(sentences, first_line)
        results: list[list[tuple[str, float]]] = [[("", 0.0)] * nbest for _ in sentences]
        todo = [i for i, x in enumerate(ids) if x]
        lengths = [len(ids[i]) for i in todo]
        vocab = self.vocab
        for batch in self._batches(lengths, batch_size, max_tokens):
            rows = [todo[j] for j in batch]
            width = max(len(ids[i]) for i in rows) + 1
            src = torch.full((len(rows), width), vocab.pad, dtype=torch.long)
            for r, i in enumerate(rows):
                src[r, : len(ids[i])] = torch.tensor(ids[i])
                src[r, len(ids[i])] = vocab.eos
            src = src.to(self.device)
            with self._autocast():
                if greedy:
                    hyps: list[list[Hypothesis]] = [[h] for h in greedy_search(
                        self.ensemble, src, vocab.bos, vocab.eos, max_len_a, max_len_b)]
                else:
                    hyps = beam_search(self.ensemble, src, vocab.bos, vocab.eos, beam, lenpen, max_len_a,
                                       max_len_b, nbest)
            for i, sentence_hyps in zip(rows, hyps):
                results[i] = [(self.decode(h.tokens), h.score) for h in sentence_hyps]
                # Exactly `nbest` per input: a search that ran out of distinct hypotheses repeats its last one.
                results[i] += results[i][-1:] * (nbest - len(results[i]))
                self.generated_tokens += len(sentence_hyps[0].tokens) + 1
            if on_batch:
                on_batch(len(rows))
        if on_batch:
            on_batch(len(sentences) - len(todo))
        return results

    def translate(self, sentences: Sequence[str], **options) -> list[str]:
        """The best translation of each sentence, in input order (see `translate_nbest` for options)."""
        options.pop("nbest", None)
        return [r[0][0] for r in self.translate_nbest(sentences, nbest=1, **options)]
