"""`nmt prepare`, `learn-bpe`, `apply-bpe` and `binarize`: raw or segmented text in, a data dir out."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nmt_cli.data.options import PrepareOptions

from .commandline import err, handle_errors
from .config import ConfigFlag, PrintConfigFlag
from .flags import extra_parameter, options_command

# The options of nmt prepare that nmt binarize takes (its input is segmented already: no tokenizer, no BPE)
BINARIZE_OPTIONS = ("source_lang", "target_lang", "train", "valid", "out", "test", "max_len", "max_ratio",
                    "vocab_threshold", "force", "remove_duplicates", "remove_copies", "train_weights")
BINARIZE_HELPS = {"source_lang": "Source language code (file suffix).",
                  "target_lang": "Target language code (file suffix).",
                  "train": "PREFIX of BPE-segmented training text; repeat for several corpora (see --train-weight).",
                  "valid": "PREFIX of BPE-segmented validation text."}


@handle_errors
@options_command(PrepareOptions, extra=(extra_parameter("config", ConfigFlag, None),
                                        extra_parameter("print_config", PrintConfigFlag, False)))
def prepare_cmd(context: typer.Context, opts: PrepareOptions, values: dict[str, Any]) -> None:
    """Moses-tokenize and learn joint BPE (or learn SentencePiece), apply it, build a shared vocabulary and
    binarize: raw text in, data dir out."""
    from nmt_cli.data.prepare import corpora_table, prepare, summary_line

    meta = prepare(opts)
    if not opts.quiet:
        err.print(summary_line(meta, opts.out), highlight=False)
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


CodesFlag = Annotated[Optional[Path], typer.Option(help="BPE codes to store with the data (for nmt translate).")]


@handle_errors
@options_command(PrepareOptions, only=BINARIZE_OPTIONS, helps=BINARIZE_HELPS,
                 extra=(extra_parameter("codes", CodesFlag, None),))
def binarize_cmd(context: typer.Context, opts: PrepareOptions, values: dict[str, Any]) -> None:
    """Build a trainable data dir from your own tokenized + BPE text (vocabulary from train, meta.json last)."""
    from nmt_cli.data.prepare import binarize_segmented
    from nmt_cli.text.moses import read_codes

    codes = values["codes"]
    binarize_segmented(replace(opts, quiet=True), read_codes(codes) if codes is not None else "")
