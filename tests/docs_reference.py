"""The flag reference of docs/commands.md, made from the CLI itself, and the flags the docs mention.

    python tests/docs_reference.py --write   # regenerate the reference in docs/commands.md after changing a flag

tests/test_docs.py fails when the file's reference differs from the CLI's, or when README.md or a page of
docs/ mentions a flag of `nmt <command>` that the command does not have.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS_MD = REPO / "docs" / "commands.md"
BEGIN, END = "<!-- flag reference: made by tests/docs_reference.py --write -->", "<!-- end of flag reference -->"


def cli_commands() -> dict[str, object]:
    """Every `nmt` subcommand by its path ('train', 'export ctranslate2') -> its click command."""
    import typer

    from nmt_cli.cli.main import app

    found: dict[str, object] = {}

    def walk(cmd, path: list[str]) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
        else:
            found[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return found


def options(cmd) -> list:
    return [p for p in cmd.params if type(p).__name__.endswith("Option")]


def flags_of(cmd) -> set[str]:
    """Every spelling of every option of a command (--beam, -b, --no-quiet, --help)."""
    return {"--help", "-h"} | {o for p in options(cmd) for o in [*p.opts, *p.secondary_opts]}


def _default(p) -> str:
    if p.required:
        return "required"
    if p.is_flag and not p.secondary_opts:
        return ""
    value = p.default
    if value is None or value == "":
        return ""
    if hasattr(value, "value"):  # an Enum choice
        value = value.value
    return f"`{value}`"


def _cell(text: str) -> str:
    """Help text as one table cell: rich's escapes undone, pipes escaped for markdown."""
    return " ".join(text.split()).replace("\\[", "[").replace("|", "\\|")


def reference_markdown() -> str:
    """One section per subcommand: its usage line, then its flags with defaults and help, in the panels
    `--help` groups them in."""
    out = [BEGIN, ""]
    for path, cmd in cli_commands().items():
        args = [p for p in cmd.params if type(p).__name__.endswith("Argument")]
        usage = " ".join(["nmt", path, *((a.metavar or a.name.upper()) + ("..." if a.nargs == -1 else "")
                                         for a in args), "[OPTIONS]"])
        out += [f"### nmt {path}", "", _cell((cmd.help or "").strip().split("\n\n")[0]), "", f"`{usage}`", ""]
        panels: dict[str, list] = {}
        for p in options(cmd):
            panels.setdefault(getattr(p, "rich_help_panel", None) or "Options", []).append(p)
        for panel, params in panels.items():
            if len(panels) > 1:
                out += [f"*{panel}*", ""]
            out += ["| flag | default | what it does |", "|---|---|---|"]
            for p in params:
                names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
                out.append(f"| {names} | {_default(p)} | {_cell(p.help or '')} |")
            out.append("")
    out.append(END)
    return "\n".join(out) + "\n"


def current_reference(text: str) -> str:
    """The reference part of docs/commands.md's text ('' when its markers are missing)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN) : text.index(END) + len(END)] + "\n"


def mentioned_flags(text: str) -> list[tuple[str, str, int]]:
    """(command, flag, line) for each flag written after `nmt <command>` on the same line of a page: in code
    spans, code blocks and prose alike (a flag of another tool, `torchrun --nproc_per_node`, is never preceded
    by `nmt <command>` on its line, or comes after a " | ", ";", "&&" or backtick that ends the nmt command)."""
    commands = sorted(cli_commands(), key=len, reverse=True)
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in re.finditer(r"\bnmt (" + "|".join(re.escape(c) for c in commands) + r")\b", line):
            rest = re.split(r"`| \| |;|&&|\bnmt\b", line[match.end() :])[0]
            found += [(match.group(1), flag, number) for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"replace the reference in {COMMANDS_MD}")
    args = parser.parse_args()
    reference = reference_markdown()
    if not args.write:
        print(reference, end="")
        return
    text = COMMANDS_MD.read_text(encoding="utf-8")
    old = current_reference(text)
    if not old:
        sys.exit(f"{COMMANDS_MD}: no flag reference markers ({BEGIN})")
    COMMANDS_MD.write_text(text.replace(old, reference), encoding="utf-8")


if __name__ == "__main__":
    main()
