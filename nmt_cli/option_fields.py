"""An option declared once: a dataclass field that carries its flag (help, spelling, panel, choices), so that the
command line, a `--config` file, `--print-config` and a run's `options.json` all come from the same declaration.

    @dataclass
    class TrainOptions:
        warmup: int = option(4000, help="Warmup updates of eq. 3.", panel="Optimisation")

`nmt_cli.cli.flags.options_command` makes the typer command of such a dataclass; this module imports nothing
heavier than the standard library, so the options stay usable without the command line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

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


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line."""

    help: str
    panel: str | None = None  # the --help panel
    decls: tuple[str, ...] = ()  # spellings other than --field-name: "--pre-norm/--post-norm", "--source-lang", "-s"
    choices: tuple[str, ...] = ()  # the values a text field takes (a click Choice)
    show_default: bool | str = True
    argument: bool = False  # positional, not --flag
    # The flag may be left out though the field has no default (the field is then None and the function that
    # takes the options says when it needs it: nmt prepare's languages, which --from-model gives).
    unset: bool = False
    type: Any = None  # the flag's type where the field's annotation is not one typer reads (list[str] for a Sequence)
    metavar: str | None = None
    # The flag takes text that `parse` turns into the field's value (e.g. "0.9,0.98" -> (0.9, 0.98)); `text` is
    # the flag's default as typed.
    parse: Callable[[str], Any] | None = None
    text: str | None = None


def option(default: Any = MISSING, *, help: str, **flag: Any) -> Any:
    """A dataclass field with its command-line flag (see `Flag` for the keywords)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help=help, **flag)})


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The flag a field declares, or None for a field the command line does not set."""
    return field.metadata.get("flag")
