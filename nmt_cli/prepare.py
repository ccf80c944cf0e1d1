"""`nmt prepare`: raw parallel text -> normalized, tokenized, BPE-segmented, binarized data directory.

Everything streams: each stage reads its input in fixed chunks of lines, runs them on worker processes in
order, and writes its output to files in the staging directory, so memory does not grow with the corpus
(the largest things held are the word counts for BPE learning and each worker's segmentation cache).
Stages: normalize + tokenize (counting training words) -> learn BPE -> apply BPE (filtering training pairs,
counting pieces) -> vocabulary -> binarize.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from itertools import islice
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import text
from .bpe import learn_bpe_codes
from .data import BinarizedWriter, token_dtype
from .errors import NmtError
from .textio import file_sha256, iter_lines, publish_directory, staging_directory
from .vocab import Vocabulary
from .workers import ordered_map

CHUNK = 2000  # lines per work unit; fixed so that output never depends on the worker count
MAX_POSITIONS = 1024  # the model's positions (ModelConfig.max_positions): a sentence plus </s> must fit


@dataclass
class PrepareOptions:
    """Everything `nmt prepare` needs; mirrors its command-line flags."""

    source_lang: str
    target_lang: str
    train: str
    valid: str
    out: Path
    test: Sequence[str] = ()
    bpe_merges: int = 10000
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_len: int = 250
    max_ratio: float = 1.5
    vocab_threshold: int = 1
    force: bool = False
    quiet: bool = False
    normalize: bool = False  # Moses punctuation normalization + removal of non-printing characters
    from_model: Path | None = None  # segment with this model's normalization, BPE codes and vocabulary


def resolve_side(prefix: str, lang: str) -> Path:
    """`PREFIX.lang`, or `PREFIX.lang.gz` when only that exists."""
    plain = Path(f"{prefix}.{lang}")
    gz = Path(f"{prefix}.{lang}.gz")
    if plain.exists():
        return plain
    if gz.exists():
        return gz
    raise NmtError(f"{plain}: no such file (nor {gz.name})")


def pair_chunks(src_path: Path, tgt_path: Path, size: int = CHUNK) -> Iterator[tuple[list[str], list[str]]]:
    """Aligned chunks of `size` lines of two files; NmtError when their line counts differ."""
    src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
    done = 0
    while True:
        src, tgt = list(islice(src_lines, size)), list(islice(tgt_lines, size))
        if len(src) != len(tgt):
            n_src = done + len(src) + sum(1 for _ in src_lines)
            n_tgt = done + len(tgt) + sum(1 for _ in tgt_lines)
            raise NmtError(f"line counts differ: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}")
        if not src:
            return
        done += len(src)
        yield src, tgt


def filter_pairs(src: list[str], tgt: list[str], max_len: int, max_ratio: float) -> tuple[list[int], dict[str, int]]:
    """Indices of training pairs kept (like Moses clean-corpus-n, on BPE pieces), and drop counts by reason."""
    kept: list[int] = []
    dropped = {"empty": 0, "too_long": 0, "ratio": 0}
    for i, (s, t) in enumerate(zip(src, tgt)):
        ls, lt = len(s.split()), len(t.split())
        if ls == 0 or lt == 0:
            dropped["empty"] += 1
        elif ls > max_len or lt > max_len:
            dropped["too_long"] += 1
        elif ls > max_ratio * lt or lt > max_ratio * ls:
            dropped["ratio"] += 1
        else:
            kept.append(i)
    return kept, dropped


# ------------------------------------------------------------------ worker side (state set once per process)
_worker: dict = {}


def _init_worker(state: dict) -> None:
    _worker.clear()
    _worker.update(state)
    if state.get("codes") is not None:
        _worker["bpe"] = text.BpeApplier(state["codes"])
    if state.get("symbols") is not None:
        _worker["vocab"] = Vocabulary(state["symbols"])


def _preprocess(line: str, lang: str) -> str:
    if _worker["normalize"]:
        line = text.normalize_punctuation(line, lang)
    return text.tokenize(line, lang) if line.strip() else ""


def _tokenize_job(job: tuple[list[str], list[str], bool]) -> tuple[list[str], list[str], Counter | None]:
    """Normalize and tokenize a chunk of pairs; count its words when it is training data."""
    src, tgt, count = job
    src_tok = [_preprocess(line, _worker["src_lang"]) for line in src]
    tgt_tok = [_preprocess(line, _worker["tgt_lang"]) for line in tgt]
    counts = Counter(w for lines in (src_tok, tgt_tok) for line in lines for w in line.split()) if count else None
    return src_tok, tgt_tok, counts


def _segment_job(job: tuple[list[str], list[str], bool]) -> tuple[list[str], list[str], dict | None, Counter | None]:
    """Apply BPE to a chunk of pairs; training chunks are filtered and their pieces counted."""
    src, tgt, is_train = job
    bpe = _worker.get("bpe")
    if bpe is not None:
        src, tgt = [bpe(line) for line in src], [bpe(line) for line in tgt]
    if not is_train:
        return src, tgt, None, None
    kept, dropped = filter_pairs(src, tgt, _worker["max_len"], _worker["max_ratio"])
    src, tgt = [src[i] for i in kept], [tgt[i] for i in kept]
    pieces = Counter(p for lines in (src, tgt) for line in lines for p in line.split())
    return src, tgt, dropped, pieces


def _binarize_job(job: tuple[list[str], list[str], int | None]):
    """Token ids of a chunk of pairs (flat arrays and lengths per side); pairs over `limit` pieces are dropped."""
    import numpy as np

    src, tgt, limit = job
    vocab: Vocabulary = _worker["vocab"]
    src_ids, tgt_ids = [vocab.encode(line) for line in src], [vocab.encode(line) for line in tgt]
    dropped = 0
    if limit is not None:
        keep = [i for i in range(len(src_ids)) if len(src_ids[i]) <= limit and len(tgt_ids[i]) <= limit]
        dropped = len(src_ids) - len(keep)
        src_ids, tgt_ids = [src_ids[i] for i in keep], [tgt_ids[i] for i in keep]
    dtype = token_dtype(len(vocab))
    out = []
    for ids in (src_ids, tgt_ids):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((i for x in ids for i in x), dtype=dtype, count=int(lengths.sum()))
        out.append((flat, lengths, int((flat == vocab.unk).sum())))
    return out, dropped


# ------------------------------------------------------------------ main side
class _Stages:
    """Timing, lines and peak memory of each stage, with a progress bar per stage."""

    def __init__(self, quiet: bool, on_stage: Callable[[dict], None] | None, staging: Path) -> None:
        self.progress = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), disable=quiet)
        self.on_stage, self.records, self.staging = on_stage, [], staging
        self.task, self.start, self.name, self.unit = None, 0.0, "", "lines"

    def begin(self, name: str, total: int | None, unit: str = "lines") -> None:
        self.name, self.start, self.unit = name, time.perf_counter(), unit
        self.task = self.progress.add_task(name, total=total, unit=unit)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def end(self, done: int) -> None:
        self.progress.update(self.task, completed=done, total=done)
        usage = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                    resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        record = {"stage": self.name, "seconds": time.perf_counter() - self.start, "lines": done, "unit": self.unit,
                  "peak_rss_mb": usage / 1024,
                  "disk_mb": sum(p.stat().st_size for p in self.staging.rglob("*") if p.is_file()) / 2**20}
        self.records.append(record)
        if self.on_stage:
            self.on_stage(record)


class _Writer:
    """Text lines to a file in the staging directory."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w", encoding="utf-8", newline="\n")

    def write(self, lines: list[str]) -> None:
        if lines:
            self.file.write("\n".join(lines))
            self.file.write("\n")

    def close(self) -> None:
        self.file.close()


def package_versions() -> dict[str, str]:
    """Versions of the packages that shape the output."""
    versions = {"python": platform.python_version()}
    for name in ("nmt-cli", "sacremoses", "subword-nmt", "numpy", "torch"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def _check_options(opts: PrepareOptions) -> Path:
    if opts.bpe_merges < 1:
        raise NmtError(f"--bpe-merges must be at least 1 (got {opts.bpe_merges})")
    if not 1 <= opts.max_len <= MAX_POSITIONS - 1:
        raise NmtError(f"--max-len must be between 1 and {MAX_POSITIONS - 1} (got {opts.max_len})")
    if not opts.max_ratio >= 1:
        raise NmtError(f"--max-ratio must be at least 1 (got {opts.max_ratio})")
    if opts.vocab_threshold < 1:
        raise NmtError(f"--vocab-threshold must be at least 1 (got {opts.vocab_threshold})")
    if opts.workers < 1:
        raise NmtError(f"--workers must be at least 1, or 0 for all cores (got {opts.workers})")
    if opts.source_lang == opts.target_lang:
        raise NmtError(f"source and target language are both {opts.source_lang!r}")
    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise NmtError(f"{out}: already exists (use --force to overwrite)")
    if out.exists() and not (out.is_dir() and not out.is_symlink() and (out / "meta.json").is_file()):
        raise NmtError(f"{out}: not a data dir that nmt prepare made (no meta.json); --force replaces only those: "
                       "choose another --out")
    return out


def _split_inputs(opts: PrepareOptions) -> dict[str, tuple[Path, Path]]:
    splits = {"train": opts.train, "valid": opts.valid}
    for i, prefix in enumerate(opts.test):
        splits["test" if i == 0 else f"test{i}"] = prefix
    return {name: (resolve_side(p, opts.source_lang), resolve_side(p, opts.target_lang)) for name, p in splits.items()}


def prepare(opts: PrepareOptions, on_stage: Callable[[dict], None] | None = None) -> dict:
    """Run the whole pipeline into `opts.out`; return the meta.json contents.

    The directory is built under a temporary name beside `opts.out` and renamed at the end, with meta.json
    written last, so an interrupted run never leaves a directory that looks complete. `on_stage` receives
    each stage's record (name, seconds, lines, peak RSS in MB) as it ends.
    """
    model = None
    if opts.from_model is not None:  # the model's codes, vocabulary and normalization
        codes, vocab, normalize = _model_preprocessing(opts)
        opts, model = replace(opts, normalize=normalize), (codes, vocab)
    out = _check_options(opts)
    inputs = _split_inputs(opts)
    tokenizer = _tokenizer_meta(opts.normalize)
    with staging_directory(out) as staging:
        stages = _Stages(opts.quiet, on_stage, staging)
        with stages.progress:
            work = staging / ".work"
            work.mkdir()
            tokenized, counts = _tokenize(inputs, work, staging, opts, stages, count=model is None)
            if model is None:
                stages.begin("learn BPE", opts.bpe_merges, unit="merges")
                codes = learn_bpe_codes(counts, opts.bpe_merges, on_merge=lambda _: stages.advance(1))
                stages.end(len(codes.splitlines()) - 1)
                vocab = None
            else:
                codes, vocab = model
            del counts
            meta = _segment_and_binarize(tokenized, staging, codes, opts, stages, tokenizer, inputs, vocab=vocab)
        if model is not None:
            meta["from_model"] = {"path": str(opts.from_model), "sha256": file_sha256(opts.from_model)}
            meta["bpe_merges"] = len(codes.splitlines()) - 1
        _finish(staging, out, meta)
    return meta


def _tokenizer_meta(normalize: bool) -> dict:
    """How text was tokenized, as meta.json and checkpoints record it (translate repeats it)."""
    return {"name": "moses", "escape": False, "aggressive_dash_splits": True, "normalize_punctuation": normalize}


def _model_preprocessing(opts: PrepareOptions) -> tuple[str, Vocabulary, bool]:
    """For --from-model: the model's BPE codes, vocabulary and normalization setting (a language that
    contradicts -s/-t is an error)."""
    from .checkpoint import load_checkpoint, require_keys

    state = load_checkpoint(opts.from_model)
    require_keys(state, opts.from_model, ("vocab", "bpe_codes", "source_lang", "target_lang"))
    if (state["source_lang"], state["target_lang"]) != (opts.source_lang, opts.target_lang):
        raise NmtError(f"{opts.from_model}: the model translates {state['source_lang']}->{state['target_lang']}, "
                       f"not {opts.source_lang}->{opts.target_lang}")
    normalize = bool((state.get("tokenizer") or {}).get("normalize_punctuation", False))
    return state["bpe_codes"], Vocabulary(state["vocab"]), normalize


def binarize_segmented(opts: PrepareOptions, codes: str) -> dict:
    """`nmt binarize`: your own tokenized + BPE text -> data dir; valid/test raw text is derived from it."""
    out = _check_options(opts)
    inputs = _split_inputs(opts)
    tokenizer = _tokenizer_meta(False)
    with staging_directory(out) as staging:
        stages = _Stages(opts.quiet, None, staging)
        with stages.progress:
            meta = _segment_and_binarize(inputs, staging, None, opts, stages, tokenizer, inputs, stored_codes=codes)
        _finish(staging, out, meta)
    return meta


def _finish(staging: Path, out: Path, meta: dict) -> None:
    shutil.rmtree(staging / ".work", ignore_errors=True)
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    publish_directory(staging, out)


def _tokenize(inputs: dict[str, tuple[Path, Path]], work: Path, staging: Path, opts: PrepareOptions,
              stages: _Stages, count: bool = True) -> tuple[dict[str, tuple[Path, Path]], Counter]:
    """Stage 1: normalize + tokenize every split into `work`, counting training words; valid/test raw text is
    copied into `staging` on the way."""
    src_lang, tgt_lang = opts.source_lang, opts.target_lang
    state = {"src_lang": src_lang, "tgt_lang": tgt_lang, "normalize": opts.normalize}
    counts: Counter = Counter()
    tokenized = {}
    stages.begin("normalize+tokenize" if opts.normalize else "tokenize", None)
    done = 0
    for name, paths in inputs.items():
        is_train = name == "train"
        tokenized[name] = (work / f"{name}.tok.{src_lang}", work / f"{name}.tok.{tgt_lang}")
        writers = [_Writer(p) for p in tokenized[name]]
        if not is_train:
            writers += [_Writer(staging / f"{name}.raw.{lang}") for lang in (src_lang, tgt_lang)]
        raw_chunks: list = []

        def jobs(paths=paths, is_train=is_train, raw_chunks=raw_chunks):
            for src, tgt in pair_chunks(*paths):
                raw_chunks.append(None if is_train else (src, tgt))
                yield src, tgt, is_train and count

        nonempty = [False, False]
        for src_tok, tgt_tok, chunk_counts in ordered_map(_tokenize_job, jobs(), opts.workers, _init_worker, (state,)):
            raw = raw_chunks.pop(0)
            for writer, lines in zip(writers, (src_tok, tgt_tok, *(raw or ()))):
                writer.write(lines)
            nonempty = [nonempty[0] or any(src_tok), nonempty[1] or any(tgt_tok)]
            if chunk_counts is not None:
                counts.update(chunk_counts)
            done += 2 * len(src_tok)
            stages.advance(2 * len(src_tok))
        for writer in writers:
            writer.close()
        for side, path in enumerate(paths):
            if not nonempty[side]:
                raise NmtError(f"empty corpus: {path} has no text")
    stages.end(done)
    return tokenized, counts


def _segment_and_binarize(inputs: dict[str, tuple[Path, Path]], staging: Path, codes: str | None,
                          opts: PrepareOptions, stages: _Stages, tokenizer: dict, originals: dict,
                          stored_codes: str | None = None, vocab: Vocabulary | None = None) -> dict:
    """Stages 3-5: apply BPE (or take the text as segmented when `codes` is None), filter training pairs,
    build the vocabulary from the kept training pieces (unless `vocab` is given), binarize every split.
    Returns meta.json's contents."""
    src_lang, tgt_lang = opts.source_lang, opts.target_lang
    work = staging / ".work"
    work.mkdir(exist_ok=True)
    state = {"codes": codes, "max_len": opts.max_len, "max_ratio": opts.max_ratio, "src_lang": src_lang,
             "tgt_lang": tgt_lang}
    pieces: Counter = Counter()
    dropped = {"empty": 0, "too_long": 0, "ratio": 0}
    input_sentences = 0
    segmented, sentences = {}, {}
    stages.begin("apply BPE" if codes is not None else "filter", None)
    done = 0
    for name, paths in inputs.items():
        is_train = name == "train"
        target = work if is_train else staging
        segmented[name] = (target / f"{name}.bpe.{src_lang}", target / f"{name}.bpe.{tgt_lang}")
        writers = [_Writer(p) for p in segmented[name]]
        derive_raw = codes is None and not is_train  # nmt binarize: raw valid/test text comes from the BPE text
        if derive_raw:
            writers += [_Writer(staging / f"{name}.raw.{lang}") for lang in (src_lang, tgt_lang)]
        jobs = ((s, t, is_train) for s, t in pair_chunks(*paths))
        sentences[name] = 0
        for src, tgt, chunk_dropped, chunk_pieces in ordered_map(_segment_job, jobs, opts.workers, _init_worker,
                                                                 (state,)):
            raws = ()
            if derive_raw:
                raws = ([text.detokenize(text.remove_bpe(x), src_lang) for x in src],
                        [text.detokenize(text.remove_bpe(x), tgt_lang) for x in tgt])
            for writer, lines in zip(writers, (src, tgt, *raws)):
                writer.write(lines)
            if chunk_dropped is not None:
                input_sentences += len(src) + sum(chunk_dropped.values())
                for reason, n in chunk_dropped.items():
                    dropped[reason] += n
                pieces.update(chunk_pieces)
            sentences[name] += len(src)
            done += 2 * len(src)
            stages.advance(2 * len(src))
        for writer in writers:
            writer.close()
    stages.end(done)
    kept = sentences["train"]
    if kept == 0:
        raise NmtError(f"empty corpus: every training pair was filtered out ({dropped})")

    stages.begin("vocabulary", None, unit="pieces")
    vocab = vocab or Vocabulary.from_counts(pieces, opts.vocab_threshold)
    vocab.save(staging / "vocab.txt")
    (staging / "bpe.codes").write_text(codes if codes is not None else (stored_codes or ""), encoding="utf-8")
    stages.end(len(vocab))
    del pieces

    stages.begin("binarize", 2 * sum(sentences.values()))
    state = {"symbols": vocab.symbols}
    split_meta: dict[str, dict] = {}
    done = 0
    for name, paths in segmented.items():
        dtype = token_dtype(len(vocab))
        writers = [BinarizedWriter(staging / f"{name}.{lang}", dtype) for lang in (src_lang, tgt_lang)]
        unk = [0, 0]
        too_long = 0
        limit = None if name == "train" else MAX_POSITIONS - 1
        jobs = ((s, t, limit) for s, t in pair_chunks(*paths))
        for sides, chunk_too_long in ordered_map(_binarize_job, jobs, opts.workers, _init_worker, (state,)):
            for k, (writer, (flat, lengths, n_unk)) in enumerate(zip(writers, sides)):
                writer.add(flat, lengths)
                unk[k] += n_unk
            too_long += chunk_too_long
            n = 2 * (len(sides[0][1]) + chunk_too_long)
            done += n
            stages.advance(n)
        for writer in writers:
            writer.close()
        split_meta[name] = {"sentences": writers[0].sentences,
                            **{lang: {"tokens": w.tokens, "unk": u} for lang, w, u in zip((src_lang, tgt_lang),
                                                                                         writers, unk)}}
        if name != "train":
            split_meta[name]["dropped_too_long"] = too_long
    stages.end(done)
    split_meta["train"]["filtered"] = {"input_sentences": input_sentences, "kept": kept, "dropped": dropped,
                                       "max_len": opts.max_len, "max_ratio": opts.max_ratio}
    return {
        "format": 1,
        "source_lang": src_lang,
        "target_lang": tgt_lang,
        "bpe_merges": opts.bpe_merges if codes is not None else None,
        "tokenizer": tokenizer,
        "vocab_size": len(vocab),
        "vocab_threshold": opts.vocab_threshold,
        "token_dtype": token_dtype(len(vocab)).name,
        "max_positions": MAX_POSITIONS,
        "splits": split_meta,
        "inputs": {name: {str(p): file_sha256(p) for p in paths} for name, paths in originals.items()},
        "versions": package_versions(),
    }

