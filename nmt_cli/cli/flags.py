"""The flag types, help panels and flags that several `nmt` commands declare alike, and the typer command made
from an options dataclass whose fields declare their flags (`options_command`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nmt_cli.option_fields import (  # noqa: F401 (the panels, for the commands declared here)
    P_DATA,
    P_DEVICE,
    P_IO,
    P_LOG,
    P_MODEL,
    P_OPTIM,
    P_SEARCH,
    P_STEER,
    P_STOP,
    Flag,
    flag_of,
)
from nmt_cli.torch_env import ALLOCATOR_CHOICES, ALLOCATOR_HELP

Precision = Enum("Precision", {name: name for name in ("auto", "fp32", "bf16", "fp16")}, type=str)
Device = Enum("Device", {name: name for name in ("cpu", "cuda")}, type=str)
Engine = Enum("Engine", {name: name for name in ("auto", "nmt", "ctranslate2")}, type=str)
ENGINE_HELP = ("auto: nmt for a checkpoint, CTranslate2 for an exported folder; ctranslate2 also runs a checkpoint "
               "(exported, float32, to a temporary folder at start-up).")

# Flags that translate and serve (and train, for --device) declare alike.
DeviceFlag = Annotated[Optional[Device], typer.Option(
    rich_help_panel=P_DEVICE, help="Default: cuda when available, else cpu.")]
ModelsFlag = Annotated[list[Path], typer.Option("--model", "-m", rich_help_panel=P_IO, help=(
    "Checkpoint (repeat for an ensemble), or a folder written by `nmt export ctranslate2`."))]
InferencePrecisionFlag = Annotated[Precision, typer.Option(rich_help_panel=P_DEVICE, help=(
    "Precision (fp16: CUDA only; auto: bf16 where the device multiplies it in hardware, else fp32). fp32 by "
    "default, unlike nmt train's auto: outputs exactly as the model scores them (bf16 is faster on such a "
    "device and changes a few outputs)."))]
ThreadsFlag = Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help=(
    "CPU threads in all (0: torch's default; an exported model up to 4)."))]
EngineFlag = Annotated[Engine, typer.Option(rich_help_panel=P_DEVICE, help=ENGINE_HELP)]


@functools.cache
def choice_enum(name: str, choices: tuple[str, ...]) -> type[Enum]:
    """The Enum typer shows as a choice of `choices` (one per field, so --help lists them)."""
    return Enum(name, {c: c for c in choices}, type=str)  # type: ignore[return-value]


CpuAllocator = choice_enum("CpuAllocator", ALLOCATOR_CHOICES)  # the enum of nmt train's --cpu-allocator field too
# (translate and serve; nmt train declares its flag with its other options, from the same help)
CpuAllocatorFlag = Annotated[CpuAllocator, typer.Option(rich_help_panel=P_DEVICE, help=ALLOCATOR_HELP)]


def field_parameter(field: dataclasses.Field, annotation: Any, help: str | None = None) -> inspect.Parameter:
    """The typer parameter a dataclass field declares (`option_fields.option`): its flag, help (or `help`),
    panel, default. A field whose default is an empty tuple (a repeatable flag given no times) has no flag
    default."""
    flag: Flag = flag_of(field)  # type: ignore[assignment]
    if help is not None:
        flag = dataclasses.replace(flag, help=help)
    kind = str if flag.parse else flag.type or annotation
    default: Any = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
    if flag.unset or default == ():
        default, kind = None, Optional[kind]
    if flag.parse and default not in (None, inspect.Parameter.empty):
        default = flag.text
    if flag.choices:
        enum = choice_enum("".join(part.title() for part in field.name.split("_")), flag.choices)
        kind = Optional[enum] if default is None else enum
        default = default if default in (None, inspect.Parameter.empty) else enum(default)
    if flag.argument:
        info: Any = typer.Argument(metavar=flag.metavar, help=flag.help)
    else:
        info = typer.Option(*flag.decls, rich_help_panel=flag.panel, help=flag.help, show_default=flag.show_default,
                            metavar=flag.metavar)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def field_values(options: type, values: dict[str, Any]) -> dict[str, Any]:
    """The command's parsed flags as the dataclass's field values: choices by their text, parsed texts parsed,
    a repeatable flag given no times as its empty default."""
    out = {}
    for field in dataclasses.fields(options):
        flag = flag_of(field)
        if flag is None or field.name not in values:
            continue
        value = values[field.name]
        if isinstance(value, Enum):
            value = value.value
        elif flag.parse and isinstance(value, str):
            value = flag.parse(value)
        elif value is None and field.default == ():
            value = ()
        elif isinstance(value, list) and field.default == ():
            value = tuple(value)
        out[field.name] = value
    return out


def options_command(options: type, *, extra: tuple[inspect.Parameter, ...] = (),
                    only: tuple[str, ...] | None = None, helps: dict[str, str] | None = None) -> Callable:
    """Decorate `run(context, opts, values)` into a typer command whose parameters are `options`'s declared
    fields (in field order; `only` those named; `helps` for a command that reads a field's input otherwise)
    followed by `extra`: `opts` is the dataclass built from them, `values` every parameter's value by name (the
    extras' too)."""
    hints = typing.get_type_hints(options)

    def decorate(run: Callable) -> Callable:
        params = [inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
        params += [field_parameter(f, hints[f.name], (helps or {}).get(f.name)) for f in dataclasses.fields(options)
                   if flag_of(f) and (only is None or f.name in only)]
        params += list(extra)

        @functools.wraps(run)
        def command(context: typer.Context, **values: Any) -> Any:
            return run(context, options(**field_values(options, values)), values)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the signature above, not run's
        return command

    return decorate


def extra_parameter(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A command parameter that is not an options field (`--config`, `--print-config`), for `options_command`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
