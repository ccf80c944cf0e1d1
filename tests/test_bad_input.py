"""Every bad input the commands read gives one line on stderr naming the problem, and exit code 2."""

from __future__ import annotations

import json

import pytest

from nmt_cli.checkpoint import load_checkpoint, save_checkpoint

from .conftest import expect_error, run_cli, write_task


@pytest.fixture()
def raw(tmp_path):
    write_task(tmp_path / "raw" / "train", 30, seed=1)
    write_task(tmp_path / "raw" / "val", 5, seed=2)
    return tmp_path / "raw"


def test_prepare_options(raw, tmp_path):
    base = ["prepare", "--train", raw / "train", "--valid", raw / "val", "--out", tmp_path / "o", "--quiet"]
    expect_error(run_cli(*base, "-s", "en", "-t", "en"), "both 'en'")
    expect_error(run_cli(*base, "-s", "en", "-t", "de", "--max-len", "0"), "--max-len")


def test_bpe_subcommands(raw, tmp_path):
    expect_error(run_cli("learn-bpe", raw / "missing.en", "-o", tmp_path / "c"), "missing.en", "no such file")
    expect_error(run_cli("learn-bpe", raw / "train.en", "-m", "0", "-o", tmp_path / "c"), "--merges")
    (tmp_path / "empty").write_text("\n\n")
    expect_error(run_cli("learn-bpe", tmp_path / "empty", "-o", tmp_path / "c"), "empty corpus")
    (tmp_path / "bad").write_bytes(b"ok\n\xc3\x28\n")
    expect_error(run_cli("learn-bpe", tmp_path / "bad", "-o", tmp_path / "c"), "bad:2", "UTF-8")
    assert not (tmp_path / "c").exists()
    expect_error(run_cli("apply-bpe", "-c", tmp_path / "nocodes", "-i", raw / "train.en"), "nocodes", "no such file")


def test_binarize_existing_output_and_broken_data_dir(toy_data, raw, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    expect_error(run_cli("binarize", "-s", "en", "-t", "de", "--train", raw / "train", "--valid", raw / "val",
                         "--out", out), "already exists")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in toy_data.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    args = ["train", broken, "--save-dir", tmp_path / "ck", "--arch", "tiny", "--max-updates", "1", "--quiet"]
    (broken / "train.en.bin").write_bytes((broken / "train.en.bin").read_bytes()[:-10])
    expect_error(run_cli(*args), "train.en.bin", "index expects")
    (broken / "meta.json").write_text("{ not json")
    expect_error(run_cli(*args), "meta.json", "not valid JSON")


def test_train_options(toy_data, tmp_path):
    args = ["train", toy_data, "--save-dir", tmp_path / "ck", "--max-updates", "1", "--quiet", "--device", "cpu"]
    expect_error(run_cli(*args, "--arch", "huge"), "nmt train: error:", "--arch", "'huge' is not one of")
    expect_error(run_cli(*args, "--arch", "tiny", "--heads", "3"), "not divisible by --heads 3")
    expect_error(run_cli(*args, "--arch", "tiny", "--update-freq", "0"), "--update-freq")
    expect_error(run_cli(*args, "--arch", "tiny", "--precision", "fp8"), "--precision", "'fp8' is not one of")
    expect_error(run_cli(*args[:-2], "--arch", "tiny", "--device", "tpu"), "--device", "'tpu' is not one of")


def test_translate_inputs(toy_model, tmp_path):
    expect_error(run_cli("translate", "-m", toy_model, input=b"W1 w2.\n\xff\xfe\n"), "<stdin>:2", "UTF-8")
    expect_error(run_cli("translate", "-m", toy_model, "--beam", "0", input="W1.\n"), "--beam")
    state = load_checkpoint(toy_model)
    state["vocab"] = state["vocab"][:-1] + ["other"]
    save_checkpoint(state, tmp_path / "other.pt")
    expect_error(run_cli("translate", "-m", toy_model, "-m", tmp_path / "other.pt", input="W1.\n"),
                 "other.pt", "cannot ensemble")
    del state["bpe_codes"]
    save_checkpoint(state, tmp_path / "partial.pt")
    expect_error(run_cli("translate", "-m", tmp_path / "partial.pt", input="W1.\n"), "lacks bpe_codes")


def test_average_arguments(toy_model, tmp_path):
    expect_error(run_cli("average", "-o", tmp_path / "a.pt"), "give checkpoints")
    expect_error(run_cli("average", "--last", "2", toy_model, "-o", tmp_path / "a.pt"), "one save directory")
    expect_error(run_cli("average", "--last", "2", tmp_path, "-o", tmp_path / "a.pt"), "no numbered checkpoints")
    expect_error(run_cli("average", tmp_path / "nope.pt", "-o", tmp_path / "a.pt"), "nope.pt", "no such checkpoint")


def test_score_inputs(tmp_path):
    ref = tmp_path / "ref"
    ref.write_text("a b c\n")
    expect_error(run_cli("score", "--ref", ref, "--metrics", "meteor", input="a b c\n"), "unknown metric 'meteor'")
    expect_error(run_cli("score", "--ref", ref, input=b"\xff\n"), "<stdin>", "UTF-8")
    expect_error(run_cli("score", "--ref", tmp_path / "none", input="a\n"), "none", "no such file")
    ok = run_cli("score", "--ref", ref, "--json", "--metrics", "chrf", input="a b c\n")
    assert json.loads(ok.stdout)[0]["score"] == 100.0
