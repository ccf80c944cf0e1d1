"""The `nmt` command: each subcommand declared in a `cli_*` module, registered here with its hidden aliases."""

from __future__ import annotations

import faulthandler
import gc
from typing import Annotated

import typer

from . import commandline
from .commandline import command, command_group
from .data import apply_bpe_cmd, binarize_cmd, learn_bpe_cmd, prepare_cmd
from .deploy import export_ctranslate2_cmd, export_transformers_cmd, import_transformers_cmd, serve_cmd
from .train import average_cmd, plot_cmd, train_cmd
from .translate import attention_cmd, score_cmd, translate_cmd

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
        from nmt_cli import __version__

        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


app = command_group("Neural machine translation with the Transformer of 'Attention Is All You Need'.")


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Neural machine translation with the Transformer of 'Attention Is All You Need'."""



command(app, "prepare", aliases=FAIRSEQ_DATA)(prepare_cmd)
command(app, "learn-bpe", aliases={"--symbols": "--merges"})(learn_bpe_cmd)
command(app, "apply-bpe")(apply_bpe_cmd)
command(app, "binarize", aliases=FAIRSEQ_DATA)(binarize_cmd)
command(app, "train", aliases=TRAIN_ALIASES)(train_cmd)
command(app, "plot")(plot_cmd)
command(app, "average", aliases=AVERAGE_ALIASES)(average_cmd)
command(app, "translate", aliases=TRANSLATE_ALIASES)(translate_cmd)
command(app, "score", aliases={"--hyp": "--input"})(score_cmd)
command(app, "attention")(attention_cmd)
command(app, "serve", aliases={"--max-batch": "--batch-size", **FAIRSEQ_DEVICE})(serve_cmd)
export_app = command_group("Convert a trained model for another inference engine.", add_completion=False)
app.add_typer(export_app, name="export")
command(export_app, "ctranslate2")(export_ctranslate2_cmd)
command(export_app, "transformers")(export_transformers_cmd)
import_app = command_group("Read a model made by another toolkit into nmt.", add_completion=False)
app.add_typer(import_app, name="import")
command(import_app, "transformers")(import_transformers_cmd)


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
    commandline.console_script = True
    try:
        app()
    except SystemExit as e:
        if e.code == 130:
            faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)
        raise
    finally:
        gc.enable()
        commandline.console_script = False


if __name__ == "__main__":
    main()
