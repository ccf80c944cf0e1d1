"""`nmt prepare`, `learn-bpe`, `apply-bpe` and `binarize`: raw or segmented text in, a data dir out."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.errors import NmtError

from .commandline import err, handle_errors
from .config import ConfigFlag, PrintConfigFlag
from .flags import RemoveCopiesFlag, RemoveDuplicatesFlag, SpmType, Tokenizer


@handle_errors
def prepare_cmd(
    train: Annotated[list[str], typer.Option(
        help="Training PREFIX: PREFIX.SRC and PREFIX.TGT, plain or .gz; repeat for several corpora (see "
             "--train-weight).")],
    valid: Annotated[str, typer.Option(help="Validation PREFIX.")],
    out: Annotated[Path, typer.Option(help="Output data directory.")],
    train_weight: Annotated[Optional[list[float]], typer.Option(
        help="How often each pair of a corpus is seen per epoch of training, one weight per --train in order "
             "[default: 1 each]; 2: twice, 0.5: half of them (drawn anew each epoch).", show_default=False)] = None,
    source_lang: Annotated[Optional[str], typer.Option(
        "--source-lang", "-s", help="Source language code (file suffix); with --from-model, the model's.")] = None,
    target_lang: Annotated[Optional[str], typer.Option(
        "--target-lang", "-t", help="Target language code (file suffix); with --from-model, the model's.")] = None,
    test: Annotated[Optional[list[str]], typer.Option(help="Test PREFIX (repeatable).")] = None,
    tokenizer: Annotated[Optional[Tokenizer], typer.Option(
        help="moses: Moses tokenization + joint BPE (the paper's; default); sentencepiece: SentencePiece on raw "
             "text (languages written without spaces, such as Chinese).")] = None,
    bpe_merges: Annotated[int, typer.Option(help="Joint BPE merge operations (moses).")] = 10000,
    vocab_size: Annotated[int, typer.Option(help="Shared vocabulary size (sentencepiece).")] = 8000,
    spm_type: Annotated[SpmType, typer.Option(help="SentencePiece model: unigram or bpe.")] = SpmType.unigram,
    spm_sample: Annotated[int, typer.Option(
        help="SentencePiece learns from at most this many lines (both sides), drawn at random.")] = 1_000_000,
    workers: Annotated[int, typer.Option(help="Worker processes (0: one per core).")] = 0,
    max_len: Annotated[int, typer.Option(help="Drop training pairs with a side longer than this (BPE pieces).")] = 250,
    max_ratio: Annotated[Optional[float], typer.Option(
        help="Drop training pairs whose length ratio (in pieces) exceeds this [default: 1.5; off between a CJK "
             "language and one that is not]", show_default=False)] = None,
    vocab_threshold: Annotated[int, typer.Option(help="Keep BPE pieces seen at least this often.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace a data dir nmt made at --out (nothing else).")] = False,
    normalize_punctuation: Annotated[bool, typer.Option(
        help="Normalize punctuation (Moses) and remove non-printing characters before tokenizing, as fairseq's "
             "WMT14 script does; stored with the model, so translate does the same.")] = False,
    from_model: Annotated[Optional[Path], typer.Option(
        help="Fine-tuning data: segment and binarize with this model's languages, normalization, tokenizer (BPE "
             "codes or SentencePiece model) and vocabulary, for nmt train --init-from.")] = None,
    tag: Annotated[Optional[list[str]], typer.Option(
        help="A word that may begin a line and stays one vocabulary symbol, untokenized (repeatable): a tag "
             "such as <BT> on back-translated sources; stored with the model.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    langid: Annotated[Optional[float], typer.Option(
        help="Drop training pairs whose sides are not identified as -s and -t with at least this probability "
             "(py3langid, offline; pip install py3langid) [default: off]", show_default=False)] = None,
    remove_duplicates: RemoveDuplicatesFlag = True,
    remove_copies: RemoveCopiesFlag = True,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Moses-tokenize and learn joint BPE (or learn SentencePiece), apply it, build a shared vocabulary and
    binarize: raw text in, data dir out."""
    from nmt_cli.data.prepare import PrepareOptions, corpora_table, prepare, summary_line

    if from_model is None and (not source_lang or not target_lang):
        raise NmtError("--source-lang/-s and --target-lang/-t are required (unless --from-model gives them)")
    meta = prepare(PrepareOptions(source_lang or "", target_lang or "", train, valid, out, test or [], bpe_merges,
                                  workers if workers != 0 else (os.cpu_count() or 1), max_len, max_ratio,
                                  vocab_threshold, force, quiet, normalize_punctuation, from_model,
                                  tokenizer.value if tokenizer else "moses", vocab_size, spm_type.value, spm_sample,
                                  tokenizer_given=tokenizer is not None, tags=tuple(tag or ()),
                                  remove_duplicates=remove_duplicates, remove_copies=remove_copies,
                                  train_weights=tuple(train_weight or ()), langid=langid))
    if not quiet:
        err.print(summary_line(meta, out), highlight=False)
        table = corpora_table(meta)
        if table is not None:
            err.print(table)


@handle_errors
def learn_bpe_cmd(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="FILE", help="Tokenized text files (plain or .gz); learned jointly.")],
    merges: Annotated[int, typer.Option("--merges", "-n", help="Merge operations.")] = 10000,
    output: Annotated[Path, typer.Option("--output", "-o", help="Codes file to write.")] = Path("bpe.codes"),
    min_frequency: Annotated[int, typer.Option(help="Stop when the best pair is rarer than this.")] = 2,
) -> None:
    """Learn joint BPE codes from already tokenized text (the codes subword-nmt learns, faster)."""
    from nmt_cli.data.prepare import learn_codes_from_files

    learn_codes_from_files(inputs, output, merges, min_frequency)


@handle_errors
def apply_bpe_cmd(
    codes: Annotated[Path, typer.Option("--codes", "-c", help="BPE codes file.")],
    input: Annotated[Optional[Path], typer.Option("--input", "-i", help="Tokenized input (default stdin).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output file (default stdout).")] = None,
    tokenize_lang: Annotated[Optional[str], typer.Option(
        "--tokenize", help="Moses-tokenize input first (language).")] = None,
) -> None:
    """Segment text with BPE codes (optionally Moses-tokenizing it first)."""
    from nmt_cli.text import moses as text
    from nmt_cli.textio import atomic_path, iter_lines, stdin_lines

    bpe = text.BpeApplier(text.read_codes(codes))
    lines = iter_lines(input) if input else stdin_lines()

    def convert(line: str) -> str:
        return bpe(text.tokenize(line, tokenize_lang) if tokenize_lang else line)

    if output:
        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(convert(line) + "\n")
    else:
        for line in lines:
            sys.stdout.write(convert(line) + "\n")


@handle_errors
def binarize_cmd(
    source_lang: Annotated[str, typer.Option("--source-lang", "-s", help="Source language code (file suffix).")],
    target_lang: Annotated[str, typer.Option("--target-lang", "-t", help="Target language code (file suffix).")],
    train: Annotated[str, typer.Option(help="PREFIX of BPE-segmented training text.")],
    valid: Annotated[str, typer.Option(help="PREFIX of BPE-segmented validation text.")],
    out: Annotated[Path, typer.Option(help="Output data directory.")],
    codes: Annotated[Optional[Path], typer.Option(help="BPE codes to store with the data (for nmt translate).")] = None,
    test: Annotated[Optional[list[str]], typer.Option(help="Test PREFIX (repeatable).")] = None,
    max_len: Annotated[int, typer.Option(help="Drop training pairs with a side longer than this (BPE pieces).")] = 250,
    max_ratio: Annotated[float, typer.Option(help="Drop training pairs whose length ratio exceeds this.")] = 1.5,
    vocab_threshold: Annotated[int, typer.Option(help="Keep BPE pieces seen at least this often.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace a data dir nmt made at --out (nothing else).")] = False,
    remove_duplicates: RemoveDuplicatesFlag = True,
    remove_copies: RemoveCopiesFlag = True,
) -> None:
    """Build a trainable data dir from your own tokenized + BPE text (vocabulary from train, meta.json last)."""
    from nmt_cli.data.prepare import PrepareOptions, binarize_segmented
    from nmt_cli.text.moses import read_codes

    code_text = read_codes(codes) if codes is not None else ""
    binarize_segmented(PrepareOptions(source_lang, target_lang, train, valid, out, test or [], max_len=max_len,
                                      max_ratio=max_ratio, vocab_threshold=vocab_threshold, force=force,
                                      quiet=True, workers=os.cpu_count() or 1, remove_duplicates=remove_duplicates,
                                      remove_copies=remove_copies), code_text)
