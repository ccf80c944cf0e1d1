"""Binarized corpora (memory-mapped token arrays + offsets) and token-budget batching."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from nmt_cli.errors import NmtError
from nmt_cli.text.vocab import Vocabulary

T = TypeVar("T")
U = TypeVar("U")


CORPUS_FILE = "train.corpus.npy"  # per training pair, the index of its corpus (data prepared from several)
DROPOUT_SPLIT = "train-bpe-dropout-"  # + the draw's number: the training pairs in one draw of BPE-dropout


def dropout_split(draw: int) -> str:
    """The split name of BPE-dropout draw `draw` (from 1) of the training pairs."""
    return f"{DROPOUT_SPLIT}{draw}"


def is_dropout_split(name: str) -> bool:
    """Whether a split holds a BPE-dropout draw of the training pairs."""
    return name.startswith(DROPOUT_SPLIT)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where the vocabulary fits, else int32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


class BinarizedWriter:
    """Streams one split and side to `prefix.bin` (all ids, flat) and `prefix.idx` (int64 offsets, n + 1)."""

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        prefix = Path(prefix)
        self.bin_path, self.idx_path = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
        self.dtype, self.file = dtype, open(self.bin_path, "wb")
        self.lengths: list[np.ndarray] = []
        self.sentences = self.tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append sentences given as their concatenated ids and their lengths."""
        self.file.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self.lengths.append(np.asarray(lengths, dtype=np.int64))
        self.sentences += len(lengths)
        self.tokens += int(len(flat))

    def close(self) -> None:
        """Finish the .bin file and write the .idx offsets."""
        self.file.close()
        offsets = np.zeros(self.sentences + 1, dtype=np.int64)
        if self.lengths:
            np.cumsum(np.concatenate(self.lengths), out=offsets[1:])
        offsets.tofile(self.idx_path)


class IndexedDataset:
    """Read-only view of one binarized split and side, memory-mapped."""

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        prefix = Path(prefix)
        idx_path, bin_path = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise NmtError(f"{path}: no such file; the data directory is incomplete (re-run nmt prepare)")
        size = idx_path.stat().st_size
        if size < 8 or size % 8:
            raise NmtError(f"{idx_path}: truncated or not an index ({size} bytes; re-run nmt prepare)")
        self.offsets = np.fromfile(idx_path, dtype=np.int64)
        if self.offsets[0] != 0 or (np.diff(self.offsets) < 0).any():
            raise NmtError(f"{idx_path}: corrupt index (offsets not increasing from 0; re-run nmt prepare)")
        if self.offsets[-1] == 0:
            self.tokens = np.zeros(0, dtype=dtype)
        else:
            self.tokens = np.memmap(bin_path, dtype=dtype, mode="r")
        if len(self.tokens) != self.offsets[-1]:
            raise NmtError(f"{bin_path}: holds {len(self.tokens)} tokens, index {idx_path.name} expects "
                           f"{self.offsets[-1]} (truncated? re-run nmt prepare)")
        self.sizes = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def not_a_data_dir(path: Path) -> str:
    """What a folder without meta.json looks like, for the one-line error: a save dir, raw text, or an
    interrupted `nmt prepare`."""
    if (path / "train.jsonl").exists() or any(path.glob("checkpoint*.pt")):
        return "a save dir of nmt train, not a data dir; give the --out folder of nmt prepare"
    if not any(path.glob("*.bin")) and any(p.is_file() and p.suffix not in (".json", ".idx") for p in path.iterdir()):
        return "no meta.json and no binarized data: raw text? Run nmt prepare on it and give its --out folder"
    return "no meta.json; the directory is incomplete (re-run nmt prepare)"


@dataclass
class DataDir:
    """A directory made by `nmt prepare`: meta.json, vocabulary, BPE codes or SentencePiece model, and binarized
    splits."""

    path: Path
    meta: dict
    vocab: Vocabulary
    bpe_codes: str
    sentencepiece: bytes | None = None  # the SentencePiece model, for data prepared with --tokenizer sentencepiece
    # The target side's own vocabulary and SentencePiece model, for data prepared --from-model with a model made
    # elsewhere that has them (target-vocab.txt, target-spm.model); None: the shared ones.
    own_target_vocab: Vocabulary | None = None
    target_sentencepiece: bytes | None = None

    @property
    def target_vocab(self) -> Vocabulary:
        """The target side's vocabulary (the shared one unless the data has its own)."""
        return self.own_target_vocab or self.vocab

    @classmethod
    def open(cls, path: str | Path) -> DataDir:
        """Open a prepared directory; refuse one without meta.json (incomplete)."""
        path = Path(path)
        if path.is_file():
            raise NmtError(f"{path}: a file, not a data dir: give the --out folder of nmt prepare")
        if not path.is_dir():
            raise NmtError(f"{path}: no such data directory")
        meta_path = path / "meta.json"
        if not meta_path.exists():
            raise NmtError(f"{path}: {not_a_data_dir(path)}")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NmtError(f"{meta_path}: not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise NmtError(f"{meta_path}: not a JSON object")
        missing = [k for k in ("source_lang", "target_lang", "token_dtype", "splits") if k not in meta]
        if missing:
            raise NmtError(f"{meta_path}: lacks {', '.join(missing)} (not made by nmt prepare?)")
        vocab = Vocabulary.load(path / "vocab.txt")
        codes_path = path / "bpe.codes"
        codes = codes_path.read_text(encoding="utf-8") if codes_path.exists() else ""
        spm_path = path / "spm.model"
        sentencepiece = spm_path.read_bytes() if spm_path.exists() else None
        if (meta.get("tokenizer") or {}).get("name") == "sentencepiece" and sentencepiece is None:
            raise NmtError(f"{path}: meta.json says SentencePiece, but spm.model is missing (re-run nmt prepare)")
        target_vocab = path / "target-vocab.txt"
        target_spm = path / "target-spm.model"
        return cls(path, meta, vocab, codes, sentencepiece,
                   Vocabulary.load(target_vocab) if target_vocab.exists() else None,
                   target_spm.read_bytes() if target_spm.exists() else None)

    def corpus_weights(self) -> tuple[np.ndarray, list[float]] | None:
        """The training pairs' corpus indices and each corpus's weight, for data prepared from several corpora
        of which one is weighted otherwise than 1; None where every pair counts once per epoch."""
        corpora = self.meta.get("corpora") or []
        weights = [float(c.get("weight", 1.0)) for c in corpora]
        if len(corpora) < 2 or all(w == 1.0 for w in weights):
            return None
        path = self.path / CORPUS_FILE
        if not path.exists():
            raise NmtError(f"{path}: missing: meta.json weighs {len(corpora)} corpora (re-run nmt prepare)")
        ids = np.load(path)
        if len(ids) != len(self.split("train")):
            raise NmtError(f"{path}: {len(ids):,} pairs, but train holds {len(self.split('train')):,} (re-run nmt "
                           "prepare)")
        return ids, weights

    def dropout_draws(self) -> list[ParallelCorpus]:
        """The BPE-dropout draws of the training pairs (`nmt prepare --bpe-dropout`), in order; [] without."""
        copies = int((self.meta.get("bpe_dropout") or {}).get("copies", 0))
        draws = [self.split(dropout_split(k)) for k in range(1, copies + 1)]
        train = self.split("train")
        for k, draw in enumerate(draws, start=1):
            if len(draw) != len(train):
                raise NmtError(f"{self.path}: BPE-dropout draw {k} holds {len(draw):,} pairs, train {len(train):,} "
                               "(re-run nmt prepare)")
        return draws

    def segmenter(self):
        """The tokenizer that made this data (raw text <-> pieces)."""
        from nmt_cli.text.segment import segmenter_from

        return segmenter_from(self.meta.get("tokenizer"), self.bpe_codes, self.sentencepiece, self.target_sentencepiece)

    @property
    def source_lang(self) -> str:
        return self.meta["source_lang"]

    @property
    def target_lang(self) -> str:
        return self.meta["target_lang"]

    def split(self, name: str) -> ParallelCorpus:
        """The binarized source/target pair of one split."""
        if name not in self.meta["splits"]:
            raise NmtError(f"{self.path}: no split named {name!r} (have {', '.join(self.meta['splits'])})")
        dtype = np.dtype(self.meta["token_dtype"])
        src = IndexedDataset(self.path / f"{name}.{self.source_lang}", dtype)
        tgt = IndexedDataset(self.path / f"{name}.{self.target_lang}", dtype)
        return ParallelCorpus(src, tgt)


@dataclass
class ParallelCorpus:
    """Aligned source and target sentences (ids without </s>)."""

    src: IndexedDataset
    tgt: IndexedDataset

    def __len__(self) -> int:
        return len(self.src)


def make_batches(src_sizes: np.ndarray, tgt_sizes: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Group sentence indices into batches whose padded size (with </s>) stays within `max_tokens`.

    Sentences are sorted by target then source length, ties broken by a seeded shuffle, and
    packed greedily; a batch costs `count * max(longest source, longest target)` tokens.
    """
    n = len(src_sizes)
    if n == 0:
        return []
    tiebreak = np.random.default_rng(seed).permutation(n)
    order = tiebreak[np.lexsort((src_sizes[tiebreak], tgt_sizes[tiebreak]))]
    cost = np.maximum(src_sizes, tgt_sizes)[order] + 1  # +1 for </s> (or <s> on the decoder input)
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for i in range(n):
        longest_with = max(longest, int(cost[i]))
        if i > start and longest_with * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, longest_with = i, int(cost[i])
        longest = longest_with
    batches.append(order[start:])
    return batches


def epoch_sample(corpus_ids: np.ndarray, weights: list[float], seed: int, epoch: int) -> np.ndarray:
    """The training pairs of one epoch when corpora are weighted: each pair of a corpus of weight w, floor(w)
    times, and once more with probability w - floor(w), drawn from (seed, epoch). A corpus's share of an
    epoch's target tokens is so, in expectation, its weight times its tokens over the sum of those."""
    w = np.asarray(weights, dtype=np.float64)[corpus_ids]
    copies = np.floor(w).astype(np.int64)
    copies += np.random.default_rng([seed, epoch, 7]).random(len(w)) < (w - copies)
    return np.repeat(np.arange(len(w)), copies)


def weighted_batches(src_sizes: np.ndarray, tgt_sizes: np.ndarray, corpus_ids: np.ndarray, weights: list[float],
                     max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """`make_batches` over one epoch's `epoch_sample`: batches of pair indices (a pair may recur)."""
    sample = epoch_sample(corpus_ids, weights, seed, epoch)
    return [sample[b] for b in make_batches(src_sizes[sample], tgt_sizes[sample], max_tokens, seed)]


def shuffled(batches: list[np.ndarray], seed: int, epoch: int) -> list[np.ndarray]:
    """The batches in the order of one epoch: a permutation fixed by (seed, epoch)."""
    perm = np.random.default_rng([seed, epoch]).permutation(len(batches))
    return [batches[i] for i in perm]


@dataclass
class Batch:
    """Padded tensors for one batch. Shapes: src (B, S); prev_output (B, T); target_index and target (n,).

    `target_index` lists the flat positions (into B x T) of the real target tokens and `target` their ids,
    both computed on the host, so the loss gathers them without a device-to-host sync (a boolean mask would
    need one to learn its size).
    """

    src: torch.Tensor
    prev_output: torch.Tensor
    target_index: torch.Tensor
    target: torch.Tensor
    ntokens: int  # target tokens, </s> included, padding excluded

    def pin_memory(self) -> Batch:
        """Page-locked copies, so that `to(cuda, non_blocking=True)` overlaps with compute."""
        return Batch(self.src.pin_memory(), self.prev_output.pin_memory(), self.target_index.pin_memory(),
                     self.target.pin_memory(), self.ntokens)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (self.src, self.prev_output,
                                                                         self.target_index, self.target)),
                     self.ntokens)


def collate(corpus: ParallelCorpus, indices: np.ndarray, vocab: Vocabulary) -> Batch:
    """Pad a batch: source + </s>; decoder input <s> + target; decoder target target + </s>.

    A fixed handful of numpy operations on the whole batch, whatever its sentence count (no loop over
    sentences), so collating on a background thread holds the GIL only briefly (numpy's gathers release it)."""
    indices = np.asarray(indices, dtype=np.int64)
    src, _ = _padded_rows(corpus.src, indices, vocab.pad, eos=vocab.eos)
    target, lengths = _padded_rows(corpus.tgt, indices, vocab.pad, eos=vocab.eos)
    prev = np.empty_like(target)
    prev[:, 0] = vocab.bos
    prev[:, 1:] = target[:, :-1]
    shorter = np.flatnonzero(lengths + 1 < target.shape[1])
    prev[shorter, lengths[shorter] + 1] = vocab.pad  # the </s> shifted in is no decoder input
    rows, within = _ragged_positions(lengths + 1)  # the real target tokens, </s> included
    index = rows * target.shape[1] + within
    return Batch(torch.from_numpy(src), torch.from_numpy(prev), torch.from_numpy(index),
                 torch.from_numpy(target.reshape(-1)[index]), len(index))


def _ragged_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of these lengths laid end to end: each element's row and its position within the row."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return rows, within


def _padded_rows(dataset: IndexedDataset, indices: np.ndarray, pad: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The sentences `indices` of `dataset`, each followed by </s>, as rows of a (B, longest + 1) int64 array
    filled with `pad`; and their lengths (without </s>)."""
    lengths = dataset.sizes[indices]
    out = np.full((len(indices), int(lengths.max(initial=0)) + 1), pad, dtype=np.int64)
    rows, within = _ragged_positions(lengths)
    out[rows, within] = dataset.tokens[np.repeat(dataset.offsets[indices], lengths) + within]
    out[np.arange(len(indices)), lengths] = eos
    return out, lengths


def prefetch(make: Callable[[T], U], items: Iterable[T], background: bool = True) -> Iterator[U]:
    """make(item) for each item, in order; with `background`, computed one item ahead on a thread, so that
    collating (and pinning) the next batch overlaps with the current update on a GPU (numpy and pinning
    release the GIL). On CPU training leave `background` off: the update keeps every core busy and a second
    thread only competes with it (slower: docs/benchmarks.md, "Training speed")."""
    if not background:
        yield from (make(item) for item in items)
        return
    out: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    end = object()

    def work() -> None:
        try:
            for item in items:
                made = make(item)
                while not stop.is_set():
                    try:
                        out.put(made, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put(end)
        except BaseException as e:  # handed to the consumer, which raises it
            out.put(e)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            made = out.get()
            if made is end:
                return
            if isinstance(made, BaseException):
                raise made
            yield made
    finally:
        stop.set()
