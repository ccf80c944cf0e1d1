"""Several training corpora in one data dir: per-corpus filter counts, weighted epochs, and weights of 1 training
exactly as one concatenated corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from nmt_cli.cli.main import app
from nmt_cli.data.binarized import CORPUS_FILE, DataDir, epoch_sample, weighted_batches
from nmt_cli.data.prepare import PrepareOptions, prepare
from nmt_cli.model.checkpoint import load_checkpoint
from nmt_cli.training.trainer import TrainOptions, train

from .conftest import threshold, write_task

runner = CliRunner()


def _write(prefix: Path, pairs: list[tuple[str, str]]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for side, lang in enumerate(("en", "de")):
        Path(f"{prefix}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")


def _pairs(prefix: Path) -> list[tuple[str, str]]:
    src, tgt = (Path(f"{prefix}.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    return list(zip(src, tgt))


@pytest.fixture
def corpora(tmp_path) -> dict[str, Path]:
    """Two made-up corpora with known defects, and a validation set: `clean` (250 distinct toy pairs, 5 of them
    repeated), `noisy` (150 others, plus 7 copies, 4 empty sides, 3 over --max-len, 6 pairs of `clean`)."""
    write_task(tmp_path / "a", 300, seed=1)
    write_task(tmp_path / "b", 200, seed=2)
    write_task(tmp_path / "valid", 40, seed=3)
    clean = list(dict.fromkeys(_pairs(tmp_path / "a")))[:250]  # distinct pairs: the defects are the only ones
    noisy = [p for p in dict.fromkeys(_pairs(tmp_path / "b")) if p not in clean][:150]
    clean += clean[:5]
    noisy += [("W1 w2 w3.", "W1 w2 w3.")] * 1 + [(f"W{i} w9.", f"W{i} w9.") for i in range(6)]
    noisy += [("", "V1 v2."), ("W1 w2.", ""), ("", "V3."), ("W4.", "")]
    noisy += [(" ".join(["w1"] * 60), " ".join(["v1"] * 60))] * 3
    noisy += clean[10:16]
    _write(tmp_path / "clean", clean)
    _write(tmp_path / "noisy", noisy)
    return {"clean": tmp_path / "clean", "noisy": tmp_path / "noisy", "valid": tmp_path / "valid"}


def _prepare(corpora: dict[str, Path], out: Path, train: list[str], weights: tuple = ()) -> dict:
    return prepare(PrepareOptions("en", "de", train, str(corpora["valid"]), out, bpe_merges=50, workers=1,
                                  quiet=True, max_len=40, train_weights=weights))


def test_each_corpus_reports_what_each_filter_removed(corpora, tmp_path):
    meta = _prepare(corpora, tmp_path / "data", [str(corpora["clean"]), str(corpora["noisy"])], (2.0, 0.5))
    clean, noisy = meta["corpora"]
    assert (clean["name"], clean["weight"], noisy["name"], noisy["weight"]) == ("clean", 2.0, "noisy", 0.5)
    assert clean["input_sentences"] == 255 and clean["kept"] == 250
    assert clean["dropped"] == {**dict.fromkeys(clean["dropped"], 0), "duplicate": 5}
    assert noisy["input_sentences"] == 150 + 7 + 4 + 3 + 6
    assert noisy["dropped"]["copy"] == 7 and noisy["dropped"]["empty"] == 4
    assert noisy["dropped"]["too_long"] == 3  # 60 words over --max-len 40; two repeats of it are not duplicates
    assert noisy["dropped"]["duplicate"] == 6  # pairs of `clean` seen again
    assert noisy["kept"] == 150
    data = DataDir.open(tmp_path / "data")
    ids = np.load(tmp_path / "data" / CORPUS_FILE)
    assert len(ids) == len(data.split("train")) == 400 and (ids[:250] == 0).all() and (ids[250:] == 1).all()
    assert meta["splits"]["train"]["filtered"]["kept"] == 400


def test_weighted_epochs_give_each_corpus_its_share_of_target_tokens(corpora, tmp_path):
    """Over 40 epochs of batches, each corpus's share of target tokens is weight x tokens / sum (within 2% of
    the share; a pair's extra copy is drawn per epoch)."""
    _prepare(corpora, tmp_path / "data", [str(corpora["clean"]), str(corpora["noisy"])], (2.0, 0.5))
    data = DataDir.open(tmp_path / "data")
    ids, weights = data.corpus_weights()
    train_split = data.split("train")
    tokens = train_split.tgt.sizes + 1
    per_corpus = np.bincount(ids, weights=tokens)
    expected = np.array(weights) * per_corpus / (np.array(weights) * per_corpus).sum()
    seen = np.zeros(2)
    for epoch in range(1, 41):
        batches = weighted_batches(train_split.src.sizes, train_split.tgt.sizes, ids, weights, 512, 1, epoch)
        sample = np.concatenate(batches)
        seen += np.bincount(ids[sample], weights=tokens[sample], minlength=2)
    shares = seen / seen.sum()
    threshold("weighted epochs: largest relative share error", float(np.abs(shares / expected - 1).max()), high=0.02)
    assert abs(expected[0] - 0.5) > 0.3  # the weights move the shares far from the corpora's own sizes
    assert not np.array_equal(epoch_sample(ids, weights, 1, 1), epoch_sample(ids, weights, 1, 2))  # drawn anew
    assert (np.sort(epoch_sample(ids, [1.0, 1.0], 1, 5)) == np.arange(len(ids))).all()


def test_weights_of_one_train_as_one_concatenated_corpus(corpora, tmp_path):
    """Two corpora at weight 1 and the same pairs as one corpus: the same batches, so the same weights after
    30 updates, bit for bit; a weighted run logs each corpus's share."""
    both = tmp_path / "both"
    _write(both, _pairs(corpora["clean"]) + _pairs(corpora["noisy"]))
    _prepare(corpora, tmp_path / "two", [str(corpora["clean"]), str(corpora["noisy"])])
    _prepare(corpora, tmp_path / "one", [str(both)])
    runs = {}
    for name in ("two", "one"):
        train(TrainOptions(data=tmp_path / name, save_dir=tmp_path / f"ckpt-{name}", arch="tiny", max_tokens=512,
                           max_updates=30, warmup=10, device="cpu", precision="fp32", quiet=True, seed=3))
        runs[name] = load_checkpoint(tmp_path / f"ckpt-{name}" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(runs["two"][k], runs["one"][k]) for k in runs["one"])
    result = runner.invoke(app, ["prepare", "-s", "en", "-t", "de", "--train", str(corpora["clean"]), "--train",
                                 str(corpora["noisy"]), "--train-weight", "3", "--train-weight", "1", "--valid",
                                 str(corpora["valid"]), "--out", str(tmp_path / "weighted"), "--bpe-merges", "50",
                                 "--max-len", "40", "--workers", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    train(TrainOptions(data=tmp_path / "weighted", save_dir=tmp_path / "ckpt-w", arch="tiny", max_tokens=512,
                       max_updates=5, warmup=10, device="cpu", precision="fp32", quiet=True, seed=3))
    log = [json.loads(x) for x in (tmp_path / "ckpt-w" / "train.jsonl").read_text().splitlines()]
    shares = [r for r in log if r["event"] == "corpora"][0]
    assert shares["weights"] == {"clean": 3.0, "noisy": 1.0}
    assert shares["target_token_shares"]["clean"] > 0.75


def test_weights_that_do_not_match_the_corpora_get_one_line(corpora, tmp_path):
    for weights, expect in ((["2"], "--train-weight given 1 times for 2 --train corpora"),
                            (["1", "-1"], "--train-weight -1.0: a weight is a positive number")):
        args = ["prepare", "-s", "en", "-t", "de", "--train", str(corpora["clean"]), "--train", str(corpora["noisy"]),
                "--valid", str(corpora["valid"]), "--out", str(tmp_path / "data")]
        for w in weights:
            args += ["--train-weight", w]
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and expect in result.output and len(result.output.strip().splitlines()) == 1, (
            result.output)
        assert not (tmp_path / "data").exists()


def test_language_identification_drops_pairs_in_other_languages(tmp_path):
    """--langid 0.5 on 200 real Multi30k en-de pairs (long captions: language identification is reliable there)
    into which 10 French targets and 5 Czech sources were mixed: exactly those 15 are dropped, counted as
    `language`; without --langid they stay. A threshold outside [0, 1] is one line."""
    import gzip

    from .conftest import require_extra, shared_data

    require_extra("py3langid")

    data = shared_data("multi30k")

    def lines(lang: str) -> list[str]:
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            return [next(f).rstrip("\n") for _ in range(3000)]

    en, de, fr, cs = lines("en"), lines("de"), lines("fr"), lines("cs")
    long = [i for i in range(3000) if len(en[i].split()) >= 12 and len(de[i].split()) >= 10][:215]
    pairs = [(en[i], de[i]) for i in long[:200]]
    pairs += [(en[i], fr[i]) for i in long[200:210]] + [(cs[i], de[i]) for i in long[210:215]]
    _write(tmp_path / "mixed", pairs)
    write_task(tmp_path / "valid", 20, seed=3)
    opts = dict(bpe_merges=200, workers=1, quiet=True, max_ratio=3.0)
    with_langid = prepare(PrepareOptions("en", "de", str(tmp_path / "mixed"), str(tmp_path / "valid"),
                                         tmp_path / "with", langid=0.5, **opts))
    without = prepare(PrepareOptions("en", "de", str(tmp_path / "mixed"), str(tmp_path / "valid"), tmp_path / "without",
                                     **opts))
    assert with_langid["splits"]["train"]["filtered"]["dropped"]["language"] == 15
    assert with_langid["splits"]["train"]["filtered"]["kept"] == 200
    assert without["splits"]["train"]["filtered"]["kept"] == 215
    result = runner.invoke(app, ["prepare", "-s", "en", "-t", "de", "--train", str(tmp_path / "mixed"), "--valid",
                                 str(tmp_path / "valid"), "--out", str(tmp_path / "bad"), "--langid", "2"])
    assert result.exit_code == 2 and "--langid 2.0: a probability between 0 and 1" in result.output
