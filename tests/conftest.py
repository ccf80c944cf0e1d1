"""Shared fixtures: real data paths, a synthetic translation task, a tiny prepared corpus and trained model."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nmt_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
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


def write_task(prefix: Path, n: int, seed: int) -> None:
    """A toy translation task: each source word w<i> maps to target word v<i>, order kept."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.randrange(24) for _ in range(rng.randint(2, 7))]
        src.append(" ".join(f"w{i}" for i in words).capitalize() + ".")
        tgt.append(" ".join(f"v{i}" for i in words).capitalize() + ".")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    Path(f"{prefix}.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> Path:
    """A prepared data dir of the toy task."""
    from nmt_cli.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("toy")
    write_task(root / "raw" / "train", 1200, seed=1)
    write_task(root / "raw" / "valid", 60, seed=2)
    out = root / "data"
    prepare(PrepareOptions("en", "de", str(root / "raw" / "train"), str(root / "raw" / "valid"), out,
                           bpe_merges=30, workers=1, quiet=True))
    return out


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory, toy_data) -> Path:
    """A tiny model trained on the toy task until it translates it."""
    from nmt_cli.train import TrainOptions, train

    save = tmp_path_factory.mktemp("toy_ckpt")
    train(TrainOptions(data=toy_data, save_dir=save, arch="tiny", dropout=0.0, max_tokens=1024, max_updates=600,
                       warmup=100, lr_scale=1.0, device="cpu", quiet=True, seed=3))
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def multi30k_tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A `tiny` model briefly trained on 3,000 real Multi30k pairs, and the folder of its raw val text."""
    import gzip

    from nmt_cli.prepare import PrepareOptions, prepare
    from nmt_cli.train import TrainOptions, train

    src = shared_data("multi30k")
    root = tmp_path_factory.mktemp("m30k_tiny")
    for split, n in (("train", 3000), ("val", 100)):
        for lang in ("en", "de"):
            with gzip.open(src / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                (root / f"{split}.{lang}").write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
    prepare(PrepareOptions("en", "de", str(root / "train"), str(root / "val"), root / "data", bpe_merges=1000,
                           workers=1, quiet=True))
    train(TrainOptions(data=root / "data", save_dir=root / "ckpt", arch="tiny", max_tokens=2048, max_updates=200,
                       warmup=100, lr_scale=2.0, device="cpu", quiet=True, seed=1))
    return root / "ckpt" / "checkpoint_last.pt", root
