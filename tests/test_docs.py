"""The docs cannot drift from the CLI: the flag reference is the CLI's own, every `nmt <command> --flag` the
pages mention exists, every relative link resolves, the blocks marked as runnable run, and README.md stays
short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import run_cli
from .docs_reference import (
    COMMANDS_MD,
    REPO,
    cli_commands,
    current_reference,
    flags_of,
    mentioned_flags,
    reference_markdown,
)

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]


def test_flag_reference_is_the_clis():
    assert current_reference(COMMANDS_MD.read_text(encoding="utf-8")) == reference_markdown(), \
        "docs/commands.md's flag reference is stale: run `python tests/docs_reference.py --write`"


def test_every_flag_the_docs_mention_exists():
    commands = cli_commands()
    wrong = [f"{page.relative_to(REPO)}:{line}: nmt {command} has no {flag}"
             for page in PAGES for command, flag, line in mentioned_flags(page.read_text(encoding="utf-8"))
             if flag not in flags_of(commands[command])]
    assert not wrong, "\n".join(wrong)


def test_the_mention_check_catches_a_renamed_flag():
    found = mentioned_flags("run `nmt translate -m model.pt --beam-size 4`, then `torchrun --nproc_per_node 2`")
    assert found == [("translate", "-m", 1), ("translate", "--beam-size", 1)]
    assert "--beam-size" not in flags_of(cli_commands()["translate"])


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_headings_find_them():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text(encoding="utf-8")):
            linked = (page.parent / target) if target else page
            if target and (re.match(r"[a-z]+:", target) or linked.suffix != ".md"):
                continue
            headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, broken


# A page reads as reference, not as a work diary: no work periods, issue numbers, commit hashes, machine paths
# or notes on which machines were lent (history lives in git log).
DIARY = re.compile(r"\b(this|that|the|earlier|later|previous|next|first|second|third|\w+th) sessions?\b"
                   r"|\bissues? \d+|/tmp/|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
                   r"|\b(been|was|were|is) (not )?lent\b|device tool"
                   # ... nor the state of a machine on a day: how fast or busy a host was, what else ran on it
                   r"|\b(that|this|which) (day|host|session)\b|\btoday('s)?\b|\bhalf[- ]speed\b"
                   r"|\bother work\b|\bundisturbed\b|\b(drift|drifts|drifted)\b|\bslowed by\b|\bshared the\b"
                   r"|\bone (CI )?run in (ten|twenty|fifty|a hundred|\d+)\b|\bback to back\b", re.I)


def test_docs_read_as_reference_not_as_a_diary():
    found = [f"{page.relative_to(REPO)}:{number}: {match.group(0)!r}" for page in PAGES
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
             for match in DIARY.finditer(line)]
    assert not found, "\n".join(found)
    caught = [DIARY.search(x) is not None for x in (
        "measured in the fourth session", "see issue 28", "at 9967c36", "EXP=/tmp/x", "no GPU was lent",
        "1000000 lines", "a session key", "decades", "the device tool's status", "runs that day", "on this host",
        "a half-speed Intel host", "one row slowed by other work", "one CI run in twenty", "measured back to back",
        "while other work shared the host", "its speed drifts", "a lock of a process on the same host",
        "every day of training")]
    assert caught == [True, True, True, True, True, False, False, False, True, True, True, True, True, True, True,
                      True, True, False, False]


def test_readme_fits_on_a_few_screens():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    assert "make multi30k" in lines[12] or any("make multi30k" in line for line in lines[:20])
    assert any(line.startswith("make test") for line in lines[:20])


SMOKE_MARK = "<!-- smoke: tests/test_docs.py runs this block -->"


def smoke_blocks() -> list[tuple[str, str]]:
    """(page, shell text) of every fenced block right after a smoke marker."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(re.escape(SMOKE_MARK) + r"\n```(?:bash|sh)\n(.*?)\n```", text, re.S):
            found.append((str(page.relative_to(REPO)), match.group(1)))
    return found


def test_runnable_blocks_run(tmp_path, warm_nmt_path):
    """Each marked block runs in an empty folder with `nmt` on the PATH (the warm one of tests/warm_nmt.py; the
    Multi30k recipe test runs the console script) and the real Multi30k as DATA."""
    from .conftest import shared_data

    blocks = smoke_blocks()
    assert blocks, "no runnable block found"
    env = {**os.environ, "DATA": str(shared_data("multi30k")),
           "PATH": os.pathsep.join([warm_nmt_path, str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    for i, (page, script) in enumerate(blocks):
        folder = tmp_path / str(i)
        folder.mkdir()
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, f"{page}: {result.stderr[-2000:]}"


def test_python_api_examples_run(toy_model, tmp_path, monkeypatch):
    """The marked Python blocks of the docs run as written, with the toy model in place of the recipe's."""
    mark = "<!-- python: tests/test_docs.py runs this block"
    blocks = [(page, match.group(1)) for page in PAGES
              for match in re.finditer(re.escape(mark) + r"[^\n]*\n```python\n(.*?)\n```",
                                       page.read_text(encoding="utf-8"), re.S)]
    assert blocks, "no marked Python block"
    monkeypatch.chdir(tmp_path)
    for page, code in blocks:
        exec(compile(code.replace("exp/multi30k/model.pt", str(toy_model)), str(page), "exec"), {})
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"


def _trimmed(text: str) -> str:
    return " ".join(text.replace("`", "").split()).strip(" :;,()")


def source_strings() -> tuple[list[str], list[re.Pattern]]:
    """Every string literal of the package and the recipes' scripts, each literal part of an f-string apart
    (whitespace and the punctuation around it trimmed); and each f-string as a pattern, its values as `.+?`."""
    import ast

    parts: list[str] = []
    patterns: list[re.Pattern] = []
    for path in [*(REPO / "nmt_cli").rglob("*.py"), *(REPO / "recipes").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
                parts += [_trimmed(v) for v in pieces if isinstance(v, str)]
                while pieces and pieces[0] is None:  # a message may be quoted without its leading PATH
                    pieces.pop(0)
                while pieces and pieces[-1] is None:
                    pieces.pop()
                if sum(len(v.strip()) for v in pieces if v) >= 10:
                    patterns.append(re.compile("".join(
                        ".+?" if v is None else re.escape(re.sub(r"\s+", " ", v.replace("`", ""))) for v in pieces)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(_trimmed(node.value))
    return parts, patterns


# What a quoted message writes for what varies: its words in capitals (PATH, N, SAVE_DIR, HOST), quoted example
# values, "...", numbers, and " / " between alternatives.
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b|'[^']*'|\.\.\.|\d[\d.,%]*| / ")


def quoted_messages() -> list[str]:
    """The messages docs/troubleshooting.md quotes: the backticked parts of each table row's first cell that are
    messages (three words or more, not a flag or variable named alone)."""
    text = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    cells = [line.split(" | ")[0].removeprefix("| ") for line in text.splitlines() if line.startswith("| `")]
    quoted = [" ".join(m.split()) for cell in cells for m in re.findall(r"`([^`]+)`", cell)]
    return [m for m in quoted if len([w for w in m.split() if re.search("[a-z]", w)]) >= 3]


def printed_by_the_code(message: str, literals: tuple[list[str], list[re.Pattern]]) -> bool:
    """Whether a quoted message is one the code prints: one of the code's f-strings matches it (its values
    standing for the message's placeholders), a literal stretch of the code's own (12 characters or more) lies
    in it as whole words, or its longest stretch between placeholders, less a word at either end where that
    word is an example value, is a piece of a literal of the code."""
    parts, patterns = literals
    if any(p.search(message) for p in patterns):
        return True
    if any(len(piece) >= 12 and re.search(rf"(?<![\w-]){re.escape(piece)}(?![\w-])", message) for piece in parts):
        return True
    words = max((c.strip(" :;,()") for c in PLACEHOLDER.split(message)), key=len).split()
    candidates = {" ".join(words), " ".join(words[1:]), " ".join(words[:-1])}
    return any(len(c) >= 12 and any(c in piece for piece in parts) for c in candidates)


def test_troubleshooting_quotes_what_the_code_prints():
    """Each message docs/troubleshooting.md quotes is one the code prints (`printed_by_the_code`), so a message
    reworded in the code cannot live on in the docs; and the check tells a stale message from a real one."""
    literals = source_strings()
    messages = quoted_messages()
    assert len(messages) > 60
    stale = [m for m in messages if not printed_by_the_code(m, literals)]
    assert not stale, "\n".join(stale)
    assert not printed_by_the_code("PATH: a folder without model.bin; give a checkpoint (.pt)", literals)
    assert printed_by_the_code("HYP has N lines but REF has M", literals)
    assert not printed_by_the_code("HYP has N lines, REF has M", literals)


def test_the_config_file_of_commands_md_is_the_run_its_flags_give(tmp_path):
    """docs/commands.md's base.yaml and its flags make the same `--print-config`: the page's two forms of the
    WMT14 base run cannot drift apart."""
    text = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    mark = "<!-- config: tests/test_docs.py checks that this file and the flags below run the same options -->"
    config, flags = re.search(re.escape(mark) + r"\n```yaml\n(.*?)\n```.*?```bash\n(.*?)\n```", text, re.S).groups()
    (tmp_path / "base.yaml").write_text(config, encoding="utf-8")
    words = flags.replace("\\\n", " ").split()
    assert words[:5] == ["torchrun", "--nproc_per_node", "8", "-m", "nmt_cli"]
    from_file = run_cli("train", "--config", tmp_path / "base.yaml", "--print-config")
    from_flags = run_cli(*words[5:], "--print-config")
    assert from_file.exit_code == 0 and from_flags.exit_code == 0, from_file.output + from_flags.output
    assert from_file.stdout == from_flags.stdout and "arch: base\n" in from_file.stdout
