"""`nmt train`, `plot` and `average`: a model trained, its curves drawn, its checkpoints averaged."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nmt_cli.errors import NmtError
from nmt_cli.training.options import TrainOptions

from .commandline import err, handle_errors, run_on_allocator
from .config import ConfigFlag, PrintConfigFlag
from .flags import extra_parameter, options_command


@handle_errors
@options_command(TrainOptions, extra=(extra_parameter("config", ConfigFlag, None),
                                      extra_parameter("print_config", PrintConfigFlag, False)))
def train_cmd(context: typer.Context, opts: TrainOptions, values: dict[str, Any]) -> None:
    """Train the Transformer (single process, or one per GPU/CPU under torchrun); resumes from checkpoint_last.pt."""
    from nmt_cli.torch_env import use_huge_pages_for_tensors
    from nmt_cli.training.options import kept_run_options

    # the flags on the command line, in a --config file or the environment; by name: typer may bring its own
    # copy of click
    sources = {name: getattr(context.get_parameter_source(name), "name", None) for name in values}
    given = {name for name, source in sources.items() if source not in (None, "DEFAULT")}  # a --config's too
    if {"lr", "lr_scale"} <= given:
        raise NmtError("--lr and --lr-scale both set the learning rate: give one (--lr: the peak; --lr-scale: a "
                       "factor on eq. 3)")
    opts = kept_run_options(opts, given)  # a resume keeps the run's options that are not given
    run_on_allocator(opts.cpu_allocator, opts.device)  # may run this command again, on tcmalloc
    use_huge_pages_for_tensors()  # before torch is imported
    from nmt_cli.training.trainer import end_of_run, train

    summary = train(opts)
    message, code = end_of_run(summary, opts.save_dir)
    if int(os.environ.get("RANK", "0")) == 0 and (code or not opts.quiet or summary["reason"] == "already_finished"):
        err.print(message, highlight=False)
    if code:
        raise typer.Exit(code)


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
