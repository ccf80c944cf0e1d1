"""nmt average and nmt score."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nmt_cli.decode.translate import Translator
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import load_checkpoint, model_from_checkpoint, model_only, save_checkpoint

from .conftest import expect_error, run_cli


@pytest.fixture(scope="module")
def two_checkpoints(toy_data, tmp_path_factory):
    from nmt_cli.training.trainer import TrainOptions, train

    save = tmp_path_factory.mktemp("avg")
    train(TrainOptions(data=toy_data, save_dir=save, arch="tiny", max_tokens=512, max_updates=6, warmup=10,
                       save_interval_updates=3, device="cpu", precision="fp32", quiet=True))
    return save


def test_average_is_the_parameter_mean(two_checkpoints, tmp_path):
    a, b = two_checkpoints / "checkpoint_3.pt", two_checkpoints / "checkpoint_6.pt"
    out = tmp_path / "avg.pt"
    assert run_cli("average", a, b, "-o", out).exit_code == 0
    avg, sa, sb = load_checkpoint(out), load_checkpoint(a), load_checkpoint(b)
    for name, value in avg["model"].items():
        torch.testing.assert_close(value, (sa["model"][name] + sb["model"][name]) / 2)
    for key in ("config", "vocab", "bpe_codes", "source_lang", "target_lang"):
        assert avg[key] == sb[key]
    assert "optimizer" not in avg
    Translator.from_checkpoint(out).translate(["W1 w2."])  # self-contained

    last = tmp_path / "last.pt"
    assert run_cli("average", "--last", "2", two_checkpoints, "-o", last).exit_code == 0
    for name, value in load_checkpoint(last)["model"].items():
        assert torch.equal(value, avg["model"][name])

    one = tmp_path / "one.pt"
    assert run_cli("average", b, "-o", one).exit_code == 0
    for name, value in load_checkpoint(one)["model"].items():
        assert torch.equal(value, sb["model"][name])


def test_model_only_checkpoint_translates_alike_and_loads_exact_weights(two_checkpoints, tmp_path):
    """What a recipe ships: no training state, the same weights, the same translations; building the model
    for loading skips the random initialisation and leaves torch's initialisers as they were."""
    full = load_checkpoint(two_checkpoints / "checkpoint_last.pt")  # the full training state
    slim_path = tmp_path / "slim.pt"
    save_checkpoint(model_only(full), slim_path)
    slim = load_checkpoint(slim_path)
    assert not {"optimizer", "scaler", "rng", "progress"} & set(slim) and slim["updates"] == full["updates"]
    assert slim_path.stat().st_size < 0.6 * (two_checkpoints / "checkpoint_last.pt").stat().st_size
    numbered = (two_checkpoints / "checkpoint_6.pt").stat().st_size  # training writes numbered ones this way
    assert abs(slim_path.stat().st_size - numbered) < 0.01 * numbered
    model, _ = model_from_checkpoint(slim)
    for name, value in model.state_dict().items():
        assert torch.equal(value, full["model"][name]), name
    sentences = ["W1 w2 w3.", "W4 w5."]
    assert (Translator.from_checkpoint(slim_path).translate(sentences)
            == Translator.from_checkpoint(two_checkpoints / "checkpoint_6.pt").translate(sentences))
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8)
    torch.manual_seed(0)
    assert torch.equal(torch.nn.Linear(8, 8).weight, a.weight) and a.weight.abs().sum() > 0  # init restored


def test_average_refuses_mismatched_checkpoints(two_checkpoints, tmp_path):
    state = torch.load(two_checkpoints / "checkpoint_6.pt", weights_only=True)
    state["vocab"] = state["vocab"][:-1] + ["other"]
    save_checkpoint(state, tmp_path / "other_vocab.pt")
    r = run_cli("average", two_checkpoints / "checkpoint_3.pt", tmp_path / "other_vocab.pt", "-o", tmp_path / "x.pt")
    expect_error(r, "vocabulary differs")
    assert not (tmp_path / "x.pt").exists()
    state["vocab"] = load_checkpoint(two_checkpoints / "checkpoint_6.pt")["vocab"]
    state["config"] = {**state["config"], "ffn": 256}
    save_checkpoint(state, tmp_path / "other_config.pt")
    r = run_cli("average", two_checkpoints / "checkpoint_3.pt", tmp_path / "other_config.pt", "-o", tmp_path / "x.pt")
    expect_error(r, "config differs", "(ffn 128 -> 256)")


def test_average_takes_checkpoints_that_differ_only_in_dropout(two_checkpoints, tmp_path):
    """A run resumed with another dropout holds the same network: its checkpoints average with the earlier ones,
    exactly as if the configs were equal."""
    state = load_checkpoint(two_checkpoints / "checkpoint_6.pt")
    state["config"] = {**state["config"], "dropout": 0.3, "attention_dropout": 0.1, "activation_dropout": 0.2}
    save_checkpoint(state, tmp_path / "resumed.pt")
    first = two_checkpoints / "checkpoint_3.pt"
    assert run_cli("average", first, tmp_path / "resumed.pt", "-o", tmp_path / "mixed.pt").exit_code == 0
    assert run_cli("average", first, two_checkpoints / "checkpoint_6.pt", "-o", tmp_path / "same.pt").exit_code == 0
    mixed, same = load_checkpoint(tmp_path / "mixed.pt"), load_checkpoint(tmp_path / "same.pt")
    assert all(torch.equal(mixed["model"][k], same["model"][k]) for k in same["model"])


HYPS = ["The cat sat on the mat.", "A man rides a well-known bike.", "Two dogs play in the snow!"]
REFS = ["The cat sat on a mat.", "A man is riding a well-known bicycle.", "Two dogs are playing in the snow."]


def test_score_equals_sacrebleu_cli(tmp_path):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("\n".join(HYPS) + "\n")
    ref.write_text("\n".join(REFS) + "\n")
    r = run_cli("score", "--ref", ref, "-i", hyp, "--json")
    assert r.exit_code == 0, r.output
    ours = {x["metric"]: x for x in json.loads(r.stdout)}
    cli = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "ter",
                          "-w", "4", "-b"], capture_output=True, text=True, check=True).stdout
    assert [ours[m]["score"] for m in ("bleu", "chrf", "ter")] == pytest.approx(json.loads(cli), abs=0.01)
    sig = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(sig)["signature"] == ours["bleu"]["signature"]
    # stdin works too, and the table mentions every metric
    r = run_cli("score", "--ref", ref, input="\n".join(HYPS) + "\n")
    assert r.exit_code == 0 and "chrf" in r.stdout and "nrefs:1" in r.stdout


def test_tokenized_compound_split_bleu(tmp_path):
    from nmt_cli.decode.score import score
    from nmt_cli.text.moses import split_compounds

    assert split_compounds("a well-known x-y-z") == "a well ##AT##-##AT## known x ##AT##-##AT## y-z"
    results = {r["metric"]: r for r in score(HYPS, [REFS], ["bleu"], tokenized_bleu_lang="en")}
    assert "tokenized_bleu" in results and results["tokenized_bleu"]["signature"].startswith("moses-tok")
    assert results["tokenized_bleu"]["score"] != results["bleu"]["score"]


def test_score_line_count_mismatch(tmp_path):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("one\ntwo\n")
    ref.write_text("one\n")
    r = run_cli("score", "--ref", ref, "-i", hyp)
    expect_error(r, "has 2 lines")


def test_average_last_names_what_is_wrong_with_its_folder(two_checkpoints, tmp_path):
    expect_error(run_cli("average", "--last", "5", tmp_path / "nosuchdir", "-o", tmp_path / "a.pt"),
                 "nosuchdir: no such save directory")
    a, b = two_checkpoints / "checkpoint_3.pt", two_checkpoints / "checkpoint_6.pt"
    expect_error(run_cli("average", "--last", "5", a, "-o", tmp_path / "a.pt"), "a file, not a save directory")
    expect_error(run_cli("average", "--last", "5", a, b, "-o", tmp_path / "a.pt"), "exactly one save directory",
                 "got 2 paths")
    assert not (tmp_path / "a.pt").exists()


def test_score_says_when_japanese_bleu_falls_back_to_characters(tmp_path, monkeypatch):
    """Without MeCab, --lang ja scores BLEU on characters: said on stderr, not silently."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "MeCab" else real(name, *a))
    (tmp_path / "h").write_text("今日は晴れです。\n", encoding="utf-8")
    (tmp_path / "r").write_text("今日は晴れだ。\n", encoding="utf-8")
    result = run_cli("score", "-i", tmp_path / "h", "-r", tmp_path / "r", "--lang", "ja", "--metrics", "bleu")
    assert result.exit_code == 0, result.output
    assert "MeCab is not installed, so BLEU tokenizes ja by characters" in result.stderr
    assert "sacrebleu[ja]" in result.stderr and "tok:char" in result.stdout
    quiet = run_cli("score", "-i", tmp_path / "h", "-r", tmp_path / "r", "--lang", "de", "--metrics", "bleu")
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr


def test_lowercase_tokenized_bleu_is_the_literatures_multi30k_metric():
    """--metrics lc-bleu: sacreBLEU on lowercased text that sacremoses' own tokenizer then split (no aggressive
    hyphen splits), its reference length reported: on test_2016_flickr.de the 12,103 tokens the multimodal-MT
    papers print (tokenizing before lowercasing keeps line 369's "Bart." whole: 12,102)."""
    import gzip

    import sacrebleu
    from sacremoses import MosesTokenizer

    from nmt_cli.decode.score import score

    from .conftest import shared_data

    with gzip.open(shared_data("multi30k") / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()
    hyps = [" ".join(r.split()[:-2]) + " ." if len(r.split()) > 4 else r for r in refs]  # a lossy "system"
    record = score(hyps, [refs], metrics=["lc-bleu"], lang="de")[0]
    moses = MosesTokenizer("de")

    def tokenized(line: str) -> str:
        return moses.tokenize(line.lower(), escape=False, aggressive_dash_splits=False, return_str=True)

    expected = sacrebleu.corpus_bleu([tokenized(h) for h in hyps], [[tokenized(r) for r in refs]], tokenize="none",
                                     force=True)
    assert record["score"] == pytest.approx(expected.score, abs=1e-4) and record["ref_len"] == expected.ref_len
    assert record["ref_len"] == 12103 and "ref_len = 12103" in record["text"] and 20 < record["score"] < 100
    assert record["signature"].startswith("lowercase+moses-tok:de|")
    with pytest.raises(NmtError, match="lc-bleu tokenizes as the target language does: give --lang"):
        score(hyps, [refs], metrics=["lc-bleu"])
