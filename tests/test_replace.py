"""What `--force` may replace, and replacing a folder so that a kill at any moment leaves one complete folder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nmt_cli import textio

from .conftest import REPO, expect_error, require_extra, run_cli


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_force_replaces_only_a_previous_export_of_its_kind(toy_model, tmp_path, monkeypatch):
    require_extra("ctranslate2")
    save = tmp_path / "ckpt"
    save.mkdir()
    for name in ("checkpoint_last.pt", "checkpoint_3.pt"):
        shutil.copy(toy_model, save / name)
    export = ["export", "ctranslate2", "-m", save / "checkpoint_last.pt", "--force", "-o"]
    before = _tree(save)
    expect_error(run_cli(*export, save), "ckpt: a folder with 2 checkpoints (.pt)", "not an nmt export for ctranslate2")
    assert _tree(save) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    expect_error(run_cli(*export, notes), "notes: a folder with 1 file and 0 folders")
    assert (notes / "todo.txt").read_text() == "keep me\n"
    monkeypatch.chdir(notes)
    expect_error(run_cli(*export, "."), "is the working directory")
    expect_error(run_cli(*export, ".."), "is the working directory or holds it")
    assert (notes / "todo.txt").read_text() == "keep me\n" and _tree(save) == before
    # a Transformers export is not a CTranslate2 one
    other = tmp_path / "hf"
    other.mkdir()
    textio.mark_export(other, "transformers")
    expect_error(run_cli(*export, other), "an nmt export for transformers, not an nmt export for ctranslate2")
    # a previous export of the same kind is replaced, and the new one carries the marker
    out = tmp_path / "ct2"
    assert run_cli(*export, out).exit_code == 0
    (out / "stale.txt").write_text("from the old export")
    assert run_cli(*export, out).exit_code == 0
    assert not (out / "stale.txt").exists() and textio.export_kind(out) == "ctranslate2"
    assert (out / "model.bin").is_file() and not list(tmp_path.glob(".*.tmp"))


_KILL = """
import os, shutil, signal, sys, tempfile
from pathlib import Path
from nmt_cli import textio
new, out, step = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
staging = Path(tempfile.mkdtemp(prefix=textio.temporary_prefix(out), suffix=".tmp", dir=out.parent))
shutil.copytree(new, staging, dirs_exist_ok=True)
if step == "aside":  # a filesystem that cannot swap two names: the kill lands between the two renames
    textio.exchange_paths = lambda a, b: False
    original = textio.move_aside
    def move_aside_then_die(path):
        original(path)
        os.kill(os.getpid(), signal.SIGKILL)
    textio.move_aside = move_aside_then_die
else:  # the kill lands after the swap, before the old folder is deleted
    textio.remove_path = lambda path: os.kill(os.getpid(), signal.SIGKILL)
textio.publish_directory(staging, out)
"""


def _old_and_new(tmp_path: Path) -> tuple[Path, Path, dict, dict]:
    out, new = tmp_path / "data", tmp_path / "new"
    for folder, lines, word in ((out, 3, "old"), (new, 4, "new")):
        folder.mkdir()
        for i in range(lines):
            (folder / f"part{i}").write_text(f"{word} {i}\n")
    return out, new, _tree(out), _tree(new)


@pytest.mark.parametrize("step", ["swap", "aside"])
def test_a_kill_while_replacing_a_folder_leaves_one_complete_folder(tmp_path, step):
    """A real SIGKILL inside publish_directory: after the atomic swap the name holds the new folder; on the
    fallback path (move aside, rename in) the next run restores the old one. Either way the next run leaves
    no temporary behind."""
    out, new_folder, old, new = _old_and_new(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _KILL, str(new_folder), str(out), step], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    if step == "swap":
        assert _tree(out) == new  # complete the moment the name changed
    else:
        assert not out.exists()  # the one window of the fallback: only the next run can close it
    textio.remove_temporaries(tmp_path, "data")  # what the next prepare or export does first
    assert _tree(out) == (new if step == "swap" else old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "new"]


def test_publishing_onto_a_file_or_link_replaces_the_name_not_the_target(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    for kind in ("file", "link"):
        out = tmp_path / f"out-{kind}"
        if kind == "file":
            out.write_text("old")
        else:
            out.symlink_to(target)
        staging = tmp_path / "staging"
        staging.mkdir()
        (staging / "a").write_text("new")
        textio.publish_directory(staging, out)
        assert out.is_dir() and not out.is_symlink() and (out / "a").read_text() == "new"
    assert (target / "keep").read_text() == "x"


def test_the_next_prepare_removes_a_killed_prepares_staging_folder(tmp_path, toy_data):
    """`nmt prepare` SIGKILLed the moment its staging folder appears: the next run removes the folder and says
    so in one line."""
    raw = toy_data.parent / "raw"
    cmd = [sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train", str(raw / "train"),
           "--valid", str(raw / "valid"), "--bpe-merges", "20", "--quiet", "--workers", "1", "--out",
           str(tmp_path / "data")]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".data.*.tmp")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    left = list(tmp_path.glob(".data.*.tmp"))
    assert len(left) == 1 and not (tmp_path / "data").exists()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stderr.strip() == f"nmt: removed {left[0]}, the unfinished folder of a killed run"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]
