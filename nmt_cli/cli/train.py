"""`nmt train`, `plot` and `average`: a model trained, its curves drawn, its checkpoints averaged."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.errors import NmtError

from .commandline import err, handle_errors
from .config import ConfigFlag, PrintConfigFlag
from .flags import P_DATA, P_DEVICE, P_LOG, P_MODEL, P_OPTIM, P_STOP, Arch, CommPrecision, DeviceFlag, Precision


@handle_errors
def train_cmd(
    context: typer.Context,
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
    comm_precision: Annotated[CommPrecision, typer.Option(rich_help_panel=P_DEVICE, help=(
        "Precision the gradients are all-reduced in between processes (bf16 or fp16: half the bytes, for nodes "
        "joined by a slow network; each process casts the sum back to fp32)."))] = CommPrecision.fp32,
    compile: Annotated[Optional[bool], typer.Option(
        "--compile/--no-compile", rich_help_panel=P_DEVICE, show_default="on CUDA, off on CPU", help=(
            "torch.compile the encoder and decoder layers (fused dropout, residual and LayerNorm; far fewer "
            "kernel launches). Compiling takes the first update's time (reported).")
    )] = None,
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
    lr: Annotated[Optional[float], typer.Option(rich_help_panel=P_OPTIM, help=(
        "The peak learning rate (fairseq's --lr), reached at update --warmup: eq. 3's factor is set to give it "
        "(in place of --lr-scale)."), show_default=False)] = None,
    adam_betas: Annotated[str, typer.Option(rich_help_panel=P_OPTIM, help=(
        "Adam's beta1 and beta2, as '0.9,0.98' or fairseq's '(0.9, 0.98)' (paper: 0.9, 0.98)."))] = "0.9,0.98",
    weight_decay: Annotated[float, typer.Option(rich_help_panel=P_OPTIM, help=(
        "Weight decay, decoupled from the gradient (AdamW), as fairseq's adam applies it (0: off)."))] = 0.0,
    ema: Annotated[float, typer.Option(rich_help_panel=P_OPTIM, help=(
        "Keep an exponential moving average of the weights with this decay (0.999, say; 0: none), in fp32, "
        "saved in every checkpoint; nmt average --ema makes a model of it."))] = 0.0,
    valid_ema: Annotated[bool, typer.Option(rich_help_panel=P_OPTIM, help=(
        "Validate the moving average (--ema) instead of the weights: the logged validation, --eval-bleu and "
        "checkpoint_best rank it."))] = False,
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
        help="Also write the logged scalars to this folder for tensorboard (pip install -e '.[tensorboard]' in "
             "the clone).",
    )] = None,
    threads: Annotated[int, typer.Option(
        rich_help_panel=P_DEVICE, help="CPU threads for torch (0: torch's default).")] = 0,
    background_save: Annotated[bool, typer.Option(
        "--background-save/--no-background-save", rich_help_panel=P_STOP,
        help="Write checkpoints on a background thread while training goes on (one save in flight).")] = True,
    quiet: Annotated[bool, typer.Option(rich_help_panel=P_LOG, help="No progress bar or log lines.")] = False,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Train the Transformer (single process, or one per GPU/CPU under torchrun); resumes from checkpoint_last.pt."""
    flags = {k: v.value if isinstance(v, Enum) else v for k, v in locals().items()}  # before any other name
    from dataclasses import fields

    from nmt_cli.torch_env import use_huge_pages_for_tensors

    use_huge_pages_for_tensors()  # before torch is imported
    import torch

    from nmt_cli.training.trainer import TrainOptions, end_of_run, kept_run_options, train

    if threads:
        torch.set_num_threads(threads)
    flags["adam_betas"] = parse_betas(adam_betas)
    opts = TrainOptions(**{f.name: flags[f.name] for f in fields(TrainOptions)})
    # the flags on the command line, in a --config file or the environment; by name: typer may bring its own
    # copy of click
    sources = {name: getattr(context.get_parameter_source(name), "name", None) for name in flags if name != "context"}
    given = {name for name, source in sources.items() if source not in (None, "DEFAULT")}  # a --config's too
    if {"lr", "lr_scale"} <= given:
        raise NmtError("--lr and --lr-scale both set the learning rate: give one (--lr: the peak; --lr-scale: a "
                       "factor on eq. 3)")
    summary = train(kept_run_options(opts, given))  # a resume keeps the run's options that are not given
    message, code = end_of_run(summary, save_dir)
    if int(os.environ.get("RANK", "0")) == 0 and (code or not quiet or summary["reason"] == "already_finished"):
        err.print(message, highlight=False)
    if code:
        raise typer.Exit(code)


def parse_betas(text: str) -> tuple[float, float]:
    """--adam-betas as '0.9,0.98', '0.9 0.98' or fairseq's '(0.9, 0.98)'; one line for anything else."""
    parts = [p for p in text.strip().strip("()[]").replace(",", " ").split() if p]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise NmtError(f"--adam-betas must be two numbers, as '0.9,0.98' (got {text!r})")
    return betas  # type: ignore[return-value]


@handle_errors
def plot_cmd(
    save_dirs: Annotated[list[Path], typer.Argument(
        metavar="SAVE_DIR", help="Save directories of nmt train (several are overlaid).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Image to write (.png, .pdf, .svg).")] = Path(
        "curves.png"),
    x: Annotated[str, typer.Option("--x", help="Horizontal axis: update or time.")] = "update",
) -> None:
    """Training curves from train.jsonl: train/valid loss, valid BLEU or perplexity, learning rate, tokens/s."""
    from nmt_cli.training.plot import plot_runs

    plot_runs(save_dirs, output, x)
    err.print(f"wrote {output}", highlight=False)



@handle_errors
def average_cmd(
    checkpoints: Annotated[Optional[list[Path]], typer.Argument(
        metavar="CHECKPOINT", help="Checkpoints, or a save dir with --last.")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Averaged model file.")] = Path("model.pt"),
    last: Annotated[int, typer.Option(help="Average the last N numbered checkpoints of the save dir given.")] = 0,
    ema: Annotated[bool, typer.Option(help=(
        "Average the checkpoints' moving averages of the weights (nmt train --ema) instead of the weights; one "
        "checkpoint: a model of its moving average."))] = False,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Average checkpoints' parameters (the paper averages the last 5 or 20) into a self-contained model."""
    from nmt_cli.model.checkpoint import average_checkpoints, checkpoints_to_average, save_checkpoint

    paths, warning = checkpoints_to_average(list(checkpoints or []), last)
    if warning:
        err.print(f"nmt average: warning: {warning}", markup=False, highlight=False)
    save_checkpoint(average_checkpoints(paths, ema=ema), output)
    err.print(f"averaged {len(paths)} checkpoints{' (their moving averages)' if ema else ''} into {output}")
