"""Raw text <-> the pieces a model reads, by one of two pipelines: the paper's Moses tokenization + joint BPE
(subword-nmt), or SentencePiece on raw text (for languages Moses cannot split into words, such as Chinese).

Both give whitespace-separated pieces, so the vocabulary, the binarized format and training do not depend on
which one made them."""

from __future__ import annotations

import io
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nmt_cli.errors import NmtError

from . import moses as text

TOKENIZERS = ("moses", "sentencepiece")
PIPELINES = ("", "fsmt")  # Moses tokenization: nmt's own (no escaping), or that of fairseq's WMT19 models
SPM_TYPES = ("unigram", "bpe")
# SentencePiece's recommendation for languages with rich character sets (CJK); 1.0 for the others.
CHARACTER_COVERAGE = 0.9995
# Every character Python's str.split() splits on (NBSP, the ideographic space U+3000, U+2028, ...).
_SPACES = re.compile(r"\s")


def split_tag(line: str, tags: Sequence[str]) -> tuple[str, str]:
    """(tag, rest) for a line that starts with one of `tags` as a word of its own (a back-translation tag such as
    `<BT>`), else ("", line)."""
    if tags:
        first, _, rest = line.lstrip().partition(" ")
        if first in tags:
            return first, rest
    return "", line


def check_tags(tags: Sequence[str]) -> None:
    """One line for a tag that cannot be a vocabulary symbol of its own."""
    for tag in tags:
        if not tag or any(c.isspace() for c in tag) or tag in ("<pad>", "<s>", "</s>", "<unk>"):
            raise NmtError(f"--tag {tag!r}: a tag is one word (no spaces) other than <pad>, <s>, </s> and <unk>")


def plain_spaces(line: str) -> str:
    """`line` with every Unicode space or separator as an ASCII space. SentencePiece sees text this way both
    when it learns and when it segments, so none of its pieces holds a character that splitting a line of
    pieces on whitespace (as the vocabulary and the binarizer do) would cut."""
    return _SPACES.sub(" ", line)


class Segmenter:
    """Turns raw text into model pieces and model pieces into raw text (one line at a time)."""

    name = ""

    def __init__(self, normalize: bool = False, tags: Sequence[str] = (), lowercase: bool = False) -> None:
        self.normalize = normalize  # Moses punctuation normalization first, as at prepare time
        self.tags = tuple(tags)  # words that may begin a line and stay one piece (`nmt prepare --tag`)
        self.lowercase = lowercase  # `nmt prepare --lowercase`: before everything else, as at prepare time

    def segment(self, line: str, lang: str) -> str:
        """Whitespace-separated pieces of one raw line; a leading tag stays one piece."""
        tag, line = split_tag(line, self.tags)
        if self.lowercase:
            line = line.lower()
        if self.normalize:
            line = text.normalize_punctuation(line, lang)
        pieces = self._segment(line, lang) if line.strip() else ""
        return f"{tag} {pieces}".rstrip() if tag else pieces

    def _segment(self, line: str, lang: str) -> str:
        raise NotImplementedError

    def desegment(self, pieces: str, lang: str) -> str:
        """The raw text of whitespace-separated pieces."""
        raise NotImplementedError

    def surface(self, piece: str) -> str:
        """The characters of the raw text one piece stands for ('' where it cannot say), for alignments."""
        raise NotImplementedError

    def target_side(self) -> Segmenter:
        """The segmenter of the target side: this one, unless the target has a model of its own (OPUS-MT's
        target.spm); `desegment` always speaks for the target."""
        return self


class MosesBpe(Segmenter):
    """Moses tokenization (no escaping, aggressive hyphen splits), then BPE with ``@@`` continuation marks.
    With `pipeline` "fsmt", the tokenization of fairseq's WMT19 models instead (`moses.fsmt_tokenize`)."""

    name = "moses"

    def __init__(self, codes: str, normalize: bool = False, tags: Sequence[str] = (), pipeline: str = "",
                 lowercase: bool = False) -> None:
        super().__init__(normalize, tags, lowercase)
        if pipeline not in PIPELINES:
            raise NmtError(f"unknown Moses pipeline {pipeline!r} (this nmt knows {', '.join(PIPELINES)})")
        self.codes, self.pipeline = codes, pipeline
        self.bpe = text.BpeApplier(codes)

    def _segment(self, line: str, lang: str) -> str:
        if self.pipeline == "fsmt":
            return self.bpe(text.fsmt_tokenize(line, lang))
        return self.bpe(text.tokenize(line, lang))

    def desegment(self, pieces: str, lang: str) -> str:
        return text.detokenize(text.remove_bpe(pieces), lang, unescape=self.pipeline == "fsmt")

    def surface(self, piece: str) -> str:
        piece = piece.removesuffix(text.BPE_SEPARATOR)
        return "-" if piece == "@-@" else piece


class SentencePiece(Segmenter):
    """A SentencePiece model over raw text; its pieces carry their own spaces (``▁``)."""

    name = "sentencepiece"

    def __init__(self, model: bytes, normalize: bool = False, tags: Sequence[str] = (),
                 target_model: bytes | None = None, marian: bool = False, lowercase: bool = False) -> None:
        super().__init__(normalize, tags, lowercase)
        self.model, self.target_model = model, target_model
        self.processor = _processor(model)
        self.target_processor = _processor(target_model) if target_model else self.processor
        # An OPUS-MT model's vocabulary holds pieces of both its SentencePiece models: decode as MarianTokenizer
        # does (<unk> left out, a piece the target model lacks spelled out with its spaces).
        self.marian = marian

    def target_side(self) -> Segmenter:
        if self.target_model is None:
            return self
        return SentencePiece(self.target_model, self.normalize, self.tags, marian=self.marian,
                             lowercase=self.lowercase)

    def _segment(self, line: str, lang: str) -> str:
        return " ".join(self.processor.encode(plain_spaces(line), out_type=str))

    def desegment(self, pieces: str, lang: str) -> str:
        if self.marian:
            kept = [p for p in pieces.split() if p != "<unk>"]
            return self.target_processor.decode_pieces(kept).replace("\u2581", " ").strip()
        return self.target_processor.decode(pieces.split())

    def surface(self, piece: str) -> str:
        if piece.startswith("<0x") and piece.endswith(">"):  # one byte of a character: no whole character
            return ""
        return piece.replace("\u2581", "")

    def symbols(self) -> list[str]:
        """Every piece, by id: the model's vocabulary (ids 0-3 are <pad> <s> </s> <unk>)."""
        return [self.processor.id_to_piece(i) for i in range(self.processor.get_piece_size())]


def _processor(model: bytes):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, TypeError) as e:
        raise NmtError(f"not a SentencePiece model ({one_line(e)})") from None


def segmenter_from(tokenizer: dict | None, bpe_codes: str, sentencepiece: bytes | None,
                   target_sentencepiece: bytes | None = None) -> Segmenter:
    """The segmenter a data dir's meta.json or a checkpoint records (`tokenizer`, its codes or SentencePiece
    model, the target side's own SentencePiece model if it has one)."""
    tokenizer = tokenizer or {}
    normalize = bool(tokenizer.get("normalize_punctuation", False))
    tags = tuple(tokenizer.get("tags", ()))
    lowercase = bool(tokenizer.get("lowercase"))
    name = tokenizer.get("name", "moses")
    if name == "sentencepiece":
        if not sentencepiece:
            raise NmtError("the tokenizer is SentencePiece, but its model is missing")
        return SentencePiece(sentencepiece, normalize, tags, target_sentencepiece,
                             marian=tokenizer.get("imported") == "marian", lowercase=lowercase)
    if name != "moses":
        raise NmtError(f"unknown tokenizer {name!r} (this nmt knows {', '.join(TOKENIZERS)})")
    return MosesBpe(bpe_codes, normalize, tags, tokenizer.get("pipeline", ""), lowercase)


def segmenter_of(state: dict, path: str | Path) -> Segmenter:
    """The segmenter a checkpoint carries; one line naming `path` when it lacks what its tokenizer needs."""
    try:
        return segmenter_from(state.get("tokenizer"), state.get("bpe_codes", ""), state.get("sentencepiece"),
                              state.get("target_sentencepiece"))
    except NmtError as e:
        raise NmtError(f"{path}: {e}") from None


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


def with_plain_spaces(model: bytes) -> bytes:
    """The SentencePiece model `model` with `plain_spaces` inside it: its normalizer maps every Unicode space to
    an ASCII space, so a tool that gives it raw text (Transformers' MarianTokenizer) gets nmt's pieces. Only
    models with the identity normalizer (all that nmt trains) are changed; others are returned as they are."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    if proto.normalizer_spec.name != "identity" or proto.normalizer_spec.precompiled_charsmap:
        return model
    spaces = [c for c in map(chr, range(0x110000)) if c != " " and _SPACES.match(c)]
    with tempfile.TemporaryDirectory() as folder:
        # The charsmap is compiled by SentencePiece's trainer alone: train a throwaway model with the rules.
        rules, text = Path(folder) / "rules.tsv", Path(folder) / "text.txt"
        rules.write_text("".join(f"{ord(c):X}\t20\n" for c in spaces), encoding="utf-8")
        text.write_text("a b\n" * 4, encoding="utf-8")
        throwaway = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(input=str(text), model_writer=throwaway, vocab_size=5,
                                                 model_type="char", hard_vocab_limit=False, minloglevel=2,
                                                 normalization_rule_tsv=str(rules))
    compiled = sentencepiece_model_pb2.ModelProto()
    compiled.ParseFromString(throwaway.getvalue())
    proto.normalizer_spec.name = "nmt_plain_spaces"
    proto.normalizer_spec.precompiled_charsmap = compiled.normalizer_spec.precompiled_charsmap
    return proto.SerializeToString()


def train_sentencepiece(files: Sequence[Path], vocab_size: int, model_type: str = "unigram",
                        sample: int = 1_000_000, threads: int = 1, seed: int = 1, tags: Sequence[str] = ()) -> bytes:
    """A SentencePiece model (serialized) learned jointly on the raw lines of `files`, with nmt's special
    symbols at ids 0-3, `tags` as pieces of their own, byte fallback (no character becomes <unk>) and CJK-level
    character coverage; at most `sample` lines, drawn at random, are used."""
    import sentencepiece

    if model_type not in SPM_TYPES:
        raise NmtError(f"unknown --spm-type {model_type!r} (choose from {', '.join(SPM_TYPES)})")
    if vocab_size < 260 + 4:
        raise NmtError(f"--vocab-size must be at least 264 for SentencePiece: 256 byte pieces, 4 specials and a few "
                       f"more (got {vocab_size})")
    model = io.BytesIO()
    options = dict(
        input=",".join(str(f) for f in files), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=CHARACTER_COVERAGE, byte_fallback=True, input_sentence_size=sample,
        shuffle_input_sentence=True, num_threads=max(1, threads), seed_sentencepiece_size=1_000_000,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>",
        unk_piece="<unk>", max_sentence_length=1 << 16, minloglevel=2,
        # No NFKC: it would turn Chinese full-width punctuation (，？！：) into ASCII, so output could never
        # match references written with it; raw text round-trips exactly (spaces aside).
        normalization_rule_name="identity",
        # A vocabulary smaller than the unigram model's seeds is fine; one larger than the text allows is not.
        hard_vocab_limit=True)
    if tags:
        options["user_defined_symbols"] = list(tags)
    sentencepiece.set_random_generator_seed(seed)  # the sample of lines, and so the model, is reproducible
    try:
        sentencepiece.SentencePieceTrainer.train(**options)
    except RuntimeError as e:
        largest = re.search(r"value <= (\d+)", str(e))
        if largest:
            raise NmtError(f"--vocab-size {vocab_size} is larger than this corpus allows for SentencePiece "
                           f"{model_type}: use --vocab-size {largest.group(1)} or less") from None
        needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if needed:
            # the characters, plus the 4 specials and 256 byte pieces
            raise NmtError(f"--vocab-size {vocab_size} is too small for the {needed.group(1)} characters this corpus "
                           f"needs (character coverage {CHARACTER_COVERAGE}): use --vocab-size "
                           f"{int(needed.group(1)) + 260} or more") from None
        raise NmtError(f"SentencePiece training failed: {one_line(e)}") from None
    return model.getvalue()


def has_han(line: str) -> bool:
    """Whether a line holds a CJK unified ideograph (Chinese characters, also used in Japanese)."""
    return any("\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf" for ch in line)



