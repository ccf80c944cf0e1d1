"""The PyTorch engine: `Translator` searches with nmt checkpoints (one model or an ensemble); the text
handling around the search is `pipeline.TextTranslator`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from nmt_cli.errors import NmtError
from nmt_cli.hardware import resolve_device
from nmt_cli.model.checkpoint import (
    TOKENIZER_KEYS,
    load_checkpoint,
    model_from_checkpoint,
    require_keys,
    target_vocabulary,
)
from nmt_cli.model.precision import PRECISIONS, resolve_precision
from nmt_cli.model.transformer import Transformer, count_parameters
from nmt_cli.text.segment import Segmenter, segmenter_of
from nmt_cli.text.vocab import Vocabulary
from nmt_cli.torch_env import DECODING_KERNEL_CACHE, size_kernel_cache

from .pipeline import Hyp, TextTranslator, default_workers, stored_decoding
from .sampling import Sampling
from .search import EnsembleModel, beam_search, greedy_search, sample_search
from .steering import Steering


class Translator(TextTranslator):
    """Translates raw sentences with one model or an ensemble.

    >>> t = Translator.from_checkpoint("model.pt")
    >>> t.translate(["A man is riding a bike."], beam=4)
    """

    def __init__(self, models: Sequence[Transformer], vocab: Vocabulary, segmenter: Segmenter, source_lang: str,
                 target_lang: str, device: torch.device, precision: str = "fp32", workers: int = 1,
                 threads: int = 0, target_vocab: Vocabulary | None = None) -> None:
        precision = resolve_precision(precision, device)
        if threads < 0:
            raise NmtError(f"--threads must be 0 (torch's default) or more (got {threads})")
        size_kernel_cache(DECODING_KERNEL_CACHE)
        self.ensemble = EnsembleModel(models, searches=workers)
        super().__init__(vocab, segmenter, source_lang, target_lang, self.ensemble.max_positions, workers,
                         target_vocab)
        self.device, self.precision = device, precision
        if threads and workers == 1:
            torch.set_num_threads(threads)
        self.threads_per_worker = max(1, (threads or torch.get_num_threads()) // workers)

    def cache_bytes(self) -> int:
        return self.ensemble.pool.kept_bytes()

    def limit_cache(self, max_bytes: int) -> None:
        self.ensemble.pool.max_bytes = max_bytes
        self.ensemble.pool.give([])  # releases what is above the new ceiling now

    @classmethod
    def from_checkpoint(cls, paths: str | Path | Sequence[str | Path], device: str | None = "cpu",
                        precision: str = "fp32", threads: int = 0, workers: int = 1) -> Translator:
        """Load one checkpoint (or several, as an ensemble); it carries vocabulary, tokenizer and languages.
        `workers` batches are searched at once, on `threads` CPU threads in all (0: torch's default); workers
        0 chooses (`pipeline.default_workers`)."""
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        dev = resolve_device(device)
        precision = resolve_precision(precision, dev)
        workers = workers or default_workers(dev.type, threads or torch.get_num_threads())
        models, first = [], None
        for path in paths:
            state = require_keys(load_checkpoint(path), path)
            if first is None:
                first = state
            elif [state.get(k) for k in TOKENIZER_KEYS] != [first.get(k) for k in TOKENIZER_KEYS]:
                raise NmtError(f"{path}: vocabulary or tokenizer differ from {paths[0]}; cannot ensemble")
            model, vocab = model_from_checkpoint(state)
            if precision != "fp32":
                model = model.to(PRECISIONS.get(precision, torch.float32))
            models.append(model.to(dev).pack_weights())
        assert first is not None
        translator = cls(models, vocab, segmenter_of(first, paths[0]), first["source_lang"], first["target_lang"],
                         dev, precision, workers, threads, target_vocabulary(first))
        translator.target_token = first.get("target_token", "")
        translator.decoding = stored_decoding(first, paths[0])  # an ensemble searches as its first model would
        return translator

    def describe(self) -> dict:
        model = self.ensemble.models[0]
        return {**super().describe(), "parameters": count_parameters(model),
                "layers": model.config.layers, "d_model": model.config.d_model,
                "ensemble": len(self.ensemble.models), "precision": self.precision}

    def alignment_layer(self, layer: int | None) -> int:
        """The encoder-decoder attention layer (0-based) alignments read: `layer` (1-based), or by default the
        second to last, the last for models of 1 or 2 layers (docs/design.md, "Attention and alignments")."""
        layers = self.ensemble.models[0].config.layers
        if layer is None:
            return layers - 2 if layers >= 3 else layers - 1
        if not 1 <= layer <= layers:
            raise NmtError(f"--alignment-layer must be between 1 and {layers}, the model's layers (got {layer})")
        return layer - 1

    def align(self, sources: Sequence[str], outputs: Sequence[str], ids: Sequence[tuple[list[int], list[int]]],
              layer: int | None = None) -> list[list[tuple[int, int]]]:
        """Word alignments (source word, output word) of each translated sentence, from the encoder-decoder
        attention of `layer` (1-based; default: `alignment_layer`) of the first model, with the output
        teacher-forced; `ids` as `translate_nbest(ids_out=...)` gives them. A Chinese, Japanese or Thai side
        counts characters instead of words (`attention.by_character`)."""
        from nmt_cli.model.attention import attention_maps, by_character, piece_words, word_alignments

        index = self.alignment_layer(layer)
        model, symbols, vocab = self.ensemble.models[0], self.vocab.symbols, self.vocab
        target_symbols = self.target_vocab.symbols
        out = []
        for source, output, (source_ids, output_ids) in zip(sources, outputs, ids):
            if not source_ids or not output_ids:
                out.append([])
                continue
            maps = attention_maps(model, source_ids, output_ids, symbols, vocab.bos, vocab.eos, target_symbols)
            read = source.lower() if self.segmenter.lowercase else source  # as the pieces spell it
            source_words = piece_words([symbols[i] for i in source_ids], read, self.segmenter.surface,
                                       by_character(self.source_lang))
            output_words = piece_words([target_symbols[i] for i in output_ids], output, self.target_segmenter.surface,
                                       by_character(self.target_lang))
            out.append(word_alignments(maps.weights["cross"][index], source_words, output_words))
        return out

    def serving(self) -> AbstractContextManager:
        from nmt_cli.model.ops import serving_products

        return serving_products()

    def start_worker(self) -> None:
        torch.set_num_threads(self.threads_per_worker)  # this thread's count (OpenMP keeps one per thread)

    def map_batches(self, search: Callable[[list[int]], Any],
                    jobs: list[list[int]]) -> Iterator[tuple[list[int], Any]]:
        threads = torch.get_num_threads()
        try:
            yield from super().map_batches(search, jobs)
        finally:
            # PyTorch also keeps the count set last for threads it has not seen yet: set this thread's again.
            torch.set_num_threads(threads)

    def attention_pair(self, sentence: str, reference: str | None = None) -> tuple[list[int], list[int]]:
        """Source and target ids for drawing attention (`nmt attention`): the target is `reference` segmented
        as the model's target side, or the model's own translation; one line for what cannot be drawn."""
        if not sentence.strip():
            raise NmtError("the sentence is empty: nothing to attend to")
        source = self.encode([sentence])[0]
        most = self.max_positions - 2
        if self.truncated:
            raise NmtError(f"the sentence has {self.truncated[0][1]} tokens, more than the model's {most}: draw a "
                           "shorter one (the pictures are readable up to ~40)")
        if reference is None:
            ids: list = []
            self.translate_nbest([sentence], ids_out=ids)
            return source, ids[0][1]
        target = self.target_ids(reference)
        if not target:
            raise NmtError("--reference is empty: nothing to force-decode")
        if len(target) > most:
            raise NmtError(f"--reference has {len(target)} tokens, more than the model's {most}: give a shorter one")
        return source, target

    def _autocast(self):
        params = next(self.ensemble.models[0].parameters())
        if self.precision == "fp32" or params.dtype != torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=PRECISIONS[self.precision])

    def search(self, sources: list[list[int]], beam: int, lenpen: float, max_len_a: float, max_len_b: int,
               greedy: bool, nbest: int, sampling: Sampling | None = None, no_repeat_ngram: int = 0,
               prefixes: list[list[int]] | None = None, constraints: list[list[list[int]]] | None = None,
               unmet: list[int] | None = None) -> list[list[Hyp]]:
        vocab = self.vocab
        src = torch.full((len(sources), max(map(len, sources)) + 1), vocab.pad, dtype=torch.long)
        for r, ids in enumerate(sources):
            src[r, : len(ids)] = torch.tensor(ids)
            src[r, len(ids)] = vocab.eos
        src = src.to(self.device)
        steering = Steering(no_repeat_ngram, prefixes) if no_repeat_ngram or prefixes else None
        with self._autocast():
            if sampling is not None:
                hyps = sample_search(self.ensemble, src, vocab.bos, vocab.eos, sampling, nbest,
                                     [sampling.sentence_seed(ids) for ids in sources], max_len_a, max_len_b, steering)
            elif greedy:
                hyps = [[h] for h in greedy_search(self.ensemble, src, vocab.bos, vocab.eos, max_len_a, max_len_b,
                                                   steering)]
            else:
                hyps = beam_search(self.ensemble, src, vocab.bos, vocab.eos, beam, lenpen, max_len_a, max_len_b,
                                   nbest, steering=steering, constraints=constraints)
        if unmet is not None:
            unmet.extend(r for r, sentence_hyps in enumerate(hyps) if not sentence_hyps[0].complete)
        return [[(h.tokens, h.score) for h in sentence_hyps] for sentence_hyps in hyps]
