"""Shared fixtures: real data paths, a synthetic translation task, a tiny prepared corpus and trained model.

The rule for numeric thresholds (see tests/README.md): the development machines come in two kinds (Intel Xeon
with AMX, AMD EPYC without), whose matrix-product kernels round differently, so a trained model, a BLEU score or
a loss differs from one kind to the other. A threshold on such a figure goes through `threshold`, carries a margin
measured on the kind it was tuned on (written beside it), and sits where a different random seed, a far larger
perturbation than rounding, still passes. Nothing asserts bit-level equality across machines; within one machine
and one process, exactness tests (batched vs single, cache vs none, resumed vs straight) stay exact.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two test processes: one thread each (and for the processes a test starts), so that they
    # share the cores instead of each running two threads that wait for each other's core. Set before torch loads.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
from typer.testing import CliRunner

from nmt_cli.cli.main import app

REPO = Path(__file__).resolve().parents[1]
from nmt_cli.training.toy_task import write_word_mapping_task as write_task  # noqa: E402  (also `make gpu-check`'s)

SHARED_DATA = REPO.parent / "shared" / "data"


def shared_data(name: str) -> Path:
    """A corpus under ../shared/data; fails loudly under CI when missing, skips elsewhere."""
    path = SHARED_DATA / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing; CI needs ../shared/data")
        pytest.skip(f"{path} not available")
    return path


def require_extra(module: str):
    """An optional dependency's module; a test without it skips, except under CI, which installs every extra."""
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module)


def require_tcmalloc() -> None:
    """Skip a test of tcmalloc where it is not installed, except under CI, which installs it."""
    from nmt_cli.torch_env import find_allocator

    if find_allocator("tcmalloc") is None:
        if os.environ.get("CI"):
            pytest.fail("tcmalloc is not installed (.ci/run installs libtcmalloc-minimal4)")
        pytest.skip("tcmalloc is not installed (apt install libtcmalloc-minimal4)")


def mapped_allocator(pid: int, timeout: float = 120) -> str:
    """The tcmalloc or jemalloc library process `pid` runs on ("system" for none), read from its memory map once
    torch is loaded (a command that preloads one executes itself again before it imports torch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maps = Path(f"/proc/{pid}/maps").read_text()
        if "libtorch_cpu" in maps:
            names = [Path(line.split()[-1]).name for line in maps.splitlines() if "lib" in line.split()[-1]]
            return next((name for name in names if name.startswith(("libtcmalloc", "libjemalloc"))), "system")
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not load torch within {timeout} s")


def threshold(what: str, value: float, *, low: float | None = None, high: float | None = None) -> None:
    """Assert low <= value <= high (either bound may be None). With NMT_MARGINS=FILE in the environment, also
    append the measured value, its bounds and this machine's kind to FILE as a JSON line (`make test-margins`)."""
    if os.environ.get("NMT_MARGINS"):
        from nmt_cli.hardware import cpu_kind

        margins = [m for m in ((value - low) if low is not None else None,
                               (high - value) if high is not None else None) if m is not None]
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0], "what": what,
                  "value": value, "low": low, "high": high, "margin": min(margins), "kind": cpu_kind()}
        with open(os.environ["NMT_MARGINS"], "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    assert low is None or value >= low, f"{what}: {value} < {low}"
    assert high is None or value <= high, f"{what}: {value} > {high}"


def run_cli(*args: str, input: str | bytes | None = None):
    """Invoke `nmt` in-process; returns click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def expect_error(result, *fragments: str) -> None:
    """A command failed as bad input must: exit code 2, one line on stderr holding every fragment, no traceback."""
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in message, message


@pytest.fixture(scope="session")
def warm_nmt(tmp_path_factory):
    """The `nmt` command for the recipe rehearsals' NMT=: a client of one server that imported the toolkit once
    (tests/warm_nmt.py), so a rehearsal's ~20-30 steps skip ~4 s of start-up each."""
    import subprocess
    import sys

    socket_path = tmp_path_factory.mktemp("warm") / "nmt.sock"
    script = REPO / "tests" / "warm_nmt.py"
    server = subprocess.Popen([sys.executable, str(script), "serve", str(socket_path)], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "tests/warm_nmt.py did not start"
        yield f"{sys.executable} {script} {socket_path}"
    finally:
        server.kill()
        server.wait()


@pytest.fixture(scope="session")
def warm_nmt_path(warm_nmt, tmp_path_factory) -> str:
    """A folder holding an `nmt` that is `warm_nmt`'s client, to put first on a PATH."""
    folder = tmp_path_factory.mktemp("warm_bin")
    shim = folder / "nmt"
    shim.write_text(f'#!/bin/sh\nexec {warm_nmt} "$@"\n')
    shim.chmod(0o755)
    return str(folder)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, made by `build(folder)` once per test run: under pytest-xdist the first process to
    ask builds it (the others wait on a lock) and every process reads the same copy, as in a serial run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each process's own
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed in another process left
            build(folder)
            done.touch()
    return folder


def _build_toy_data(root: Path) -> None:
    from nmt_cli.data.prepare import PrepareOptions, prepare

    write_task(root / "raw" / "train", 1200, seed=1)
    write_task(root / "raw" / "valid", 60, seed=2)
    prepare(PrepareOptions("en", "de", str(root / "raw" / "train"), str(root / "raw" / "valid"), root / "data",
                           bpe_merges=30, workers=1, quiet=True))


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> Path:
    """A prepared data dir of the toy task."""
    return built_once(tmp_path_factory, "toy", _build_toy_data) / "data"


TOY_TRAINING = dict(arch="tiny", dropout=0.0, max_tokens=1024, max_updates=800, warmup=100, cooldown=0.3,
                    lr_scale=1.0, device="cpu", precision="fp32", quiet=True, seed=3)


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory, toy_data) -> Path:
    """A tiny model trained on the toy task until it has converged. The cool-down matters: at a constant high
    learning rate the last update decided the outcome (600 updates without it: 28 of 40 exact outputs on the
    Intel kind, 36+ on the AMD kind); with it, the valid perplexity reaches its floor (1/0.9 under label
    smoothing 0.1) on every seed tried (tests/README.md)."""
    from nmt_cli.training.trainer import TrainOptions, train

    def build(save: Path) -> None:
        train(TrainOptions(data=toy_data, save_dir=save, **TOY_TRAINING))

    return built_once(tmp_path_factory, "toy_ckpt", build) / "checkpoint_last.pt"


def _build_multi30k_tiny(root: Path) -> None:
    import gzip

    from nmt_cli.data.prepare import PrepareOptions, prepare
    from nmt_cli.training.trainer import TrainOptions, train

    src = shared_data("multi30k")
    root.mkdir(parents=True)
    for split, n in (("train", 3000), ("val", 100)):
        for lang in ("en", "de"):
            with gzip.open(src / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                (root / f"{split}.{lang}").write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
    prepare(PrepareOptions("en", "de", str(root / "train"), str(root / "val"), root / "data", bpe_merges=1000,
                           workers=1, quiet=True))
    train(TrainOptions(data=root / "data", save_dir=root / "ckpt", arch="tiny", max_tokens=2048, max_updates=200,
                       warmup=100, lr_scale=2.0, device="cpu", precision="fp32", quiet=True, seed=1))


@pytest.fixture(scope="session")
def multi30k_tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A `tiny` model briefly trained on 3,000 real Multi30k pairs, and the folder of its raw val text."""
    root = built_once(tmp_path_factory, "m30k_tiny", _build_multi30k_tiny)
    return root / "ckpt" / "checkpoint_last.pt", root


def recipe_module(name: str):
    """A recipe script of recipes/ as a module."""
    import importlib

    if str(REPO / "recipes") not in sys.path:
        sys.path.insert(0, str(REPO / "recipes"))
    return importlib.import_module(name)
