"""BPE-dropout (nmt prepare --bpe-dropout): draws of the training pairs that are subword-nmt's own dropout
segmentations of the same words, and training that reads one draw per epoch, in turn, resuming exactly."""

from __future__ import annotations

import gzip
import io
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from subword_nmt.apply_bpe import BPE

from nmt_cli.data.binarized import DataDir, dropout_split
from nmt_cli.data.prepare import PrepareOptions, prepare, summary_line
from nmt_cli.model.checkpoint import load_checkpoint
from nmt_cli.text.moses import BPE_SEPARATOR, remove_bpe
from nmt_cli.training.trainer import Trainer, TrainOptions, train

from .conftest import expect_error, run_cli, shared_data, write_task


@pytest.fixture(scope="module")
def captions(tmp_path_factory) -> Path:
    """The first 400 training and 50 val pairs of Multi30k en-de (real words, which BPE splits into many pieces)."""
    root = tmp_path_factory.mktemp("captions")
    src = shared_data("multi30k")
    for split, name, n in (("train", "train", 400), ("val", "valid", 50)):
        for lang in ("en", "de"):
            with gzip.open(src / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                (root / f"{name}.{lang}").write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
    return root


def _prepare(raw: Path, out: Path, workers: int = 1, **kw) -> dict:
    return prepare(PrepareOptions("en", "de", str(raw / "train"), str(raw / "valid"), out, bpe_merges=300,
                                  workers=workers, quiet=True, **kw))


def _lines(data: DataDir, split: str, side: str) -> list[str]:
    corpus = data.split(split)
    dataset = corpus.src if side == "src" else corpus.tgt
    return [" ".join(data.vocab.symbols[i] for i in dataset[k]) for k in range(len(dataset))]


def test_draws_are_subword_nmts_dropout_of_the_same_words(captions, tmp_path):
    """Each draw holds train's pairs, word for word, in subword-nmt's own BPE-dropout segmentation drawn from the
    draw's seed; the draws differ from train and from each other, hold more pieces, and no unknown one; the
    worker count changes nothing."""
    meta = _prepare(captions, tmp_path / "data", bpe_dropout=0.1, bpe_dropout_copies=3)
    assert meta["bpe_dropout"] == {"p": 0.1, "copies": 3}
    line = summary_line(meta, tmp_path / "data")
    assert "; BPE-dropout 0.1: 3 draws of train" in line and "train-bpe-dropout" not in line
    data = DataDir.open(tmp_path / "data")
    assert len(data.dropout_draws()) == 3
    codes = (tmp_path / "data" / "bpe.codes").read_text(encoding="utf-8")
    reference = BPE(io.StringIO(codes), separator=BPE_SEPARATOR)
    for side_number, side in enumerate(("src", "tgt")):
        train_lines = _lines(data, "train", side)
        words = [remove_bpe(line).split() for line in train_lines]
        draws = []
        for draw in range(1, 4):
            lines = _lines(data, dropout_split(draw), side)
            random.seed(f"{draw} 0 {side_number}")  # the one chunk's seed (400 lines < a chunk)
            expected = [" ".join(" ".join(reference.segment_tokens([w], dropout=0.1)) for w in line) for line in words]
            assert lines == expected
            draws.append(lines)
            assert [remove_bpe(line).split() for line in lines] == words
        pieces = [sum(len(line.split()) for line in lines) for lines in (train_lines, *draws)]
        assert all(n > 1.04 * pieces[0] for n in pieces[1:]), pieces  # 1.07x at p = 0.1 with 300 merges
        assert draws[0] != draws[1] != draws[2] != train_lines
    for name in ("train", *(dropout_split(k) for k in (1, 2, 3))):
        assert meta["splits"][name]["en"]["unk"] == meta["splits"][name]["de"]["unk"] == 0, name
    _prepare(captions, tmp_path / "two-workers", workers=2, bpe_dropout=0.1, bpe_dropout_copies=3)
    for path in (tmp_path / "data").glob("train*.bin"):
        assert path.read_bytes() == (tmp_path / "two-workers" / path.name).read_bytes(), path.name


def _train(data: Path, save: Path, **kw) -> dict:
    return train(TrainOptions(data=data, save_dir=save, arch="tiny", max_tokens=1024, warmup=20, device="cpu",
                              precision="fp32", quiet=True, seed=5, dropout=0.1, **kw))


def test_each_epoch_reads_the_next_draw_and_a_resume_is_exact(tmp_path):
    """Epoch E trains on draw (E - 1) mod 2: one epoch on the draws' data equals, bit for bit, one epoch on a
    copy of the data whose train is draw 1; three epochs in one run equal one epoch, then a resume to three."""
    write_task(tmp_path / "raw" / "train", 300, seed=1)
    write_task(tmp_path / "raw" / "valid", 30, seed=2)
    _prepare(tmp_path / "raw", tmp_path / "data", bpe_dropout=0.3, bpe_dropout_copies=2)
    data = tmp_path / "data"
    trainer = Trainer(TrainOptions(data=data, save_dir=tmp_path / "unused", arch="tiny", device="cpu", quiet=True))
    paths = [trainer.epoch_corpus(epoch).src.sizes.tolist() for epoch in range(1, 6)]
    draws = [d.src.sizes.tolist() for d in DataDir.open(data).dropout_draws()]
    assert paths == [draws[0], draws[1], draws[0], draws[1], draws[0]] and draws[0] != draws[1]

    only_first = tmp_path / "draw-1-as-train"
    shutil.copytree(data, only_first)
    for suffix in ("en.bin", "en.idx", "de.bin", "de.idx"):
        shutil.copy(data / f"{dropout_split(1)}.{suffix}", only_first / f"train.{suffix}")
    meta = json.loads((only_first / "meta.json").read_text())
    del meta["bpe_dropout"]
    (only_first / "meta.json").write_text(json.dumps(meta))
    _train(data, tmp_path / "one-epoch", max_epochs=1)
    _train(only_first, tmp_path / "plain-one-epoch", max_epochs=1)
    a = load_checkpoint(tmp_path / "one-epoch" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(tmp_path / "plain-one-epoch" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)

    _train(data, tmp_path / "straight", max_epochs=3)
    shutil.copytree(tmp_path / "one-epoch", tmp_path / "resumed")
    summary = _train(data, tmp_path / "resumed", max_epochs=3)
    assert summary["epoch"] > 3
    a = load_checkpoint(tmp_path / "straight" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flags, fragment", [
    (["--bpe-dropout", "1"], "--bpe-dropout must be at least 0 and below 1 (got 1.0)"),
    (["--bpe-dropout", "0.1", "--bpe-dropout-copies", "0"], "--bpe-dropout-copies must be at least 1 (got 0)"),
    (["--bpe-dropout", "0.1", "--tokenizer", "sentencepiece"], "--bpe-dropout drops BPE merges: it needs"),
])
def test_bad_dropout_flags_get_one_line(tmp_path, flags, fragment):
    write_task(tmp_path / "train", 50, seed=1)
    result = run_cli("prepare", "-s", "en", "-t", "de", "--train", tmp_path / "train", "--valid", tmp_path / "train",
                     "--out", tmp_path / "data", *flags)
    expect_error(result, fragment)
    assert not (tmp_path / "data").exists()
