"""How `nmt` behaves as a command, whatever the subcommand: bad input as one line and exit code 2 (never a
traceback or click's usage block), help that reads whole at any width (flags grouped in panels, commands in
pipeline order), Ctrl-C and closed pipes, and the garbage collector off during start-up."""

from __future__ import annotations

import functools
import gc
import os
import re
import sys

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

try:  # recent typer vendors click as typer._click; older ones use click itself
    from typer._click import exceptions as click_errors
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors
    from click.globals import get_current_context

from nmt_cli.errors import NmtError

from .config import effective_config, named_config_error

err = Console(stderr=True, soft_wrap=True)  # messages stay one line in logs, whatever the width
console_script = False  # set by cli.main.main, the `nmt` command's entry point


def own_command() -> list[str] | None:
    """The command line that started this process, to execute again (nmt train, to preload a memory
    allocator): that of `nmt ...` or `python -m nmt_cli ...`. None for anything else, whose own command line
    would start something other than this command: a test calling the app or the entry point in-process, or
    tests/warm_nmt.py's forked children."""
    start = len(sys.orig_argv) - len(sys.argv)  # where the interpreter's command line holds sys.argv[0]
    if not console_script or start < 1 or sys.orig_argv[start + 1 :] != sys.argv[1:]:
        return None
    if sys.orig_argv[start] != sys.argv[0] and sys.orig_argv[start - 1 : start + 1] != ["-m", "nmt_cli"]:
        return None
    return [sys.executable, *sys.orig_argv[1:]]


def run_on_allocator(choice: str, device: str | None) -> None:
    """Run this `nmt` command on `choice`'s memory allocator (--cpu-allocator) when it computes on the CPU: it
    executes itself again with the library preloaded (same pid; torch not yet imported). Nothing for a GPU
    run, or where `own_command` finds no command of nmt's own."""
    from nmt_cli.torch_env import cuda_expected, preload_allocator

    command = own_command()
    if command is not None and not cuda_expected(device):
        preload_allocator(choice, command)


# The oldest PyTorch nmt runs on: nn.utils.get_total_norm (2.6), fused Adam on CPU (2.4), torch.get_autocast_dtype
# (2.4), init_process_group(device_id=) (2.3). tests/test_layout.py checks pyproject.toml says the same.
MIN_TORCH = (2, 6)


def installed_torch_version() -> str | None:
    """The installed torch's version, read from its package metadata (importing torch takes seconds, and an
    exported model translates without it); None when torch is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def check_torch_version(version: str | None = None) -> None:
    """One NmtError when `version` (default: the installed torch's) is older than MIN_TORCH."""
    from nmt_cli.errors import NmtError

    version = version or installed_torch_version()
    if version is None:
        return
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    if release < MIN_TORCH:
        wanted = ".".join(map(str, MIN_TORCH))
        raise NmtError(f"nmt needs torch {wanted} or newer, found {version}: pip install 'torch>={wanted}'")


# `nmt --help` lists the commands in the order a run uses them; any command not named here comes last.
PIPELINE_ORDER = ("prepare", "learn-bpe", "apply-bpe", "binarize", "train", "plot", "average", "translate",
                  "score", "attention", "export", "import", "serve", "ctranslate2", "transformers")


def command_path(ctx) -> str:
    """'nmt export ctranslate2' for that command's context, whatever program name click was given."""
    return " ".join(["nmt", *(ctx.command_path.split()[1:] if ctx else [])])


def expand_aliases(args: list[str], aliases: dict[str, tuple[str, ...]]) -> list[str]:
    """`args` with each alias spelling replaced by what it stands for ('--max-update 10' -> '--max-updates 10',
    '--fp16' -> '--precision fp16', '--hyp=h.txt' -> '--input=h.txt'); nothing after a lone '--' changes."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        if name in aliases and (not eq or len(aliases[name]) == 1):
            out += [aliases[name][0] + eq + value] if eq else list(aliases[name])
        else:
            out.append(arg)
    return out


class PanelCommand(TyperCommand):
    """A command whose --help is click's plain text (wrapped to the terminal, nothing cut or read as markup)
    with its options grouped under their panel headings, in the order the panels first appear. `aliases`:
    other spellings it accepts (fairseq's names, former names), listed at the end of its help."""

    aliases: dict[str, tuple[str, ...]] = {}

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, expand_aliases(args, self.aliases))
        except click_errors.BadParameter as e:
            raise named_config_error(ctx, e) from None

    def invoke(self, ctx):
        if ctx.params.get("print_config"):
            sys.stdout.write(effective_config(ctx))
            ctx.exit(0)
        return super().invoke(ctx)

    def collect_usage_pieces(self, ctx) -> list[str]:
        """Click's usage line ('[OPTIONS] DATA_DIR', '[OPTIONS] SAVE_DIR...'), not typer's '{DATA_DIR}'."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx, formatter) -> None:
        arguments, panels = [], {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            # a repeatable value reads as its type ('--ref <path>'; the help says it repeats), not typer's
            # '<list[Path]>'
            record = (re.sub(r"<list\[(\w+)\]>", lambda m: f"<{m.group(1).lower()}>", record[0]), record[1])
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        # the general "Options" panel (help, flags without a panel) last, where click users look for --help
        for name in sorted(panels, key=lambda p: p == "Options"):
            with formatter.section(name):
                formatter.write_dl(panels[name])
        if self.aliases:
            with formatter.section("Other spellings accepted (fairseq's names)"):
                formatter.write_dl([(alias, "= " + (" ".join(target) or "(no flag: the paths follow)"))
                                    for alias, target in self.aliases.items()])


class OneLineErrors(TyperGroup):
    """A group of commands: usage errors (an unknown option, a value outside its choices) as one line on stderr
    and exit code 2, like every other bad input; its help lists the commands in pipeline order, each with its
    whole first sentence."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        order = {name: i for i, name in enumerate(PIPELINE_ORDER)}
        return sorted(names, key=lambda n: order.get(n, len(order)))

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            # Without standalone mode click returns an Exit's code instead of exiting; commands return None.
            code = super().main(args=args, prog_name=prog_name or "nmt", complete_var=complete_var,
                                standalone_mode=False, **extra)
            sys.exit(code if isinstance(code, int) else 0)
        except click_errors.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `nmt` alone: the help
                if e.format_message().strip():
                    typer.echo(e.format_message())
                sys.exit(0)
            where = command_path(e.ctx)
            message = e.format_message().replace("Value error, ", "")
            err.print(f"{where}: error: {message}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(2)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("interrupted", markup=False)
            sys.exit(130)


def start_up_done() -> None:
    """Turn the garbage collector back on after `main` turned it off for the start-up, freezing what start-up
    made (gc.freeze) so that later collections never walk it; a no-op when the collector is on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def collect_after_loading(fn):
    """Mark a command that calls `start_up_done` itself once its model is loaded (others get the collector
    back before they start)."""
    fn.collects_after_loading = True
    return fn


def handle_errors(fn):
    """Turn NmtError into one line on stderr and exit code 2; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not getattr(fn, "collects_after_loading", False):
            start_up_done()
        try:
            check_torch_version()
            return fn(*args, **kwargs)
        except NmtError as e:
            err.print(f"{command_path(get_current_context(silent=True))}: error: {e}", markup=False,
                      highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted", markup=False)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # Output closed early (e.g. piped into `head`): stop quietly.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None

    return wrapper


def command_group(help: str, **settings) -> typer.Typer:
    """A typer app (the root `nmt`, or a group like `nmt export`) whose errors and help behave as above."""
    return typer.Typer(cls=OneLineErrors, no_args_is_help=True, pretty_exceptions_enable=False,
                       rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]}, help=help,
                       **settings)


def command(group: typer.Typer, name: str, aliases: dict[str, str] | None = None, **settings):
    """Declare `name` in `group` with help grouped by panel (`PanelCommand`); `aliases` maps each hidden
    spelling to what it stands for ('--max-update': '--max-updates', '--fp16': '--precision fp16')."""
    cls = PanelCommand
    if aliases:
        expanded = {alias: tuple(target.split()) for alias, target in aliases.items()}
        cls = type(f"{name.title().replace('-', '')}Command", (PanelCommand,), {"aliases": expanded})
    return group.command(name, cls=cls, **settings)
