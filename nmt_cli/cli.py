"""The `nmt` command: a thin typer shell over the package's functions."""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .commandline import collect_after_loading, command, command_group, err, handle_errors, start_up_done
from .errors import NmtError

Arch = Enum("Arch", {name: name for name in ("tiny", "small", "base", "big")}, type=str)
Precision = Enum("Precision", {name: name for name in ("auto", "fp32", "bf16", "fp16")}, type=str)
Device = Enum("Device", {name: name for name in ("cpu", "cuda")}, type=str)
Engine = Enum("Engine", {name: name for name in ("auto", "nmt", "ctranslate2")}, type=str)
# --help panels of the commands with many flags
P_DATA = "Data and batches"
P_MODEL = "Model"
P_OPTIM = "Optimisation"
P_STOP = "Stopping and checkpoints"
P_LOG = "Logging"
P_DEVICE = "Devices and precision"
P_IO = "Input and output"
P_SEARCH = "Search"
P_STEER = "Sampling, prefixes and constraints"
ENGINE_HELP = ("auto: nmt for a checkpoint, CTranslate2 for an exported folder; ctranslate2 also runs a checkpoint "
               "(exported, float32, to a temporary folder at start-up).")

# Flags that translate and serve (and train, for --device) declare alike.
DeviceFlag = Annotated[Optional[Device], typer.Option(
    rich_help_panel=P_DEVICE, help="Default: cuda when available, else cpu.")]
ModelsFlag = Annotated[list[Path], typer.Option("--model", "-m", rich_help_panel=P_IO, help=(
    "Checkpoint (repeat for an ensemble), or a folder written by `nmt export ctranslate2`."))]
InferencePrecisionFlag = Annotated[Precision, typer.Option(rich_help_panel=P_DEVICE, help=(
    "Precision (fp16: CUDA only; auto: bf16 where the device multiplies it in hardware, else fp32)."))]
ThreadsFlag = Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help=(
    "CPU threads in all (0: torch's default; an exported model up to 4)."))]
EngineFlag = Annotated[Engine, typer.Option(rich_help_panel=P_DEVICE, help=ENGINE_HELP)]

# Other spellings each command accepts without listing them: fairseq's (users arrive with those habits) and
# former names. The docs use nmt's own.
FAIRSEQ_DATA = {"--trainpref": "--train", "--validpref": "--valid", "--testpref": "--test", "--destdir": "--out"}
FAIRSEQ_DEVICE = {"--cpu": "--device cpu", "--fp16": "--precision fp16", "--bf16": "--precision bf16"}
TRAIN_ALIASES = {"--max-update": "--max-updates", "--max-epoch": "--max-epochs", "--warmup-updates": "--warmup",
                 "--validate-interval-updates": "--valid-interval", "--keep-interval-updates": "--keep-last",
                 "--finetune-from-model": "--init-from", "--tensorboard-logdir": "--tensorboard", **FAIRSEQ_DEVICE}
TRANSLATE_ALIASES = {"--path": "--model", "--print-alignment": "--alignments", "--workers": "--parallel-batches",
                     "--sampling-topk": "--topk", "--sampling-topp": "--topp",
                     "--no-repeat-ngram-size": "--no-repeat-ngram", **FAIRSEQ_DEVICE}
# fairseq's scripts/average_checkpoints.py: `--inputs SAVE_DIR --num-update-checkpoints 5` (the folder is nmt's
# positional argument, so `--inputs` drops out)
AVERAGE_ALIASES = {"--inputs": "", "--num-update-checkpoints": "--last", "--num-epoch-checkpoints": "--last"}


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


app = command_group("Neural machine translation with the Transformer of 'Attention Is All You Need'.")


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Neural machine translation with the Transformer of 'Attention Is All You Need'."""


# ----------------------------------------------------------------------------- prepare & friends
@command(app, "prepare", aliases=FAIRSEQ_DATA)
@handle_errors
def prepare_cmd(
    train: Annotated[str, typer.Option(help="Training PREFIX: PREFIX.SRC and PREFIX.TGT, plain or .gz.")],
    valid: Annotated[str, typer.Option(help="Validation PREFIX.")],
    out: Annotated[Path, typer.Option(help="Output data directory.")],
    source_lang: Annotated[Optional[str], typer.Option(
        "--source-lang", "-s", help="Source language code (file suffix); with --from-model, the model's.")] = None,
    target_lang: Annotated[Optional[str], typer.Option(
        "--target-lang", "-t", help="Target language code (file suffix); with --from-model, the model's.")] = None,
    test: Annotated[Optional[list[str]], typer.Option(help="Test PREFIX (repeatable).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="moses: Moses tokenization + joint BPE (the paper's; default); sentencepiece: SentencePiece on raw "
             "text (languages written without spaces, such as Chinese).")] = None,
    bpe_merges: Annotated[int, typer.Option(help="Joint BPE merge operations (moses).")] = 10000,
    vocab_size: Annotated[int, typer.Option(help="Shared vocabulary size (sentencepiece).")] = 8000,
    spm_type: Annotated[str, typer.Option(help="SentencePiece model: unigram or bpe.")] = "unigram",
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
) -> None:
    """Moses-tokenize and learn joint BPE (or learn SentencePiece), apply it, build a shared vocabulary and
    binarize: raw text in, data dir out."""
    from .prepare import PrepareOptions, prepare, summary_line

    if from_model is None and (not source_lang or not target_lang):
        raise NmtError("--source-lang/-s and --target-lang/-t are required (unless --from-model gives them)")
    meta = prepare(PrepareOptions(source_lang or "", target_lang or "", train, valid, out, test or [], bpe_merges,
                                  workers if workers != 0 else (os.cpu_count() or 1), max_len, max_ratio,
                                  vocab_threshold, force, quiet, normalize_punctuation, from_model,
                                  tokenizer or "moses", vocab_size, spm_type, spm_sample,
                                  tokenizer_given=tokenizer is not None, tags=tuple(tag or ())))
    if not quiet:
        err.print(summary_line(meta, out), highlight=False)


@command(app, "learn-bpe", aliases={"--symbols": "--merges"})
@handle_errors
def learn_bpe_cmd(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="FILE", help="Tokenized text files (plain or .gz); learned jointly.")],
    merges: Annotated[int, typer.Option("--merges", "-n", help="Merge operations.")] = 10000,
    output: Annotated[Path, typer.Option("--output", "-o", help="Codes file to write.")] = Path("bpe.codes"),
    min_frequency: Annotated[int, typer.Option(help="Stop when the best pair is rarer than this.")] = 2,
) -> None:
    """Learn joint BPE codes from already tokenized text (the codes subword-nmt learns, faster)."""
    from .prepare import learn_codes_from_files

    learn_codes_from_files(inputs, output, merges, min_frequency)


@command(app, "apply-bpe")
@handle_errors
def apply_bpe_cmd(
    codes: Annotated[Path, typer.Option("--codes", "-c", help="BPE codes file.")],
    input: Annotated[Optional[Path], typer.Option("--input", "-i", help="Tokenized input (default stdin).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output file (default stdout).")] = None,
    tokenize_lang: Annotated[Optional[str], typer.Option(
        "--tokenize", help="Moses-tokenize input first (language).")] = None,
) -> None:
    """Segment text with BPE codes (optionally Moses-tokenizing it first)."""
    from . import text
    from .textio import atomic_path, iter_lines, stdin_lines

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


@command(app, "binarize", aliases=FAIRSEQ_DATA)
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
) -> None:
    """Build a trainable data dir from your own tokenized + BPE text (vocabulary from train, meta.json last)."""
    from .prepare import PrepareOptions, binarize_segmented
    from .text import read_codes

    code_text = read_codes(codes) if codes is not None else ""
    binarize_segmented(PrepareOptions(source_lang, target_lang, train, valid, out, test or [], max_len=max_len,
                                      max_ratio=max_ratio, vocab_threshold=vocab_threshold, force=force,
                                      quiet=True, workers=os.cpu_count() or 1), code_text)


# ----------------------------------------------------------------------------- train
@command(app, "train", aliases=TRAIN_ALIASES)
@handle_errors
def train_cmd(
    data: Annotated[Path, typer.Argument(metavar="DATA_DIR", help="Data directory made by nmt prepare.")],
    save_dir: Annotated[Path, typer.Option(
        rich_help_panel=P_STOP, help="Where checkpoints and train.jsonl go; re-running resumes.")],
    arch: Annotated[Optional[Arch], typer.Option(rich_help_panel=P_MODEL, help=(
        "Model preset: tiny (smoke runs), small (Multi30k on CPU), base and big (the paper's, on GPUs); "
        "default base, or the --init-from model's architecture."))] = None,
    layers: Annotated[Optional[int], typer.Option(
        rich_help_panel=P_MODEL, help="Encoder and decoder layers (N).")] = None,
    d_model: Annotated[Optional[int], typer.Option(rich_help_panel=P_MODEL, help="Model width.")] = None,
    ffn: Annotated[Optional[int], typer.Option(rich_help_panel=P_MODEL, help="Feed-forward inner width.")] = None,
    heads: Annotated[Optional[int], typer.Option(rich_help_panel=P_MODEL, help="Attention heads.")] = None,
    dropout: Annotated[Optional[float], typer.Option(
        rich_help_panel=P_MODEL, help="Residual and embedding dropout.")] = None,
    attention_dropout: Annotated[Optional[float], typer.Option(
        rich_help_panel=P_MODEL, help="Dropout on attention weights.")] = None,
    activation_dropout: Annotated[Optional[float], typer.Option(
        rich_help_panel=P_MODEL, help="Dropout on the FFN inner layer.")] = None,
    pre_norm: Annotated[Optional[bool], typer.Option(
        "--pre-norm/--post-norm", rich_help_panel=P_MODEL, help="LayerNorm placement.")] = None,
    head_dim: Annotated[Optional[int], typer.Option(rich_help_panel=P_MODEL, help=(
        "Width of one attention head, d_k = d_v (default d_model / heads; Table 3 rows A and B vary it)."))] = None,
    learned_positions: Annotated[Optional[bool], typer.Option(
        "--learned-positions/--sinusoidal-positions", rich_help_panel=P_MODEL,
        help="Learned position embeddings instead of the paper's sinusoids (Table 3 row E).")] = None,
    max_tokens: Annotated[int, typer.Option(rich_help_panel=P_DATA, help="Tokens per batch (padding counted).")] = 4096,
    update_freq: Annotated[int, typer.Option(rich_help_panel=P_DATA, help="Batches accumulated per update.")] = 1,
    max_updates: Annotated[int, typer.Option(
        rich_help_panel=P_STOP, help="Stop after this many updates (0: no limit).")] = 0,
    max_epochs: Annotated[int, typer.Option(
        rich_help_panel=P_STOP, help="Stop after this many epochs (0: no limit).")] = 0,
    max_time: Annotated[float, typer.Option(
        rich_help_panel=P_STOP, help="Stop after this many minutes (0: no limit).")] = 0.0,
    precision: Annotated[Precision, typer.Option(rich_help_panel=P_DEVICE, help=(
        "Mixed precision (fp16: CUDA only). auto: bf16 where the GPU or CPU multiplies it in hardware (fp16 on "
        "GPUs without bf16), fp32 elsewhere (fp32: exact float32)."))] = Precision.auto,
    seed: Annotated[int, typer.Option(
        rich_help_panel=P_OPTIM, help="Random seed (initialization, batch order, dropout).")] = 1,
    device: DeviceFlag = None,
    save_interval_updates: Annotated[int, typer.Option(
        rich_help_panel=P_STOP, help="Save a numbered checkpoint every N updates.")] = 0,
    save_interval_minutes: Annotated[float, typer.Option(
        rich_help_panel=P_STOP, help="Save a numbered checkpoint every M minutes.")] = 0.0,
    state_interval_minutes: Annotated[float, typer.Option(rich_help_panel=P_STOP, help=(
        "Save the full training state (checkpoint_last.pt: weights, Adam's moments, data position) every M "
        "minutes, as well as at epoch ends and at the end; numbered and best checkpoints hold the weights only "
        "(0: at epoch ends and the end only)."))] = 10.0,
    keep_last: Annotated[int, typer.Option(rich_help_panel=P_STOP, help="Numbered checkpoints to keep (0: all).")] = 5,
    valid_interval: Annotated[int, typer.Option(
        rich_help_panel=P_STOP, help="Validate every N updates (0: each epoch).")] = 0,
    eval_bleu: Annotated[bool, typer.Option(
        rich_help_panel=P_STOP, help="Also greedy-decode valid and pick the best by BLEU.")] = False,
    patience: Annotated[int, typer.Option(
        rich_help_panel=P_STOP, help="Stop after N validations without improvement (0: off).")] = 0,
    lr_scale: Annotated[float, typer.Option(rich_help_panel=P_OPTIM, help="Factor on the eq. 3 learning rate.")] = 1.0,
    warmup: Annotated[int, typer.Option(rich_help_panel=P_OPTIM, help=(
        "Warmup updates of eq. 3 (paper: 4000; small data: the Multi30k recipe's 1000 with --lr-scale 0.5)."))] = 4000,
    cooldown: Annotated[float, typer.Option(
        rich_help_panel=P_OPTIM,
        help="Lower the learning rate linearly to 0 over this final share of --max-updates/--max-time.")] = 0.0,
    label_smoothing: Annotated[float, typer.Option(
        rich_help_panel=P_OPTIM, help="Label smoothing epsilon (paper: 0.1).")] = 0.1,
    clip_norm: Annotated[float, typer.Option(rich_help_panel=P_OPTIM, help="Clip the gradient norm (0: off).")] = 0.0,
    log_interval: Annotated[int, typer.Option(rich_help_panel=P_LOG, help="Updates between log lines.")] = 50,
    init_from: Annotated[Optional[Path], typer.Option(
        rich_help_panel=P_MODEL,
        help="Start from this model's weights (and architecture) with a fresh optimizer and schedule: "
             "fine-tuning on data prepared with --from-model.")] = None,
    tensorboard: Annotated[Optional[Path], typer.Option(
        rich_help_panel=P_LOG,
        help="Also write the logged scalars to this folder for tensorboard (pip install 'nmt-cli[tensorboard]')."
    )] = None,
    threads: Annotated[int, typer.Option(
        rich_help_panel=P_DEVICE, help="CPU threads for torch (0: torch's default).")] = 0,
    background_save: Annotated[bool, typer.Option(
        "--background-save/--no-background-save", rich_help_panel=P_STOP,
        help="Write checkpoints on a background thread while training goes on (one save in flight).")] = True,
    quiet: Annotated[bool, typer.Option(rich_help_panel=P_LOG, help="No progress bar or log lines.")] = False,
) -> None:
    """Train the Transformer (single process, or one per GPU/CPU under torchrun); resumes from checkpoint_last.pt."""
    flags = {k: v.value if isinstance(v, Enum) else v for k, v in locals().items()}  # before any other name
    from dataclasses import fields

    from . import use_huge_pages_for_tensors

    use_huge_pages_for_tensors()  # before torch is imported
    import torch

    from .train import TrainOptions, end_of_run, train

    if threads:
        torch.set_num_threads(threads)
    opts = TrainOptions(**{f.name: flags[f.name] for f in fields(TrainOptions)})
    summary = train(opts)
    message, code = end_of_run(summary, save_dir)
    if int(os.environ.get("RANK", "0")) == 0 and (code or not quiet or summary["reason"] == "already_finished"):
        err.print(message, highlight=False)
    if code:
        raise typer.Exit(code)


# ----------------------------------------------------------------------------- plot
@command(app, "plot")
@handle_errors
def plot_cmd(
    save_dirs: Annotated[list[Path], typer.Argument(
        metavar="SAVE_DIR", help="Save directories of nmt train (several are overlaid).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Image to write (.png, .pdf, .svg).")] = Path(
        "curves.png"),
    x: Annotated[str, typer.Option("--x", help="Horizontal axis: update or time.")] = "update",
) -> None:
    """Training curves from train.jsonl: train/valid loss, valid BLEU or perplexity, learning rate, tokens/s."""
    from .plot import plot_runs

    plot_runs(save_dirs, output, x)
    err.print(f"wrote {output}", highlight=False)


@command(app, "attention")
@handle_errors
def attention_cmd(
    sentence: Annotated[str, typer.Argument(help="A source sentence (raw text).")],
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint (or averaged model).")],
    reference: Annotated[Optional[str], typer.Option(
        help="Target text to force (raw); default: the model's own beam-search translation.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Picture to write (.png, .svg, .pdf); default attention.png, none with --json alone.")
    ] = None,
    layer: Annotated[Optional[list[int]], typer.Option(
        help="Layer to draw, 1-based (repeatable; default all).")] = None,
    head: Annotated[Optional[list[int]], typer.Option(help="Head to draw, 1-based (repeatable; default all, and "
                                                           "their mean).")] = None,
    format: Annotated[Optional[str], typer.Option(help="png, svg or pdf (default: from --output).")] = None,
    as_json: Annotated[Optional[Path], typer.Option(
        "--json", help="Write the raw weights (layer x head x query x key) and labels to this file.")] = None,
) -> None:
    """Draw what the model attends to for one sentence: encoder self-attention, decoder self-attention and
    encoder-decoder attention, per layer and head (the paper's Figures 3-5)."""
    from .attention import FORMATS, attention_maps, plot_attention, write_json
    from .translate import Translator

    if output is None and as_json is None:
        output = Path("attention.png")
    fmt = (format or (output.suffix.lstrip(".") if output else "") or "png").lower()
    if fmt not in FORMATS:
        raise NmtError(f"{output}: unknown picture format {fmt!r} (use --format png, svg or pdf)")
    translator = Translator.from_checkpoint(model, device="cpu")
    net = translator.ensemble.models[0]
    for flag, values, most in (("--layer", layer, net.config.layers), ("--head", head, net.config.heads)):
        for v in values or ():
            if not 1 <= v <= most:
                raise NmtError(f"{flag} {v}: the model has {most} (1 to {most})")
    source, target = translator.attention_pair(sentence, reference)
    vocab = translator.vocab
    maps = attention_maps(net, source, target, vocab.symbols, vocab.bos, vocab.eos)
    if output is not None:
        plot_attention(maps, output, [v - 1 for v in layer or ()], [v - 1 for v in head or ()], fmt)
    if as_json is not None:
        write_json(maps, as_json)
    written = " and ".join(str(p) for p in (output, as_json) if p is not None)
    err.print(f"wrote {written} ({len(maps.source)} source and "
              f"{len(maps.target_out)} target tokens; target: {translator.decode(target)})", highlight=False,
              markup=False)


# ----------------------------------------------------------------------------- export
export_app = command_group("Convert a trained model for another inference engine.", add_completion=False)
app.add_typer(export_app, name="export")


@command(export_app, "ctranslate2")
@handle_errors
def export_ctranslate2_cmd(
    model: Annotated[Path, typer.Option("--model", "-m", help="nmt checkpoint (e.g. an averaged model.pt).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model folder to write.")],
    quantization: Annotated[str, typer.Option(help=(
        "Weight type, named as --precision names them: fp32, bf16, fp16, int8, int8_fp32, int8_bf16, int8_fp16 "
        "(CTranslate2's own names work too)."))] = "fp32",
    force: Annotated[bool, typer.Option(
        help="Replace a CTranslate2 export nmt made at --output (nothing else).")] = False,
) -> None:
    """Write a CTranslate2 model folder (weights, vocabulary, BPE codes, tokenizer settings) that
    `nmt translate -m DIR` and `nmt serve -m DIR` run without PyTorch."""
    from .ct2 import export_ctranslate2, quantization_name

    export_ctranslate2(model, output, quantization, force)
    err.print(f"exported {model} to {output} ({quantization_name(quantization)})", markup=False, highlight=False)


@command(export_app, "transformers")
@handle_errors
def export_transformers_cmd(
    model: Annotated[Path, typer.Option("--model", "-m", help="nmt checkpoint (e.g. an averaged model.pt).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model folder to write.")],
    force: Annotated[bool, typer.Option(
        help="Replace a Transformers export nmt made at --output (nothing else).")] = False,
) -> None:
    """Write a Hugging Face Transformers folder that AutoModelForSeq2SeqLM and AutoTokenizer load, with a model
    card: a Marian model for --tokenizer sentencepiece models, an FSMT model for Moses + BPE ones."""
    from .hf import export_transformers

    export_transformers(model, output, force)
    err.print(f"exported {model} to {output}", markup=False, highlight=False)


# ----------------------------------------------------------------------------- average
@command(app, "average", aliases=AVERAGE_ALIASES)
@handle_errors
def average_cmd(
    checkpoints: Annotated[Optional[list[Path]], typer.Argument(
        metavar="CHECKPOINT", help="Checkpoints, or a save dir with --last.")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Averaged model file.")] = Path("model.pt"),
    last: Annotated[int, typer.Option(help="Average the last N numbered checkpoints of the save dir given.")] = 0,
) -> None:
    """Average checkpoints' parameters (the paper averages the last 5 or 20) into a self-contained model."""
    from .checkpoint import average_checkpoints, checkpoints_to_average, save_checkpoint

    paths, warning = checkpoints_to_average(list(checkpoints or []), last)
    if warning:
        err.print(f"warning: {warning}", markup=False, highlight=False)
    save_checkpoint(average_checkpoints(paths), output)
    err.print(f"averaged {len(paths)} checkpoints into {output}")


# ----------------------------------------------------------------------------- translate
@command(app, "translate", aliases=TRANSLATE_ALIASES)
@handle_errors
@collect_after_loading
def translate_cmd(
    model: ModelsFlag,
    input: Annotated[Optional[Path], typer.Option(
        "--input", "-i", rich_help_panel=P_IO, help="Raw text (default stdin).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", rich_help_panel=P_IO, help="Output file (default stdout).")] = None,
    beam: Annotated[Optional[int], typer.Option(rich_help_panel=P_SEARCH, help=(
        "Beam size (default: the model file's, else 4)."), show_default=False)] = None,
    lenpen: Annotated[Optional[float], typer.Option(rich_help_panel=P_SEARCH, help=(
        "GNMT length penalty alpha (default: the model file's, else 0.6)."), show_default=False)] = None,
    max_len_a: Annotated[float, typer.Option(
        rich_help_panel=P_SEARCH, help="Max output length = a * source length + b.")] = 1.0,
    max_len_b: Annotated[int, typer.Option(rich_help_panel=P_SEARCH, help="See --max-len-a.")] = 50,
    batch_size: Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help="Sentences per batch.")] = 64,
    max_tokens: Annotated[Optional[int], typer.Option(
        rich_help_panel=P_DEVICE, help="Source tokens per batch (instead of --batch-size).")] = None,
    nbest: Annotated[int, typer.Option(
        rich_help_panel=P_SEARCH, help=(
            "Hypotheses per input; >1 prints LINE<TAB>SCORE<TAB>TEXT lines. SCORE is the log-probability divided by "
            "the engine's length penalty: GNMT's ((5+|Y|)/6)^lenpen for a checkpoint, |Y|^lenpen for an exported "
            "folder (CTranslate2), so the two rank alike but print different numbers."))] = 1,
    greedy: Annotated[bool, typer.Option(
        rich_help_panel=P_SEARCH, help="Greedy decoding (no beam machinery).")] = False,
    device: DeviceFlag = None,
    precision: InferencePrecisionFlag = Precision.fp32,
    threads: ThreadsFlag = 0,
    parallel_batches: Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help=(
        "Batches translated at once, each on its share of the threads (0: 2 on a CPU with 2+ threads, "
        "else 1)."))] = 0,
    engine: EngineFlag = Engine.auto,
    alignments: Annotated[bool, typer.Option(rich_help_panel=P_IO, help=(
        "Append TAB and source-target word alignments (i-j over whitespace-separated words; characters for "
        "Chinese, Japanese, Thai; from the encoder-decoder attention: approximate) to each line."))] = False,
    alignments_out: Annotated[Optional[Path], typer.Option(rich_help_panel=P_IO, help=(
        "Write the alignments to this file instead, one line per input line."))] = None,
    alignment_layer: Annotated[Optional[int], typer.Option(rich_help_panel=P_SEARCH, help=(
        "Decoder layer whose encoder-decoder attention gives the alignments (1-based; default: the second to "
        "last, or the last of 1-2 layers)."))] = None,
    quiet: Annotated[bool, typer.Option(rich_help_panel=P_IO, help="No progress bar.")] = False,
    sampling: Annotated[bool, typer.Option(rich_help_panel=P_STEER, help=(
        "Draw each token from the model's distribution instead of searching (back-translation); --nbest N "
        "draws N outputs per line."))] = False,
    topk: Annotated[Optional[int], typer.Option(rich_help_panel=P_STEER, help=(
        "Sample from the K most probable tokens only (default 0: all)."), show_default=False)] = None,
    topp: Annotated[Optional[float], typer.Option(rich_help_panel=P_STEER, help=(
        "Sample from the smallest set of tokens whose probability reaches P, in (0, 1] (default 1: all)."),
        show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(rich_help_panel=P_STEER, help=(
        "Divide the log-probabilities by T before sampling: below 1 sharper, above flatter (default 1)."),
        show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(rich_help_panel=P_STEER, help=(
        "Seed of the draws (default 0): a line samples alike alone or in any batch (nmt's engine; "
        "CTranslate2's draws do not repeat)."), show_default=False)] = None,
    no_repeat_ngram: Annotated[int, typer.Option(rich_help_panel=P_STEER, help=(
        "No N-gram of output tokens twice in an output (0: off)."))] = 0,
    prefix: Annotated[Optional[Path], typer.Option(rich_help_panel=P_STEER, help=(
        "Raw target text each output starts with, one line per input line (empty: none); needs --input."))] = None,
    constraints: Annotated[Optional[Path], typer.Option(rich_help_panel=P_STEER, help=(
        "Target phrases each output must contain, tab-separated, one line per input line (empty: none); beam "
        "search with nmt's engine; needs --input."))] = None,
) -> None:
    """Translate raw text; output is detokenized, one line per input line, in input order."""
    from .engines import load_translator
    from .pipeline import TextTranslator
    from .streaming import check_alignment_request, read_steering, sampling_of, translate_lines

    if parallel_batches < 0:
        raise NmtError(f"--parallel-batches must be 0 (automatic) or more (got {parallel_batches})")
    check_alignment_request(nbest, alignments, alignments_out)
    draws = sampling_of(sampling, beam, topk, topp, temperature, seed)
    steering = read_steering(input, prefix, constraints)
    options = dict(max_len_a=max_len_a, max_len_b=max_len_b, batch_size=batch_size, max_tokens=max_tokens,
                   greedy=greedy, nbest=nbest)
    extras = dict(sampling=draws, no_repeat_ngram=no_repeat_ngram)
    # before anything is loaded or printed (the model's own beam is checked against --nbest once it is loaded)
    TextTranslator.check_options(beam or max(4, nbest), 0.6 if lenpen is None else lenpen, **options, **extras,
                                 constraints=constraints is not None)
    translator = load_translator(model, device=device.value if device else None, precision=precision.value,
                                 threads=threads, engine=engine.value, workers=parallel_batches)
    if constraints is not None and translator.constraints_refusal:
        raise NmtError(translator.constraints_refusal)
    options["beam"], options["lenpen"] = translator.search_settings(beam, lenpen)
    TextTranslator.check_options(**options, **extras)
    if draws is not None:
        del options["beam"]
    elif not greedy and (note := translator.settings_note(beam, lenpen)) is not None:
        err.print(f"nmt translate: {note}", markup=False, highlight=False)
    start_up_done()
    translate_lines(translator, {**options, **extras, **steering}, input, output, err, alignments, alignments_out,
                    alignment_layer, quiet)


# ----------------------------------------------------------------------------- serve
@command(app, "serve", aliases={"--max-batch": "--batch-size", **FAIRSEQ_DEVICE})
@handle_errors
@collect_after_loading
def serve_cmd(
    model: ModelsFlag,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    batch_size: Annotated[int, typer.Option(help="Sentences per search batch, gathered across requests.")] = 64,
    max_tokens: Annotated[Optional[int], typer.Option(
        help="Padded source tokens per search batch (instead of --batch-size).")] = None,
    batch_wait_ms: Annotated[float, typer.Option(help="How long a request waits for others to batch with.")] = 5.0,
    max_queue: Annotated[int, typer.Option(help="Sentences waiting at most; beyond, requests get 503.")] = 1024,
    max_sentences: Annotated[int, typer.Option(help="Sentences per request at most (else 413).")] = 64,
    max_chars: Annotated[int, typer.Option(help="Characters per sentence at most (else 413).")] = 2000,
    max_body_bytes: Annotated[Optional[int], typer.Option(help=(
        "Request body bytes at most, counted while reading (else 413; default: room for --max-sentences x "
        "--max-chars)."))] = None,
    max_work: Annotated[int, typer.Option(help=(
        "Decoder tokens per request at most: sentences x beam x length limit, a sentence counted as no more "
        "tokens than characters (else 413)."))] = 64 * 4 * 1024,
    cache_mb: Annotated[float, typer.Option(help="Decoder cache kept between requests, at most (MB).")] = 256.0,
    api_key_file: Annotated[Optional[Path], typer.Option(help=(
        "API keys, one per line (also NMT_API_KEYS): POST /translate and GET /metrics then need "
        "'Authorization: Bearer <key>' (else 401)."))] = None,
    access_log: Annotated[str, typer.Option(help="One line per request on stderr: plain, json or off.")] = "plain",
    page: Annotated[bool, typer.Option(help=(
        "Answer GET / with a page to try the model in a browser (translation, n-best, scores, alignments)."))] = True,
    shutdown_seconds: Annotated[float, typer.Option(help=(
        "After SIGTERM: stop accepting, answer what is queued for up to this long, exit 0."))] = 30.0,
    device: DeviceFlag = None,
    precision: InferencePrecisionFlag = Precision.fp32,
    threads: ThreadsFlag = 0,
    engine: EngineFlag = Engine.auto,
) -> None:
    """Serve translations over HTTP: POST /translate {"text": [...], "beam": 4}, a page to try them at GET /,
    GET /health, GET /info, GET /metrics."""
    from .serve import serve_model
    from .serve_batching import ServeLimits

    limits = ServeLimits(batch_size, max_tokens, batch_wait_ms, max_queue, max_sentences, max_chars, max_body_bytes,
                         max_work, cache_mb, shutdown_seconds=shutdown_seconds)
    serve_model(model, host, port, limits, device.value if device else None, precision.value, threads,
                engine.value, api_key_file, access_log, err, on_loaded=start_up_done, page=page)


# ----------------------------------------------------------------------------- score
@command(app, "score", aliases={"--hyp": "--input"})
@handle_errors
def score_cmd(
    ref: Annotated[list[Path], typer.Option("--ref", "-r", help="Reference file; repeat for several.")],
    hyp: Annotated[Optional[Path], typer.Option("--input", "-i", help="Hypotheses (default stdin).")] = None,
    metrics: Annotated[str, typer.Option(help="Comma-separated: bleu,chrf,ter.")] = "bleu,chrf,ter",
    tokenized_bleu: Annotated[Optional[str], typer.Option(
        help="Also report the paper-era tokenized, compound-split BLEU (give the target language, e.g. de).")] = None,
    lang: Annotated[Optional[str], typer.Option(
        "--lang", "-l", help="Target language: chooses BLEU's tokenizer (zh: zh; ja, ko: ja-mecab, ko-mecab, or "
                             "char with a warning without MeCab; else 13a) and TER's Asian support.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", help="Take the target language from this checkpoint, exported folder or data dir.")] = None,
    tokenize: Annotated[Optional[str], typer.Option(
        help="BLEU's tokenizer: 13a, intl, zh, char, ja-mecab, ko-mecab or none [default: by the target "
             "language]", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Score detokenized hypotheses against references with sacreBLEU (scores and signatures)."""
    from .score import print_scores, score_files

    results, warning = score_files(hyp, ref, [m.strip() for m in metrics.split(",") if m.strip()], tokenized_bleu,
                                   tokenize, lang, model)
    if warning:
        err.print(f"nmt score: warning: {warning}", markup=False, highlight=False)
    print_scores(results, as_json)


# After a Ctrl-C the process must end: if clean-up at exit (multiprocessing's finalizers, joins of worker
# processes and threads) still runs after this many seconds, every thread's Python stack goes to stderr and the
# process exits 1. Armed here, at the process entry, never in the command handlers, which also run in-process
# (CliRunner, a notebook) where the timer would end the host process.
EXIT_WATCHDOG_S = 20.0


def main() -> None:
    """Console-script entry point."""
    # Start up without the garbage collector: once torch is imported, each full collection walks its million
    # objects (60-75 ms here), and importing and loading set off three or four of them, ~0.2 s of a one-line
    # `nmt translate`. Commands turn it back on (`start_up_done`) before their work, or after loading a model.
    gc.disable()
    try:
        app()
    except SystemExit as e:
        if e.code == 130:
            faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)
        raise
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
