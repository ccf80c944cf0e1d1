"""Moses tokenization (sacremoses) and joint BPE (subword-nmt): learn, apply, undo."""

from __future__ import annotations

import io
import re
import sys
import types
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path


def _import_sacremoses() -> types.ModuleType:
    """sacremoses, without the joblib import its util module makes for its parallel corpus helpers (about a
    fifth of a second of every `nmt translate`). nmt never calls those helpers, so while sacremoses loads,
    "joblib" names an empty module; the real joblib is imported as usual by whoever asks for it later."""
    if "sacremoses" in sys.modules or "joblib" in sys.modules:
        import sacremoses

        return sacremoses
    placeholder = types.ModuleType("joblib")
    placeholder.Parallel = placeholder.delayed = None  # type: ignore[attr-defined]
    sys.modules["joblib"] = placeholder
    try:
        import sacremoses
    finally:
        del sys.modules["joblib"]
    return sacremoses


_sacremoses = _import_sacremoses()
MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer = (
    _sacremoses.MosesDetokenizer, _sacremoses.MosesPunctNormalizer, _sacremoses.MosesTokenizer)

from subword_nmt.apply_bpe import BPE  # noqa: E402

BPE_SEPARATOR = "@@"


@lru_cache(maxsize=8)
def _tokenizer(lang: str) -> MosesTokenizer:
    return MosesTokenizer(lang=lang)


@lru_cache(maxsize=8)
def _detokenizer(lang: str) -> MosesDetokenizer:
    return MosesDetokenizer(lang=lang)


@lru_cache(maxsize=8)
def _normalizer(lang: str) -> MosesPunctNormalizer:
    return MosesPunctNormalizer(lang=lang, post_remove_control_chars=True)


def normalize_punctuation(line: str, lang: str) -> str:
    """Moses normalize-punctuation.perl, then remove non-printing characters (as fairseq's WMT14 script does)."""
    return _normalizer(lang).normalize(line)


def tokenize(line: str, lang: str, aggressive_dash: bool = True) -> str:
    """Moses-tokenize one line without XML escaping; hyphens split as ``a @-@ b`` unless told otherwise."""
    return _tokenizer(lang).tokenize(line, escape=False, aggressive_dash_splits=aggressive_dash, return_str=True)


def detokenize(line: str, lang: str, unescape: bool = False) -> str:
    """Undo `tokenize`: Moses detokenization, with ``@-@`` hyphens joined back (and ``&amp;`` etc. unescaped
    where the tokens were escaped)."""
    return _detokenizer(lang).detokenize(line.split(), return_str=True, unescape=unescape)


# Moses' replace-unicode-punctuation.perl, in its order: (pattern, replacement); regular expressions where
# the script eats the spaces after a full stop.
_UNICODE_PUNCTUATION = [
    ("，", ","), (re.compile(r"。\s*"), ". "), ("、", ","), ("”", '"'), ("“", '"'), ("∶", ":"), ("：", ":"),
    ("？", "?"), ("《", '"'), ("》", '"'), ("）", ")"), ("！", "!"), ("（", "("), ("；", ";"), ("１", "1"),
    ("」", '"'), ("「", '"'), ("０", "0"), ("３", "3"), ("２", "2"), ("５", "5"), ("６", "6"), ("９", "9"),
    ("７", "7"), ("８", "8"), ("４", "4"), (re.compile(r"．\s*"), ". "), ("～", "~"), ("’", "'"), ("…", "..."),
    ("━", "-"), ("〈", "<"), ("〉", ">"), ("【", "["), ("】", "]"), ("％", "%")]


def replace_unicode_punctuation(line: str) -> str:
    """Moses replace-unicode-punctuation.perl: full-width and CJK punctuation and digits as ASCII."""
    for pattern, replacement in _UNICODE_PUNCTUATION:
        line = pattern.sub(replacement, line) if isinstance(pattern, re.Pattern) else line.replace(pattern, replacement)
    return line


def remove_non_printing(line: str) -> str:
    """Moses remove-non-printing-char.perl: every character of Unicode category C (controls, format, ...)."""
    import unicodedata

    return "".join(c for c in line if not unicodedata.category(c).startswith("C"))


@lru_cache(maxsize=8)
def _plain_normalizer(lang: str) -> MosesPunctNormalizer:
    return MosesPunctNormalizer(lang=lang)


def fsmt_tokenize(line: str, lang: str) -> str:
    """The tokenization of fairseq's WMT19 models as Transformers' FSMTTokenizer does it (after its lowercasing,
    which the segmenter does): replace-unicode-punctuation, normalize-punctuation, remove-non-printing-char, then
    Moses tokenization with XML escaping (``&amp;``) and aggressive hyphen splits."""
    line = remove_non_printing(_plain_normalizer(lang).normalize(replace_unicode_punctuation(line)))
    return _tokenizer(lang).tokenize(line, escape=True, aggressive_dash_splits=True, return_str=True)


def remove_bpe(line: str) -> str:
    """Join BPE pieces (``ne@@ w`` -> ``new``)."""
    return (line + " ").replace(BPE_SEPARATOR + " ", "").rstrip()


def read_codes(path: Path) -> str:
    """The text of a BPE codes file (subword-nmt's format); one-line NmtError when it is missing, a directory,
    not UTF-8, or not codes (each line after the optional `#version` header is two symbols)."""
    from nmt_cli.errors import NmtError
    from nmt_cli.textio import read_lines

    lines = read_lines(path)
    for number, line in enumerate(lines, start=1):
        if number == 1 and line.startswith("#version"):
            continue
        if len(line.split()) != 2:
            raise NmtError(f"{path}:{number}: not a BPE codes file (expected two symbols per line)")
    return "".join(line + "\n" for line in lines)


def _subword_nmt_bpe(codes: str) -> BPE:
    """subword-nmt's BPE for a codes file's text."""
    if not [line for line in codes.splitlines() if line.strip() and not line.startswith("#version")]:
        # Zero merges (a corpus without two-character words): every word splits into its characters.
        # subword-nmt refuses a codes file without merges, so it gets one that no text can match.
        codes = codes.rstrip("\n") + "\n\ue000 \ue001\n"
    return BPE(io.StringIO(codes), separator=BPE_SEPARATOR)


class BpeApplier:
    """Applies BPE codes to tokenized lines, caching each word's segmentation."""

    def __init__(self, codes: str, keep: Sequence[str] = ()) -> None:
        self._bpe = _subword_nmt_bpe(codes)
        self._cache: dict[str, str] = {word: word for word in keep}  # words never split (tags)

    def __call__(self, line: str) -> str:
        """Segment one tokenized line into BPE pieces."""
        out = []
        cache = self._cache
        for word in line.split():
            pieces = cache.get(word)
            if pieces is None:
                pieces = " ".join(self._bpe.segment_tokens([word]))
                cache[word] = pieces
            out.append(pieces)
        return " ".join(out)


class DropoutBpe:
    """BPE-dropout (Provilkov et al., 2020): subword-nmt's segmentation with each merge candidate skipped with
    probability `p`, so one word gets several segmentations into smaller pieces of the same codes."""

    def __init__(self, codes: str, p: float, keep: Sequence[str] = ()) -> None:
        self._bpe = _subword_nmt_bpe(codes)  # its own: subword-nmt caches what dropout draws
        self.p = p
        self._keep = frozenset(keep)

    def segment_lines(self, lines: Sequence[str], seed: str) -> list[str]:
        """One draw of the segmentation of tokenized `lines`, fixed by `seed`."""
        import random

        saved = random.getstate()  # subword-nmt draws from the random module's generator
        random.seed(seed)
        try:
            segment = self._bpe.segment_tokens
            return [" ".join(w if w in self._keep else " ".join(segment([w], dropout=self.p)) for w in line.split())
                    for line in lines]
        finally:
            random.setstate(saved)


_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """tensor2tensor's get_ende_bleu.sh compound split: ``a-b`` -> ``a ##AT##-##AT## b``."""
    # One non-overlapping pass, exactly like the script's perl `s{(\S)-(\S)}{...}g`.
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)
