"""The docs cannot drift from the CLI: the flag reference is the CLI's own, every `nmt <command> --flag` the
pages mention exists, every relative link resolves, the blocks marked as runnable run, and README.md stays
short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
