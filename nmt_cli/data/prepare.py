"""`nmt prepare`: raw parallel text -> normalized, tokenized, segmented (BPE or SentencePiece), binarized data
directory.

Everything streams: each stage reads its input in fixed chunks of lines, runs them on worker processes in
order, and writes its output to files in the staging directory, so memory does not grow with the corpus
(the largest things held are the word counts for BPE learning and each worker's segmentation cache).
Stages: normalize + tokenize (counting training words) -> learn BPE -> apply BPE (filtering training pairs,
counting pieces) -> vocabulary -> binarize. With SentencePiece: (normalize) -> learn SentencePiece on the raw
training text of both sides -> apply it (filtering) -> its own vocabulary -> binarize.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from itertools import islice
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nmt_cli.errors import NmtError
from nmt_cli.text import moses as text
from nmt_cli.text.bpe import learn_bpe_codes
from nmt_cli.text.languages import is_chinese
from nmt_cli.text.segment import (
    CHARACTER_COVERAGE,
    SPM_TYPES,
    TOKENIZERS,
    SentencePiece,
    check_tags,
    has_han,
    plain_spaces,
    split_tag,
    train_sentencepiece,
)
from nmt_cli.text.vocab import Vocabulary
from nmt_cli.textio import (
    atomic_path,
    check_replaceable,
    file_sha256,
    is_prepared_data_dir,
    iter_lines,
    publish_directory,
    staging_directory,
)

from .binarized import CORPUS_FILE, BinarizedWriter, dropout_split, is_dropout_split, token_dtype
from .options import MAX_RATIO, PrepareOptions  # noqa: F401 (the options' home is options.py)
from .workers import ordered_map

CHUNK = 2000  # lines per work unit; fixed so that output never depends on the worker count
MAX_POSITIONS = 1024  # the model's positions (ModelConfig.max_positions): a sentence plus </s> must fit
# A filter that drops more than this share of the training pairs says so on stderr, not only in its summary.
LOUD_DROP_SHARE = 0.05


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


DROP_REASONS = ("empty", "too_long", "ratio", "copy", "duplicate", "language")


LANGID_INSTALL = "--langid needs py3langid (its model ships in the package): pip install py3langid"


def language_identifier() -> Callable[[str, str], float]:
    """`identify(text, lang)`: the probability py3langid gives `lang` (ISO 639-1, as -s/-t) for `text`, with
    its probabilities normalized over its languages."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise NmtError(LANGID_INSTALL) from None
    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)

    def identify(text: str, lang: str) -> float:
        return dict(identifier.rank(text)).get(lang, 0.0) if text.strip() else 0.0

    identify.languages = set(identifier.nb_classes)  # type: ignore[attr-defined]
    return identify


def check_langid(opts: PrepareOptions) -> None:
    """One line, before any work, for a --langid that cannot run: no py3langid, a threshold outside [0, 1], a
    language it does not know."""
    if opts.langid is None:
        return
    if not 0.0 <= opts.langid <= 1.0:
        raise NmtError(f"--langid {opts.langid}: a probability between 0 and 1 (0.5: more likely than not)")
    known = language_identifier().languages  # type: ignore[attr-defined]
    for lang in (opts.source_lang, opts.target_lang):
        if lang not in known:
            raise NmtError(f"--langid: py3langid knows no language {lang!r} (it knows ISO 639-1 codes such as en, "
                           "de, fr, zh)")


def filter_pairs(src: list[str], tgt: list[str], max_len: int, max_ratio: float | None,
                 remove_copies: bool = True) -> tuple[list[int], dict[str, int]]:
    """Indices of training pairs kept (like Moses clean-corpus-n, on pieces; no ratio test when `max_ratio` is
    None; with `remove_copies`, no pair whose source is its target), and drop counts by reason (duplicates are
    counted by the caller, which sees every chunk)."""
    kept: list[int] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for i, (s, t) in enumerate(zip(src, tgt)):
        ls, lt = len(s.split()), len(t.split())
        if ls == 0 or lt == 0:
            dropped["empty"] += 1
        elif remove_copies and s == t:
            dropped["copy"] += 1
        elif ls > max_len or lt > max_len:
            dropped["too_long"] += 1
        elif max_ratio is not None and (ls > max_ratio * lt or lt > max_ratio * ls):
            dropped["ratio"] += 1
        else:
            kept.append(i)
    return kept, dropped


# ------------------------------------------------------------------ worker side (state set once per process)
_worker: dict = {}


def _init_worker(state: dict) -> None:
    _worker.clear()
    _worker.update(state)
    if state.get("sentencepiece") is not None:
        # text arrives normalized already: normalize=False
        segmenter = SentencePiece(state["sentencepiece"], tags=state.get("tags", ()),
                                  target_model=state.get("target_sentencepiece"))
        target = segmenter.target_side()
        _worker["bpe"] = lambda line: segmenter.segment(line, "")
        _worker["target_bpe"] = lambda line: target.segment(line, "")
    elif state.get("codes") is not None:
        _worker["bpe"] = _worker["target_bpe"] = text.BpeApplier(state["codes"], keep=state.get("tags", ()))
        if state.get("bpe_dropout"):
            _worker["dropout_bpe"] = text.DropoutBpe(state["codes"], state["bpe_dropout"], keep=state.get("tags", ()))
    if state.get("langid") is not None:
        _worker["identify"] = language_identifier()
    if state.get("symbols") is not None:
        _worker["vocab"] = Vocabulary(state["symbols"])
        _worker["target_vocab"] = Vocabulary(state.get("target_symbols") or state["symbols"])


def _preprocess(line: str, lang: str) -> str:
    tag, line = split_tag(line, _worker.get("tags", ()))
    if tag:
        return f"{tag} {_preprocess(line, lang)}".rstrip()
    if _worker.get("lowercase"):
        line = line.lower()
    if _worker["normalize"]:
        line = text.normalize_punctuation(line, lang)
    if _worker.get("tokenizer") == "sentencepiece":  # SentencePiece reads raw text
        return plain_spaces(line) if line.strip() else ""
    if not line.strip():
        return ""
    if _worker.get("pipeline") == "fsmt":  # a model made elsewhere: fairseq's WMT19 tokenization
        return text.fsmt_tokenize(line, lang)
    return text.tokenize(line, lang)


def _tokenize_job(job: tuple[list[str], list[str], bool]) -> tuple[list[str], list[str], Counter | None, list[int]]:
    """Normalize and tokenize a chunk of pairs; count its words when it is training data, and on a Chinese side
    the lines that hold Chinese characters."""
    src, tgt, count = job
    if _worker.get("target_token"):  # a multi-target model's token (">>fra<<") begins every source line
        src = [f"{_worker['target_token']} {line}" if line.strip() else line for line in src]
    src_tok = [_preprocess(line, _worker["src_lang"]) for line in src]
    tgt_tok = [_preprocess(line, _worker["tgt_lang"]) for line in tgt]
    counts = Counter(w for lines in (src_tok, tgt_tok) for line in lines for w in line.split()) if count else None
    han = [sum(map(has_han, lines)) if is_chinese(lang) else 0
           for lines, lang in ((src, _worker["src_lang"]), (tgt, _worker["tgt_lang"]))]
    return src_tok, tgt_tok, counts, han


class PairSet:
    """The training pairs kept so far, as 8-byte digests (about 60 bytes of memory per pair): a pair already
    seen is a duplicate."""

    def __init__(self) -> None:
        self.digests: set[bytes] = set()

    def first_time(self, src: list[str], tgt: list[str], dropped: dict, pieces: Counter) -> tuple[list, list]:
        """The pairs of a chunk not seen before (in order); each duplicate counted in `dropped` and its pieces
        taken out of `pieces`, so the vocabulary counts what is kept."""
        import hashlib

        kept_src, kept_tgt = [], []
        for s, t in zip(src, tgt):
            digest = hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=8).digest()
            if digest in self.digests:
                dropped["duplicate"] += 1
                pieces.subtract(s.split())
                pieces.subtract(t.split())
            else:
                self.digests.add(digest)
                kept_src.append(s)
                kept_tgt.append(t)
        return kept_src, kept_tgt


def _segment_job(job: tuple[list[str], list[str], bool]) -> tuple[list[str], list[str], dict | None, Counter | None]:
    """Apply BPE to a chunk of pairs; training chunks are filtered and their pieces counted."""
    src, tgt, is_train = job
    words = (src, tgt)  # before BPE: what language identification reads
    bpe = _worker.get("bpe")
    if bpe is not None:
        src, tgt = [bpe(line) for line in src], [_worker["target_bpe"](line) for line in tgt]
    if not is_train:
        return src, tgt, None, None
    kept, dropped = filter_pairs(src, tgt, _worker["max_len"], _worker["max_ratio"], _worker["remove_copies"])
    if _worker.get("identify") is not None:
        identify, threshold = _worker["identify"], _worker["langid"]
        langs = (_worker["src_lang"], _worker["tgt_lang"])
        identified = [i for i in kept if all(identify(side[i], lang) >= threshold for side, lang in zip(words, langs))]
        dropped["language"] = len(kept) - len(identified)
        kept = identified
    src, tgt = [src[i] for i in kept], [tgt[i] for i in kept]
    pieces = Counter(p for lines in (src, tgt) for line in lines for p in line.split())
    return src, tgt, dropped, pieces


def _dropout_job(job: tuple[list[str], list[str], int, int]) -> tuple[list[str], list[str], Counter]:
    """Draw `draw` of BPE-dropout for a chunk of kept training pairs (their deterministic segmentation), and its
    pieces. A line the draw makes longer than --max-len keeps its deterministic segmentation, so that every
    draw holds the same pairs, each within the model's positions."""
    src, tgt, draw, chunk = job
    dropout, max_len = _worker["dropout_bpe"], _worker["max_len"]
    out = []
    for side, lines in enumerate((src, tgt)):
        drawn = dropout.segment_lines([text.remove_bpe(line) for line in lines], f"{draw} {chunk} {side}")
        out.append([d if len(d.split()) <= max_len else line for d, line in zip(drawn, lines)])
    return out[0], out[1], Counter(p for lines in out for line in lines for p in line.split())


def _binarize_job(job: tuple[list[str], list[str], int | None]):
    """Token ids of a chunk of pairs (flat arrays and lengths per side); pairs over `limit` pieces are dropped."""
    import numpy as np

    src, tgt, limit = job
    vocab, target_vocab = _worker["vocab"], _worker["target_vocab"]
    src_ids, tgt_ids = [vocab.encode(line) for line in src], [target_vocab.encode(line) for line in tgt]
    dropped = 0
    if limit is not None:
        keep = [i for i in range(len(src_ids)) if len(src_ids[i]) <= limit and len(tgt_ids[i]) <= limit]
        dropped = len(src_ids) - len(keep)
        src_ids, tgt_ids = [src_ids[i] for i in keep], [tgt_ids[i] for i in keep]
    dtype = token_dtype(max(len(vocab), len(target_vocab)))
    out = []
    for ids in (src_ids, tgt_ids):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((i for x in ids for i in x), dtype=dtype, count=int(lengths.sum()))
        out.append((flat, lengths, int((flat == vocab.unk).sum())))
    return out, dropped


# ------------------------------------------------------------------ main side
class _Stages:
    """Timing, lines and peak memory of each stage, with a progress bar per stage.

    The bars are redrawn by the stages themselves (at most 10 times a second), not by rich's refresh thread:
    worker processes are forked at each stage, and a fork while another thread runs can hand the child a lock
    that thread held (the output stream's), which nothing in the child would ever release."""

    REDRAW_S = 0.1

    def __init__(self, quiet: bool, on_stage: Callable[[dict], None] | None, staging: Path) -> None:
        self.progress = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), disable=quiet,
                                 auto_refresh=False)
        self.on_stage, self.records, self.staging = on_stage, [], staging
        self.task, self.start, self.name, self.unit = None, 0.0, "", "lines"
        self.drawn = 0.0

    def begin(self, name: str, total: int | None, unit: str = "lines") -> None:
        self.name, self.start, self.unit = name, time.perf_counter(), unit
        self.task = self.progress.add_task(name, total=total, unit=unit)
        self.redraw(force=True)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)
        self.redraw()

    def redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.drawn >= self.REDRAW_S:
            self.progress.refresh()
            self.drawn = now

    def end(self, done: int) -> None:
        self.progress.update(self.task, completed=done, total=done)
        self.redraw(force=True)
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
    for name in ("nmt-cli", "sacremoses", "subword-nmt", "sentencepiece", "numpy", "torch"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def resolved_options(opts: PrepareOptions, from_model: bool = True) -> PrepareOptions:
    """The options with what they leave to be computed filled in: every core for --workers 0, Moses for no
    --tokenizer; one line where no languages are given (which only `from_model`, the command's --from-model
    flag, may give)."""
    if not opts.source_lang or not opts.target_lang:
        unless = " (unless --from-model gives them)" if from_model else ""
        raise NmtError(f"--source-lang/-s and --target-lang/-t are required{unless}")
    if opts.workers < 0:
        raise NmtError(f"--workers must be at least 1, or 0 for all cores (got {opts.workers})")
    return replace(opts, workers=opts.workers or os.cpu_count() or 1, tokenizer=opts.tokenizer or "moses")


def _check_options(opts: PrepareOptions) -> Path:
    if opts.bpe_merges < 1:
        raise NmtError(f"--bpe-merges must be at least 1 (got {opts.bpe_merges})")
    if not 1 <= opts.max_len <= MAX_POSITIONS - 1:
        raise NmtError(f"--max-len must be between 1 and {MAX_POSITIONS - 1} (got {opts.max_len})")
    if opts.max_ratio is not None and not opts.max_ratio >= 1:
        raise NmtError(f"--max-ratio must be at least 1 (got {opts.max_ratio})")
    if opts.tokenizer not in TOKENIZERS:
        raise NmtError(f"unknown --tokenizer {opts.tokenizer!r} (choose from {', '.join(TOKENIZERS)})")
    if opts.spm_type not in SPM_TYPES:
        raise NmtError(f"unknown --spm-type {opts.spm_type!r} (choose from {', '.join(SPM_TYPES)})")
    if opts.tokenizer == "sentencepiece" and opts.vocab_size < 264:
        raise NmtError(f"--vocab-size must be at least 264 for SentencePiece: 256 byte pieces, 4 specials and a "
                       f"few more (got {opts.vocab_size})")
    if not 0 <= opts.bpe_dropout < 1:
        raise NmtError(f"--bpe-dropout must be at least 0 and below 1 (got {opts.bpe_dropout})")
    if opts.bpe_dropout_copies < 1:
        raise NmtError(f"--bpe-dropout-copies must be at least 1 (got {opts.bpe_dropout_copies})")
    if opts.bpe_dropout and opts.tokenizer == "sentencepiece":
        raise NmtError("--bpe-dropout drops BPE merges: it needs --tokenizer moses, not sentencepiece")
    if opts.bpe_dropout and opts.from_model is not None:
        raise NmtError(f"{opts.from_model}: --bpe-dropout with --from-model: the model's vocabulary lacks the smaller "
                       "pieces that dropout makes")
    if opts.spm_sample < 1:
        raise NmtError(f"--spm-sample must be at least 1 (got {opts.spm_sample})")
    check_langid(opts)
    if opts.vocab_threshold < 1:
        raise NmtError(f"--vocab-threshold must be at least 1 (got {opts.vocab_threshold})")
    if opts.source_lang == opts.target_lang:
        raise NmtError(f"source and target language are both {opts.source_lang!r}")
    check_tags(opts.tags)
    out = Path(opts.out)
    if opts.force and out.is_dir():
        inputs = [Path(f"{prefix}.{lang}{gz}") for prefix in (*opts.train_prefixes, opts.valid, *opts.test)
                  for lang in (opts.source_lang, opts.target_lang) for gz in ("", ".gz")]
        inside = [p for p in [*inputs, *([opts.from_model] if opts.from_model else [])]
                  if p.exists() and out.resolve() in p.resolve().parents]
        if inside:
            raise NmtError(f"{out}: holds the input file {inside[0]}, which --force would delete: choose another --out")
    check_replaceable(out, opts.force, "a data dir of nmt prepare", is_prepared_data_dir, "--out")
    return out


def is_training(name: str) -> bool:
    """Whether an input of `_split_inputs` is a training corpus: "train", or "train.K" for the K-th further one."""
    return name == "train" or name.startswith("train.")


def corpus_number(name: str) -> int:
    """The index of a training input among the corpora ("train": 0, "train.K": K)."""
    return 0 if name == "train" else int(name.split(".", 1)[1])


def _split_inputs(opts: PrepareOptions) -> dict[str, tuple[Path, Path]]:
    prefixes = opts.train_prefixes
    opts.corpora()  # weights checked before any work
    splits = {"train": prefixes[0], **{f"train.{k}": p for k, p in enumerate(prefixes[1:], start=1)},
              "valid": opts.valid}
    for i, prefix in enumerate(opts.test):
        splits["test" if i == 0 else f"test{i}"] = prefix
    return {name: (resolve_side(p, opts.source_lang), resolve_side(p, opts.target_lang)) for name, p in splits.items()}


def prepare(opts: PrepareOptions, on_stage: Callable[[dict], None] | None = None) -> dict:
    """Run the whole pipeline into `opts.out`; return the meta.json contents.

    The directory is built under a temporary name beside `opts.out` and renamed at the end, with meta.json
    written last, so an interrupted run never leaves a directory that looks complete. `on_stage` receives
    each stage's record (name, seconds, lines, peak RSS in MB) as it ends.
    """
    model, made = None, FromModel()
    if opts.from_model is not None:  # the model's languages, tokenizer, codes or SentencePiece model, vocabulary
        opts, made = _model_preprocessing(opts)
        model = (made.codes, made.sentencepiece, made.vocab)
    opts = resolved_options(opts)
    out = _check_options(opts)
    inputs = _split_inputs(opts)
    sentencepiece = opts.tokenizer == "sentencepiece"
    with staging_directory(out) as staging:
        stages = _Stages(opts.quiet, on_stage, staging)
        with stages.progress:
            work = staging / ".work"
            work.mkdir()
            learn_bpe = model is None and not sentencepiece
            tokenized, counts = _tokenize(inputs, work, staging, opts, stages, count=learn_bpe, made=made)
            codes, spm_model, vocab = model or (None, None, None)
            if model is None and sentencepiece:
                stages.begin("learn SentencePiece", None, unit="pieces")
                files = [path for name, pair in tokenized.items() if is_training(name) for path in pair]
                spm_model = train_sentencepiece(files, opts.vocab_size, opts.spm_type, opts.spm_sample,
                                                opts.workers, tags=opts.tags)
                vocab = Vocabulary(SentencePiece(spm_model).symbols())
                stages.end(len(vocab))
            elif model is None:
                for tag in opts.tags:  # one symbol whatever the merges: none spent on it
                    counts.pop(tag, None)
                stages.begin("learn BPE", opts.bpe_merges, unit="merges")
                codes = learn_bpe_codes(counts, opts.bpe_merges, on_merge=lambda _: stages.advance(1))
                stages.end(len(codes.splitlines()) - 1)
            del counts
            meta = _segment_and_binarize(tokenized, staging, codes, opts, stages,
                                         made.tokenizer or _tokenizer_meta(opts, spm_model), inputs, vocab=vocab,
                                         sentencepiece=spm_model, made=made)
        if model is not None:
            meta["from_model"] = {"path": str(opts.from_model), "sha256": file_sha256(opts.from_model)}
            meta["bpe_merges"] = len(codes.splitlines()) - 1 if codes is not None else None
        _finish(staging, out, meta)
    return meta


def _tokenizer_meta(opts: PrepareOptions, spm_model: bytes | None = None) -> dict:
    """How text was tokenized, as meta.json and checkpoints record it (translate repeats it)."""
    extra = {**({"tags": list(opts.tags)} if opts.tags else {}), **({"lowercase": True} if opts.lowercase else {})}
    if opts.tokenizer == "sentencepiece":
        assert spm_model is not None
        import hashlib

        return {"name": "sentencepiece", "model_type": opts.spm_type, "vocab_size": opts.vocab_size,
                "character_coverage": CHARACTER_COVERAGE, "byte_fallback": True, "sample": opts.spm_sample,
                "normalize_punctuation": opts.normalize, "sha256": hashlib.sha256(spm_model).hexdigest(), **extra}
    return {"name": "moses", "escape": False, "aggressive_dash_splits": True, "normalize_punctuation": opts.normalize,
            **extra}


@dataclass(frozen=True)
class FromModel:
    """What --from-model takes from a model: its BPE codes or SentencePiece model, its vocabulary, and what a
    model made elsewhere may add (`nmt import transformers`): the target side's own vocabulary and SentencePiece
    model, its tokenizer record as it stands (fairseq's tokenization), a token that begins every source line."""

    codes: str | None = None
    sentencepiece: bytes | None = None
    vocab: Vocabulary | None = None
    target_vocab: Vocabulary | None = None
    target_sentencepiece: bytes | None = None
    tokenizer: dict | None = None
    target_token: str = ""


def _model_preprocessing(opts: PrepareOptions) -> tuple[PrepareOptions, FromModel]:
    """For --from-model: the options with the model's languages, tokenizer and normalization filled in, and what
    it segments with (`FromModel`). A language or tokenizer given on the command line that contradicts the model
    is an error."""
    from nmt_cli.model.checkpoint import load_checkpoint, require_keys

    state = load_checkpoint(opts.from_model)
    require_keys(state, opts.from_model, ("vocab", "bpe_codes", "source_lang", "target_lang"))
    given = (opts.source_lang or state["source_lang"], opts.target_lang or state["target_lang"])
    if given != (state["source_lang"], state["target_lang"]):
        raise NmtError(f"{opts.from_model}: the model translates {state['source_lang']}->{state['target_lang']}, "
                       f"not {given[0]}->{given[1]}")
    tokenizer = state.get("tokenizer") or {}
    name = tokenizer.get("name", "moses")
    if opts.tokenizer is not None and opts.tokenizer != name:
        raise NmtError(f"{opts.from_model}: the model was trained with --tokenizer {name}, not {opts.tokenizer}")
    if opts.lowercase and not tokenizer.get("lowercase"):
        raise NmtError(f"{opts.from_model}: the model was trained on text as written, not lowercased: leave out "
                       "--lowercase")
    opts = replace(opts, source_lang=state["source_lang"], target_lang=state["target_lang"], tokenizer=name,
                   normalize=bool(tokenizer.get("normalize_punctuation", False)),
                   lowercase=bool(tokenizer.get("lowercase")),
                   tags=tuple(tokenizer.get("tags", ())))
    if name == "sentencepiece":
        if not state.get("sentencepiece"):
            raise NmtError(f"{opts.from_model}: checkpoint lacks sentencepiece (its tokenizer's model)")
        opts = replace(opts, spm_type=tokenizer.get("model_type", opts.spm_type),
                       vocab_size=tokenizer.get("vocab_size", opts.vocab_size),
                       spm_sample=tokenizer.get("sample", opts.spm_sample))
    target_vocab = state.get("target_vocab")
    return opts, FromModel(
        codes=None if name == "sentencepiece" else state["bpe_codes"],
        sentencepiece=state["sentencepiece"] if name == "sentencepiece" else None, vocab=Vocabulary(state["vocab"]),
        target_vocab=Vocabulary(target_vocab) if target_vocab else None,
        target_sentencepiece=state.get("target_sentencepiece"), tokenizer=tokenizer or None,
        target_token=state.get("target_token", ""))


def binarize_segmented(opts: PrepareOptions, codes: str) -> dict:
    """`nmt binarize`: your own tokenized + BPE text -> data dir; valid/test raw text is derived from it."""
    opts = resolved_options(opts, from_model=False)
    out = _check_options(opts)
    inputs = _split_inputs(opts)
    tokenizer = _tokenizer_meta(replace(opts, tokenizer="moses", normalize=False))
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
              stages: _Stages, count: bool = True,
              made: FromModel | None = None) -> tuple[dict[str, tuple[Path, Path]], Counter]:
    """Stage 1: normalize + tokenize every split into `work`, counting training words; valid/test raw text is
    copied into `staging` on the way."""
    src_lang, tgt_lang = opts.source_lang, opts.target_lang
    made = made or FromModel()
    tokenizer = made.tokenizer or {}
    state = {"src_lang": src_lang, "tgt_lang": tgt_lang, "normalize": opts.normalize, "tokenizer": opts.tokenizer,
             "tags": tuple(opts.tags), "pipeline": tokenizer.get("pipeline", ""),
             "lowercase": opts.lowercase, "target_token": made.target_token}
    counts: Counter = Counter()
    tokenized = {}
    first = "tokenize" if opts.tokenizer == "moses" else "read"  # SentencePiece reads raw text
    stages.begin(f"normalize+{first}" if opts.normalize else first, None)
    done = 0
    for name, paths in inputs.items():
        is_train = is_training(name)
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
        pairs_read, han = 0, [0, 0]
        for src_tok, tgt_tok, chunk_counts, chunk_han in ordered_map(_tokenize_job, jobs(), opts.workers, _init_worker,
                                                                     (state,)):
            raw = raw_chunks.pop(0)
            for writer, lines in zip(writers, (src_tok, tgt_tok, *(raw or ()))):
                writer.write(lines)
            nonempty = [nonempty[0] or any(src_tok), nonempty[1] or any(tgt_tok)]
            if chunk_counts is not None:
                counts.update(chunk_counts)
            pairs_read += len(src_tok)
            han = [han[0] + chunk_han[0], han[1] + chunk_han[1]]
            done += 2 * len(src_tok)
            stages.advance(2 * len(src_tok))
        for writer in writers:
            writer.close()
        for side, path in enumerate(paths):
            if not nonempty[side]:
                raise NmtError(f"empty corpus: {path} has no text")
            lang = (src_lang, tgt_lang)[side]
            if is_train and is_chinese(lang) and han[side] < pairs_read / 2:
                warn(f"{path}: only {han[side]:,} of {pairs_read:,} lines hold Chinese characters, for language "
                     f"{lang!r} (are -s/-t the right way round?)")
    stages.end(done)
    return tokenized, counts


def _segment_and_binarize(inputs: dict[str, tuple[Path, Path]], staging: Path, codes: str | None,
                          opts: PrepareOptions, stages: _Stages, tokenizer: dict, originals: dict,
                          stored_codes: str | None = None, vocab: Vocabulary | None = None,
                          sentencepiece: bytes | None = None, made: FromModel | None = None) -> dict:
    """Stages 3-5: apply BPE or the `sentencepiece` model (or take the text as segmented when both are None),
    filter training pairs, build the vocabulary from the kept training pieces (unless `vocab` is given),
    binarize every split. Returns meta.json's contents."""
    import numpy as np

    src_lang, tgt_lang = opts.source_lang, opts.target_lang
    work = staging / ".work"
    work.mkdir(exist_ok=True)
    max_ratio = opts.ratio_limit()
    made = made or FromModel()
    state = {"codes": codes, "sentencepiece": sentencepiece, "target_sentencepiece": made.target_sentencepiece,
             "tags": tuple(opts.tags), "max_len": opts.max_len, "langid": opts.langid,
             "max_ratio": max_ratio, "remove_copies": opts.remove_copies,
             "src_lang": src_lang, "tgt_lang": tgt_lang, "bpe_dropout": opts.bpe_dropout}
    pieces: Counter = Counter()
    dropped = dict.fromkeys(DROP_REASONS, 0)
    seen = PairSet() if opts.remove_duplicates else None
    input_sentences = 0
    segmented, sentences = {}, {}
    corpora = opts.corpora() if "train" in inputs else []
    per_corpus = [{"input_sentences": 0, "kept": 0, "dropped": dict.fromkeys(DROP_REASONS, 0)} for _ in corpora]
    corpus_of_pair: list = []  # per kept training pair, its corpus (several corpora only)
    stages.begin("apply SentencePiece" if sentencepiece else "apply BPE" if codes is not None else "filter", None)
    done = 0
    writers_of: dict[str, list] = {}
    for name, paths in inputs.items():
        is_train = is_training(name)
        out_name = "train" if is_train else name  # every training corpus goes into one train split
        target = work if is_train else staging
        if out_name not in writers_of:
            segmented[out_name] = (target / f"{out_name}.bpe.{src_lang}", target / f"{out_name}.bpe.{tgt_lang}")
            writers_of[out_name] = [_Writer(p) for p in segmented[out_name]]
            sentences[out_name] = 0
        writers = list(writers_of[out_name])
        # nmt binarize: raw valid/test text comes from the BPE text
        derive_raw = codes is None and sentencepiece is None and not is_train
        if derive_raw:
            writers += [_Writer(staging / f"{name}.raw.{lang}") for lang in (src_lang, tgt_lang)]
        jobs = ((s, t, is_train) for s, t in pair_chunks(*paths))
        for src, tgt, chunk_dropped, chunk_pieces in ordered_map(_segment_job, jobs, opts.workers, _init_worker,
                                                                 (state,)):
            if chunk_dropped is not None and seen is not None:
                src, tgt = seen.first_time(src, tgt, chunk_dropped, chunk_pieces)
            raws = ()
            if derive_raw:
                raws = ([text.detokenize(text.remove_bpe(x), src_lang) for x in src],
                        [text.detokenize(text.remove_bpe(x), tgt_lang) for x in tgt])
            for writer, lines in zip(writers, (src, tgt, *raws)):
                writer.write(lines)
            if chunk_dropped is not None:
                record = per_corpus[corpus_number(name)]
                record["input_sentences"] += len(src) + sum(chunk_dropped.values())
                record["kept"] += len(src)
                input_sentences += len(src) + sum(chunk_dropped.values())
                for reason, n in chunk_dropped.items():
                    dropped[reason] += n
                    record["dropped"][reason] += n
                pieces.update(chunk_pieces)
                if len(corpora) > 1:
                    corpus_of_pair.append(np.full(len(src), corpus_number(name), dtype=np.uint16))
            sentences[out_name] += len(src)
            done += 2 * len(src)
            stages.advance(2 * len(src))
        for writer in writers[2:]:
            writer.close()
    for writers in writers_of.values():
        for writer in writers:
            writer.close()
    stages.end(done)
    kept = sentences["train"]
    if kept == 0:
        raise NmtError(f"empty corpus: every training pair was filtered out ({dropped})")
    reasons = {"too_long": f"over --max-len {opts.max_len}", "ratio": f"over --max-ratio {max_ratio}",
               "empty": "with an empty side", "copy": "as copies (source = target; --keep-copies keeps them)",
               "duplicate": "as duplicates (--keep-duplicates keeps them)",
               "language": f"as another language (--langid {opts.langid})"}
    for reason, n in dropped.items():
        if n > LOUD_DROP_SHARE * input_sentences:
            warn(f"{originals['train'][0]}: {n:,} of {input_sentences:,} training pairs "
                 f"({100 * n / input_sentences:.0f}%) dropped {reasons[reason]}")

    if opts.bpe_dropout and codes is not None:
        stages.begin("BPE-dropout", opts.bpe_dropout_copies * 2 * kept)
        for draw in range(1, opts.bpe_dropout_copies + 1):
            name = dropout_split(draw)
            segmented[name] = (work / f"{name}.bpe.{src_lang}", work / f"{name}.bpe.{tgt_lang}")
            writers = [_Writer(p) for p in segmented[name]]
            jobs = ((s, t, draw, chunk) for chunk, (s, t) in enumerate(pair_chunks(*segmented["train"])))
            for src, tgt, chunk_pieces in ordered_map(_dropout_job, jobs, opts.workers, _init_worker, (state,)):
                for writer, lines in zip(writers, (src, tgt)):
                    writer.write(lines)
                pieces.update(chunk_pieces)
                stages.advance(2 * len(src))
            for writer in writers:
                writer.close()
        stages.end(opts.bpe_dropout_copies * 2 * kept)

    stages.begin("vocabulary", None, unit="pieces")
    vocab = vocab or Vocabulary.from_counts(pieces, opts.vocab_threshold)
    vocab.save(staging / "vocab.txt")
    target_vocab = made.target_vocab or vocab
    if made.target_vocab is not None:
        made.target_vocab.save(staging / "target-vocab.txt")
    if made.target_sentencepiece is not None:
        (staging / "target-spm.model").write_bytes(made.target_sentencepiece)
    if sentencepiece is not None:
        (staging / "spm.model").write_bytes(sentencepiece)
    else:
        (staging / "bpe.codes").write_text(codes if codes is not None else (stored_codes or ""), encoding="utf-8")
    stages.end(len(vocab))
    del pieces

    stages.begin("binarize", 2 * sum(sentences.values()))
    state = {"symbols": vocab.symbols, "target_symbols": target_vocab.symbols}
    largest = max(len(vocab), len(target_vocab))
    split_meta: dict[str, dict] = {}
    done = 0
    for name, paths in segmented.items():
        dtype = token_dtype(largest)
        writers = [BinarizedWriter(staging / f"{name}.{lang}", dtype) for lang in (src_lang, tgt_lang)]
        unk = [0, 0]
        too_long = 0
        limit = None if name == "train" or is_dropout_split(name) else MAX_POSITIONS - 1
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
                                       "max_len": opts.max_len, "max_ratio": max_ratio}
    if len(corpora) > 1:  # which corpus each training pair came from, for `nmt train`'s weighted epochs
        np.save(staging / CORPUS_FILE, np.concatenate(corpus_of_pair))
    return {
        "format": 1,
        "source_lang": src_lang,
        "target_lang": tgt_lang,
        "bpe_merges": opts.bpe_merges if codes is not None and sentencepiece is None else None,
        "tokenizer": tokenizer,
        "vocab_size": len(vocab),
        **({"target_vocab_size": len(target_vocab)} if made.target_vocab is not None else {}),
        **({"target_token": made.target_token} if made.target_token else {}),
        "vocab_threshold": opts.vocab_threshold,
        **({"bpe_dropout": {"p": opts.bpe_dropout, "copies": opts.bpe_dropout_copies}}
           if opts.bpe_dropout and codes is not None else {}),
        "token_dtype": token_dtype(largest).name,
        "max_positions": MAX_POSITIONS,
        "splits": split_meta,
        **({"corpora": [{**c, **r} for c, r in zip(corpora, per_corpus)]} if corpora else {}),
        "inputs": {name: {str(p): file_sha256(p) for p in paths} for name, paths in originals.items()},
        "versions": package_versions(),
    }



def warn(message: str) -> None:
    """A warning the user must see, quiet or not: one line on stderr."""
    print(f"nmt prepare: warning: {message}", file=sys.stderr, flush=True)


def summary_line(meta: dict, out: Path) -> str:
    """What `nmt prepare` wrote, in one line: vocabulary, sentences per split, training pairs dropped and why."""
    dropped = meta["splits"]["train"]["filtered"]["dropped"]
    too_long = {k: v["dropped_too_long"] for k, v in meta["splits"].items() if v.get("dropped_too_long")}
    return (f"wrote {out}: vocabulary {meta['vocab_size']:,}, "
            + ", ".join(f"{k} {v['sentences']:,}" for k, v in meta["splits"].items() if not is_dropout_split(k))
            + " sentences; "
            + f"training pairs dropped: {dropped['empty']:,} empty, {dropped['too_long']:,} over --max-len, "
            + f"{dropped['ratio']:,} over --max-ratio, {dropped.get('copy', 0):,} copies, "
            + f"{dropped.get('duplicate', 0):,} duplicates"
            + (f", {dropped['language']:,} in another language" if dropped.get("language") else "")
            + "".join(f"; {k} pairs over the model's positions: {n:,}" for k, n in too_long.items())
            + (f"; BPE-dropout {drop['p']:g}: {drop['copies']} draws of train" if (drop := meta.get("bpe_dropout"))
               else ""))


def corpora_table(meta: dict):
    """What each training corpus gave (pairs read, kept, dropped by each filter) and its weight, as a rich
    table; None for data from one corpus."""
    from rich.table import Table

    corpora = meta.get("corpora") or []
    if len(corpora) < 2:
        return None
    from rich import box

    table = Table(title="training corpora", box=box.SIMPLE_HEAD)
    columns = ["corpus", "weight", "read", "kept", "empty", "too long", "ratio", "copies", "repeats", "language"]
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", min_width=len(column), no_wrap=True)
    for c in corpora:
        d = c["dropped"]
        table.add_row(c["name"], f"{c['weight']:g}", f"{c['input_sentences']:,}", f"{c['kept']:,}",
                      *(f"{d.get(k, 0):,}" for k in DROP_REASONS))
    return table


def learn_codes_from_files(inputs: list[Path], output: Path, merges: int, min_frequency: int = 2) -> None:
    """`nmt learn-bpe`: joint BPE codes learned from the words of already tokenized files, written to `output`."""
    if merges < 1:
        raise NmtError(f"--merges must be at least 1 (got {merges})")
    if min_frequency < 1:
        raise NmtError(f"--min-frequency must be at least 1 (got {min_frequency})")
    counts: Counter[str] = Counter()
    for path in inputs:
        for line in iter_lines(path):
            counts.update(line.split())
    if not counts:
        raise NmtError("empty corpus: the inputs hold no words")
    codes = learn_bpe_codes(counts, merges, min_frequency)
    with atomic_path(output) as tmp:
        tmp.write_text(codes, encoding="utf-8")
