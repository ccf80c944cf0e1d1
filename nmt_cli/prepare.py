"""`nmt prepare`: raw parallel text -> tokenized, BPE-segmented, binarized data directory."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from . import text
from .data import token_dtype, write_binarized
from .errors import NmtError
from .textio import apply_default_mode, file_sha256, read_lines, write_lines
from .vocab import Vocabulary

CHUNK = 2000  # lines per work unit; fixed so that output never depends on the worker count


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


def resolve_side(prefix: str, lang: str) -> Path:
    """`PREFIX.lang`, or `PREFIX.lang.gz` when only that exists."""
    plain = Path(f"{prefix}.{lang}")
    gz = Path(f"{prefix}.{lang}.gz")
    if plain.exists():
        return plain
    if gz.exists():
        return gz
    raise NmtError(f"{plain}: no such file (nor {gz.name})")


def read_parallel(prefix: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str], Path, Path]:
    """Both sides of a corpus, checked for equal line counts and non-emptiness."""
    src_path, tgt_path = resolve_side(prefix, src_lang), resolve_side(prefix, tgt_lang)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise NmtError(f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}")
    if not any(s.strip() for s in src) or not any(t.strip() for t in tgt):
        raise NmtError(f"empty corpus: {src_path if not any(s.strip() for s in src) else tgt_path} has no text")
    return src, tgt, src_path, tgt_path


# Worker-side state: set once per process by the pool initializer.
_worker_bpe: text.BpeApplier | None = None


def _init_worker(codes: str | None) -> None:
    global _worker_bpe
    _worker_bpe = text.BpeApplier(codes) if codes is not None else None


def _tokenize_chunk(job: tuple[str, list[str]]) -> list[str]:
    lang, lines = job
    return [text.tokenize(line, lang) if line.strip() else "" for line in lines]


def _bpe_chunk(lines: list[str]) -> list[str]:
    assert _worker_bpe is not None
    return [_worker_bpe(line) for line in lines]


def _parallel_map(fn: Callable, jobs: list, workers: int, codes: str | None, advance: Callable[[int], None]) -> list:
    """Map `fn` over jobs in order (chunked), on `workers` processes; results concatenated."""
    out: list = []
    if workers <= 1 or len(jobs) <= 1:
        _init_worker(codes)
        for job in jobs:
            result = fn(job)
            out.extend(result)
            advance(len(result))
        return out
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(workers, initializer=_init_worker, initargs=(codes,)) as pool:
        for result in pool.imap(fn, jobs):
            out.extend(result)
            advance(len(result))
    return out


def _chunks(lines: list[str]) -> list[list[str]]:
    return [lines[i : i + CHUNK] for i in range(0, len(lines), CHUNK)]


def _regroup(flat: list[str], like: dict[str, tuple[list[str], list[str]]]) -> dict[str, tuple[list[str], list[str]]]:
    """Split lines processed as one list (split by split, source then target) back into (source, target) pairs."""
    out, pos = {}, 0
    for name, (src, _) in like.items():
        n = len(src)
        out[name] = (flat[pos : pos + n], flat[pos + n : pos + 2 * n])
        pos += 2 * n
    return out


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


def package_versions() -> dict[str, str]:
    """Versions of the packages that shape the output."""
    versions = {"python": platform.python_version()}
    for name in ("nmt-cli", "sacremoses", "subword-nmt", "numpy", "torch"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def prepare(opts: PrepareOptions) -> dict:
    """Run the whole pipeline into `opts.out`; return the meta.json contents.

    The directory is built under a temporary name beside `opts.out` and renamed at the end,
    with meta.json written last, so an interrupted run never leaves a directory that looks complete.
    """
    if opts.bpe_merges < 1:
        raise NmtError(f"--bpe-merges must be at least 1 (got {opts.bpe_merges})")
    if opts.max_len < 1:
        raise NmtError(f"--max-len must be at least 1 (got {opts.max_len})")
    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise NmtError(f"{out}: already exists (use --force to overwrite)")
    src_lang, tgt_lang = opts.source_lang, opts.target_lang
    if src_lang == tgt_lang:
        raise NmtError(f"source and target language are both {src_lang!r}")

    splits = {"train": opts.train, "valid": opts.valid}
    for i, prefix in enumerate(opts.test):
        splits["test" if i == 0 else f"test{i}"] = prefix
    raw: dict[str, tuple[list[str], list[str]]] = {}
    inputs: dict[str, dict[str, str]] = {}
    for name, prefix in splits.items():
        src, tgt, src_path, tgt_path = read_parallel(prefix, src_lang, tgt_lang)
        raw[name] = (src, tgt)
        inputs[name] = {str(src_path): file_sha256(src_path), str(tgt_path): file_sha256(tgt_path)}

    total_lines = sum(2 * len(s) for s, _ in raw.values())
    workers = max(1, opts.workers)
    with Progress(
        TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} lines"),
        TimeElapsedColumn(), disable=opts.quiet, transient=False,
    ) as progress:
        task = progress.add_task("tokenize", total=total_lines)
        jobs = [(lang, chunk) for name in splits for lang, side in zip((src_lang, tgt_lang), raw[name])
                for chunk in _chunks(side)]
        flat = _parallel_map(_tokenize_chunk, jobs, workers, None, lambda n: progress.advance(task, n))
        tokenized = _regroup(flat, raw)

        progress.update(task, description="learn BPE", completed=0, total=opts.bpe_merges)
        counts = Counter(w for side in tokenized["train"] for line in side for w in line.split())
        codes = text.learn_bpe(counts, opts.bpe_merges)
        progress.update(task, completed=opts.bpe_merges)

        progress.update(task, description="apply BPE", completed=0, total=total_lines)
        jobs = [chunk for name in splits for side in tokenized[name] for chunk in _chunks(side)]
        flat = _parallel_map(_bpe_chunk, jobs, workers, codes, lambda n: progress.advance(task, n))
        segmented = _regroup(flat, raw)

        meta = write_data_dir(out, segmented, raw, codes, src_lang, tgt_lang, opts.max_len, opts.max_ratio,
                              opts.vocab_threshold, inputs, lambda n: progress.advance(task, n),
                              lambda: progress.update(task, description="binarize", completed=0, total=total_lines),
                              {"bpe_merges": opts.bpe_merges,
                               "tokenizer": {"name": "moses", "escape": False, "aggressive_dash_splits": True}})
    return meta


def write_data_dir(out: Path, segmented: dict[str, tuple[list[str], list[str]]],
                   raw: dict[str, tuple[list[str], list[str]]], codes: str, src_lang: str, tgt_lang: str,
                   max_len: int, max_ratio: float, vocab_threshold: int, inputs: dict,
                   advance: Callable[[int], None] = lambda n: None, on_binarize: Callable[[], None] = lambda: None,
                   extra_meta: dict | None = None) -> dict:
    """Filter training pairs, build the vocabulary, binarize every split and write `out` (meta.json last).

    `segmented` holds BPE text per split and side; `raw` the original text (valid/test references).
    The directory is staged under a temporary name and renamed into place at the end.
    """
    segmented = dict(segmented)
    train_src, train_tgt = segmented["train"]
    kept, dropped = filter_pairs(train_src, train_tgt, max_len, max_ratio)
    if not kept:
        raise NmtError(f"empty corpus: every training pair was filtered out ({dropped})")
    segmented["train"] = ([train_src[i] for i in kept], [train_tgt[i] for i in kept])
    vocab = Vocabulary.build((line for side in segmented["train"] for line in side), vocab_threshold)
    on_binarize()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        (staging / "bpe.codes").write_text(codes, encoding="utf-8")
        vocab.save(staging / "vocab.txt")
        split_meta = {}
        for name in segmented:
            sides = {}
            for k, (lang, lines) in enumerate(zip((src_lang, tgt_lang), segmented[name])):
                ids = [vocab.encode(line) for line in lines]
                write_binarized(staging / f"{name}.{lang}", ids, len(vocab))
                sides[lang] = {"tokens": sum(len(x) for x in ids), "unk": sum(x.count(vocab.unk) for x in ids)}
                if name != "train":
                    write_lines(staging / f"{name}.bpe.{lang}", lines)
                    write_lines(staging / f"{name}.raw.{lang}", raw[name][k])
                advance(len(lines))
            split_meta[name] = {"sentences": len(segmented[name][0]), **sides}
        split_meta["train"]["filtered"] = {
            "input_sentences": len(train_src), "kept": len(kept), "dropped": dropped,
            "max_len": max_len, "max_ratio": max_ratio,
        }
        meta = {
            "format": 1,
            "source_lang": src_lang,
            "target_lang": tgt_lang,
            **(extra_meta or {}),
            "vocab_size": len(vocab),
            "vocab_threshold": vocab_threshold,
            "token_dtype": token_dtype(len(vocab)).name,
            "splits": split_meta,
            "inputs": inputs,
            "versions": package_versions(),
        }
        apply_default_mode(staging, directory=True)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return meta
