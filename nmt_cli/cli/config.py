"""`--config FILE` and `--print-config`: a run's options in one YAML file (PyYAML). The keys are the long flag
names (`max-tokens` or `max_tokens`; a positional argument by its name, `data`); a flag on the command line
overrides the file; `--print-config` prints the effective options as a file `--config` reads back, and exits."""

from __future__ import annotations

import difflib
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

# The commands that read a config file: those a run is made of.
CONFIG_COMMANDS = ("prepare", "train", "translate", "score", "serve", "average")
OWN = ("help", "config", "print_config")


def key_of(param: Any) -> str:
    """The key a parameter has in a config file: its first long flag without the dashes, or its name."""
    long = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return long[0][2:] if long else param.name


def parameters_by_key(command: Any) -> dict[str, Any]:
    """Every spelling of a key a config file may use for each of the command's parameters: the long flags
    (dashes or underscores), and the parameter's own name."""
    found: dict[str, Any] = {}
    for param in command.params:
        if param.name in OWN:
            continue
        names = {param.name, key_of(param)} | {o[2:] for o in getattr(param, "opts", []) if o.startswith("--")}
        for name in names:
            found[name] = found[name.replace("_", "-")] = found[name.replace("-", "_")] = param
    return found


def read_config(ctx: Any, param: Any, value: str | None) -> None:
    """The --config callback (eager, before the other flags are read): the file's values become the command's
    defaults, so that the command line overrides them. One line, naming the file and the key, for an unknown
    key (with the nearest valid one); a value the flag does not take is named so by `named_config_error`."""
    if value is None:
        return
    path = Path(value)
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise typer.BadParameter(f"{path}: cannot read ({e.strerror or e})", ctx, param) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise typer.BadParameter(f"{path}{line}: not valid YAML", ctx, param) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise typer.BadParameter(f"{path}: expected a mapping of flag names to values", ctx, param)
    known = parameters_by_key(ctx.command)
    defaults: dict[str, Any] = {}
    for key, setting in loaded.items():
        target = known.get(str(key))
        if target is None:
            near = difflib.get_close_matches(str(key).replace("_", "-"), sorted(
                {key_of(p) for p in known.values()}), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise typer.BadParameter(f"{path}: unknown key {key!r}{hint}", ctx, param)
        # a YAML number or date given to a flag that takes text or a path is that text
        annotation = repr(getattr(getattr(target, "type_descriptor", None), "annotation", ""))
        textual = "str" in annotation or "Path" in annotation
        items = setting if isinstance(setting, list) and (target.multiple or target.nargs != 1) else [setting]
        items = [str(item) if textual and item is not None and not isinstance(item, bool) else item for item in items]
        defaults[target.name] = items if isinstance(setting, list) else items[0]
        ctx.meta.setdefault("config_keys", {})[target.name] = key
    ctx.meta["config_path"] = path
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def named_config_error(ctx: Any, error: Exception) -> Exception:
    """A usage error about a value that came from the --config file, with the file and the key named."""
    param = getattr(error, "param", None)
    key = ctx.meta.get("config_keys", {}).get(getattr(param, "name", None))
    source = ctx.get_parameter_source(param.name) if key is not None else None
    if key is None or getattr(source, "name", None) != "DEFAULT_MAP":
        return error
    message = getattr(error, "message", str(error))
    return typer.BadParameter(f"{ctx.meta['config_path']}: {key}: {message}", ctx)


def plain(value: Any) -> Any:
    """A parameter's value as YAML writes it plainly: enums by value, paths as text, tuples as lists."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def effective_config(ctx: Any) -> str:
    """The options a command runs with (file, command line and defaults together) as YAML, keyed by flag."""
    values = {key_of(p): plain(ctx.params.get(p.name)) for p in ctx.command.params
              if p.name not in OWN and p.expose_value}
    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True)


def read_config_flag(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """--config's callback, as typer calls it."""
    read_config(ctx, param, str(value) if value is not None else None)
    return value


# The two flags of every command in CONFIG_COMMANDS (`commandline.PanelCommand` prints the config).
ConfigFlag = Annotated[Optional[Path], typer.Option(
    "--config", is_eager=True, callback=read_config_flag, show_default=False,
    help="Read options from this YAML file (keys: the long flag names); flags given override it.")]
PrintConfigFlag = Annotated[bool, typer.Option(
    "--print-config", show_default=False,
    help="Print the options this command would run with, as YAML that --config reads, and exit.")]
