"""`nmt prepare`'s (and `nmt binarize`'s) options as one dataclass. Each field declares its flag
(`nmt_cli.option_fields`): the command line, `--config` and `--print-config` are made from these declarations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.option_fields import option
from nmt_cli.text.languages import is_cjk

MAX_RATIO = 1.5  # Moses clean-corpus-n's length ratio, for pairs written in the same kind of script


@dataclass
class PrepareOptions:
    """Everything `nmt prepare` needs, one field per flag."""

    # None (not given) only with --from-model, which gives them
    source_lang: str = option(decls=("--source-lang", "-s"), unset=True, help=(
        "Source language code (file suffix); with --from-model, the model's."))
    target_lang: str = option(decls=("--target-lang", "-t"), unset=True, help=(
        "Target language code (file suffix); with --from-model, the model's."))
    # one training PREFIX, or several corpora (`train_weights`)
    train: str | Sequence[str] = option(type=list[str], help=(
        "Training PREFIX: PREFIX.SRC and PREFIX.TGT, plain or .gz; repeat for several corpora (see --train-weight)."))
    valid: str = option(help="Validation PREFIX.")
    out: Path = option(help="Output data directory.")
    test: Sequence[str] = option((), type=list[str], help="Test PREFIX (repeatable).")
    bpe_merges: int = option(10000, help="Joint BPE merge operations (moses).")
    workers: int = option(0, help="Worker processes (0: one per core).")
    max_len: int = option(250, help="Drop training pairs with a side longer than this (BPE pieces).")
    # None: 1.5, or off between a CJK language and one that is not (`ratio_limit`)
    max_ratio: float | None = option(None, show_default=False, help=(
        "Drop training pairs whose length ratio (in pieces) exceeds this [default: 1.5; off between a CJK "
        "language and one that is not]"))
    vocab_threshold: int = option(1, help="Keep BPE pieces seen at least this often.")
    force: bool = option(False, help="Replace a data dir nmt made at --out (nothing else).")
    quiet: bool = option(False, help="No progress bar.")
    # Moses punctuation normalization + removal of non-printing characters
    normalize: bool = option(False, decls=("--normalize-punctuation/--no-normalize-punctuation",), help=(
        "Normalize punctuation (Moses) and remove non-printing characters before tokenizing, as fairseq's "
        "WMT14 script does; stored with the model, so translate does the same."))
    # The multimodal-MT literature's Multi30k text is lowercased before normalization and tokenization
    lowercase: bool = option(False, decls=("--lowercase/--no-lowercase",), help=(
        "Lowercase both sides before normalizing and tokenizing; stored with the model, so translate lowercases "
        "its input too and translates into lowercased text."))
    from_model: Path | None = option(None, help=(
        "Fine-tuning data: segment and binarize with this model's languages, normalization, tokenizer (BPE "
        "codes or SentencePiece model) and vocabulary, for nmt train --init-from."))
    # None: moses, or with --from-model the model's (a tokenizer given is checked against it)
    tokenizer: str | None = option(None, choices=("moses", "sentencepiece"), help=(
        "moses: Moses tokenization + joint BPE (the paper's; default); sentencepiece: SentencePiece on raw "
        "text (languages written without spaces, such as Chinese)."))
    vocab_size: int = option(8000, help="Shared vocabulary size (sentencepiece).")  # docs/design.md: why 8,000
    spm_type: str = option("unigram", choices=("unigram", "bpe"), help="SentencePiece model: unigram or bpe.")
    spm_sample: int = option(1_000_000, help=(
        "SentencePiece learns from at most this many lines (both sides), drawn at random."))
    # words that may begin a line, kept as one symbol (a back-translation tag: <BT>)
    tags: Sequence[str] = option((), decls=("--tag",), type=list[str], help=(
        "A word that may begin a line and stays one vocabulary symbol, untokenized (repeatable): a tag such as "
        "<BT> on back-translated sources; stored with the model."))
    remove_duplicates: bool = option(True, decls=("--remove-duplicates/--keep-duplicates",), help=(
        "Drop a training pair seen before (both sides equal)."))
    remove_copies: bool = option(True, decls=("--remove-copies/--keep-copies",), help=(
        "Drop a training pair whose source equals its target (untranslated)."))
    # Per training corpus, in --train's order: how often `nmt train` sees each of its pairs per epoch (1 each)
    train_weights: Sequence[float] = option(
        (), decls=("--train-weight",), type=list[float], show_default=False, help=(
            "How often each pair of a corpus is seen per epoch of training, one weight per --train in order "
            "[default: 1 each]; 2: twice, 0.5: half of them (drawn anew each epoch)."))
    # Language identification of both sides of each training pair (py3langid): a pair is kept when each side is
    # identified as its language with at least this probability; None: off
    langid: float | None = option(None, show_default=False, help=(
        "Drop training pairs whose sides are not identified as -s and -t with at least this probability "
        "(py3langid, offline; pip install py3langid) [default: off]"))

    # BPE-dropout (Provilkov et al., 2020): training pairs segmented again with each merge skipped at random, in
    # `bpe_dropout_copies` fixed draws that `nmt train` reads one per epoch, in turn; 0: off
    bpe_dropout: float = option(0.0, help=(
        "BPE-dropout (Provilkov et al., 2020): also store the training pairs segmented with each merge skipped "
        "with this probability (the paper's: 0.1), in --bpe-dropout-copies draws; nmt train reads one draw per "
        "epoch, in turn; translation segments as usual [0: off]"))
    bpe_dropout_copies: int = option(10, help="How many BPE-dropout draws of the training pairs to store.")

    @property
    def train_prefixes(self) -> list[str]:
        """The training corpora's PREFIXes, in order."""
        return [self.train] if isinstance(self.train, str) else list(self.train)

    def corpora(self) -> list[dict]:
        """Each training corpus's name (its PREFIX's file name, numbered where two share one), PREFIX and
        weight; one line for weights that do not match the corpora."""
        prefixes = self.train_prefixes
        weights = list(self.train_weights) or [1.0] * len(prefixes)
        if len(weights) != len(prefixes):
            raise NmtError(f"--train-weight given {len(weights)} times for {len(prefixes)} --train corpora: give one "
                           "per --train, in the same order")
        bad = [w for w in weights if not (w > 0 and w < float("inf"))]
        if bad:
            raise NmtError(f"--train-weight {bad[0]}: a weight is a positive number (1: each pair once per epoch)")
        names: list[str] = []
        for prefix in prefixes:
            base = Path(prefix).name or "train"
            names.append(base if base not in names else f"{base}#{len(names) + 1}")
        return [{"name": n, "prefix": str(p), "weight": float(w)} for n, p, w in zip(names, prefixes, weights)]

    def ratio_limit(self) -> float | None:
        """The length-ratio filter in effect: --max-ratio, or by default 1.5, except between a CJK language and
        one that is not, where piece counts of the two sides are not comparable (off)."""
        if self.max_ratio is not None:
            return self.max_ratio
        return None if is_cjk(self.source_lang) != is_cjk(self.target_lang) else MAX_RATIO
