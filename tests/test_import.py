"""`nmt import transformers`: MarianMT and FSMT folders built with Transformers' own classes translate in nmt as
`model.generate` translates them, fine-tune, and export back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt_cli.cli.main import app
from nmt_cli.decode.translate import Translator
from nmt_cli.export.hf_import import import_transformers
from nmt_cli.model.checkpoint import load_checkpoint

from .conftest import require_extra, shared_data
from .hf_models import (
    LANGUAGE_TOKENS,
    build_fsmt,
    build_marian,
    multi30k_lines,
    target_ids_of,
    transformers_generate,
    transformers_greedy_log_probs,
)

LIMIT = 40  # output tokens before </s>: random models often reach it, so the rule at the limit is tested too
LINES = 40
runner = CliRunner()

BUILDS = {"marian-tied": (build_marian, True), "marian-untied": (build_marian, False),
          "fsmt-tied": (build_fsmt, True), "fsmt-untied": (build_fsmt, False)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    require_extra("transformers")
    data = shared_data("multi30k")
    root = tmp_path_factory.mktemp("hf_folders")
    return {name: build(root / name, data, tied) for name, (build, tied) in BUILDS.items()}


def nmt_output_ids(translator: Translator, folder: Path, sources: list[str], beam: int) -> tuple[list, list]:
    """nmt's output as the folder's own target ids, and its text."""
    to_folder = target_ids_of(folder)
    found: list = []
    texts = translator.translate(sources, beam=beam, lenpen=0.0, greedy=beam == 1, max_len_a=0, max_len_b=LIMIT,
                                 ids_out=found)
    symbols = translator.target_vocab.symbols
    return [[to_folder[symbols[i]] for i in ids] for _, ids in found], texts


def nmt_log_probs(translator: Translator, source: str, output: list[int]) -> torch.Tensor:
    """nmt's log-probability of each token of `output` (nmt ids, then </s>) teacher-forced on `source`."""
    model, vocab = translator.ensemble.models[0], translator.target_vocab
    src = torch.tensor([translator.encode([source])[0] + [vocab.eos]])
    with torch.no_grad():
        hidden = model(src, torch.tensor([[vocab.bos] + output]))
        log_probs = torch.log_softmax(model.logits(hidden)[0].float(), -1)
    return log_probs.gather(1, torch.tensor(output + [vocab.eos])[:, None])[:, 0]


@pytest.mark.parametrize("name", list(BUILDS))
def test_imported_model_translates_as_transformers_generate(folders, tmp_path, name):
    """Greedy and beam 4, 40 Multi30k val lines: the same output ids and text as Transformers' generate under
    nmt's rules (tests/hf_models.nmt_rules), per-token log-probabilities within 1e-4; tied and untied
    embeddings, separate vocabularies, swish and relu, Marian's logit bias and target-language token."""
    folder = folders[name]
    target_token = LANGUAGE_TOKENS[0] if name == "marian-tied" else ""
    out = tmp_path / "model.pt"
    summary = import_transformers(folder, out, target_token=target_token or None)
    assert summary["tied_output"] == (name == "marian-tied")  # FSMT's decoder starts with </s>, not <s>
    assert summary["shared_embeddings"] == name.endswith("-tied")
    sources = multi30k_lines(shared_data("multi30k"), "val", "en", LINES)
    translator = Translator.from_checkpoint(out)
    for beam in (1, 4):
        hf_ids, hf_text = transformers_generate(folder, sources, beam, LIMIT, target_token)
        ids, text = nmt_output_ids(translator, folder, sources, beam)
        assert ids == hf_ids, f"beam {beam}"
        assert text == hf_text, f"beam {beam}"
    assert len({tuple(x) for x in hf_ids}) >= 10  # the outputs depend on the source: a wrong mapping shows
    to_folder = target_ids_of(folder)
    for source in sources[:8]:
        hf_tokens, theirs = transformers_greedy_log_probs(folder, source, LIMIT, target_token)
        found: list = []
        translator.translate([source], greedy=True, max_len_a=0, max_len_b=LIMIT, ids_out=found)
        output = found[0][1]
        assert [to_folder[translator.target_vocab.symbols[i]] for i in output] == hf_tokens
        ours = nmt_log_probs(translator, source, output)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_round_trip_through_transformers(multi30k_tiny, tmp_path):
    """nmt's own Multi30k model -> nmt export transformers (FSMT) -> nmt import transformers: the same ids."""
    require_extra("transformers")
    checkpoint, root = multi30k_tiny
    from nmt_cli.export.hf import export_transformers

    export_transformers(checkpoint, tmp_path / "hf")
    import_transformers(tmp_path / "hf", tmp_path / "back.pt")
    sources = (root / "val.en").read_text(encoding="utf-8").splitlines()[:30]
    first, second = Translator.from_checkpoint(checkpoint), Translator.from_checkpoint(tmp_path / "back.pt")
    a, b = [], []
    assert first.translate(sources, beam=4, ids_out=a) == second.translate(sources, beam=4, ids_out=b)
    assert [first.target_vocab.symbols[i] for _, ids in a for i in ids] == [
        second.target_vocab.symbols[i] for _, ids in b for i in ids]


def test_fine_tune_imported_marian_then_export(folders, tmp_path):
    """Import -> prepare --from-model (the imported SentencePiece pair and vocabularies) -> train --init-from for
    30 updates: the validation loss falls; the model averaged and exported back to Transformers translates as
    nmt does (beam 4), and so does its CTranslate2 export (greedy)."""
    from nmt_cli.data.binarized import DataDir

    folder = folders["marian-untied"]
    data = shared_data("multi30k")
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, n in (("train", 600), ("val", 40)):
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}").write_text("\n".join(multi30k_lines(data, split, lang, n)) + "\n",
                                                 encoding="utf-8")
    model = tmp_path / "imported.pt"
    steps = [["import", "transformers", str(folder), "-o", str(model)],
             ["prepare", "--train", str(raw / "train"), "--valid", str(raw / "val"), "--from-model", str(model),
              "--out", str(tmp_path / "data"), "--workers", "1", "--quiet"],
             ["train", str(tmp_path / "data"), "--save-dir", str(tmp_path / "ft"), "--init-from", str(model),
              "--max-tokens", "1024", "--max-updates", "30", "--warmup", "10", "--lr", "1e-3",
              "--save-interval-updates", "10", "--log-interval", "10", "--precision", "fp32", "--quiet"],
             ["average", str(tmp_path / "ft"), "--last", "2", "-o", str(tmp_path / "avg.pt")],
             ["export", "transformers", "-m", str(tmp_path / "avg.pt"), "-o", str(tmp_path / "back")]]
    for args in steps:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args[0], result.output)
    prepared = DataDir.open(tmp_path / "data")
    assert prepared.own_target_vocab is not None and prepared.target_sentencepiece is not None
    log = [json.loads(line) for line in (tmp_path / "ft" / "train.jsonl").read_text().splitlines()]
    losses = [r["valid_loss"] for r in log if r.get("event") == "valid"]  # the first: the imported model's
    assert losses[-1] < losses[0] - 1.0, losses
    sources = multi30k_lines(data, "val", "en", 20)
    translator = Translator.from_checkpoint(tmp_path / "avg.pt")
    found: list = []
    nmt_text = translator.translate(sources, beam=4, lenpen=0.0, max_len_a=0, max_len_b=LIMIT, ids_out=found)
    _, hf_text = transformers_generate(tmp_path / "back", sources, 4, LIMIT)
    assert nmt_text == hf_text
    require_extra("ctranslate2")
    result = runner.invoke(app, ["export", "ctranslate2", "-m", str(tmp_path / "avg.pt"), "-o", str(tmp_path / "ct2")])
    assert result.exit_code == 0, result.output
    from nmt_cli.export.ct2 import CTranslate2Translator

    ct2 = CTranslate2Translator.from_dir(tmp_path / "ct2")
    options = dict(greedy=True, max_len_a=0, max_len_b=LIMIT)
    assert ct2.translate(sources, **options) == translator.translate(sources, **options)


def _write(folder: Path, name: str, content) -> None:
    (folder / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")


@pytest.mark.parametrize("defect", ["bert", "missing-spm", "wrong-shape", "activation", "no-target-token"])
def test_bad_folders_get_one_line(folders, tmp_path, defect):
    """Another architecture, a missing tokenizer file, weights that do not fit config.json, an unknown
    activation, a multi-target model without --target-token: one line naming the file and field, exit 2,
    nothing written."""
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(folders["marian-tied"], folder)
    config = json.loads((folder / "config.json").read_text())
    expect = {"bert": "model_type 'bert'", "missing-spm": "target.spm: missing", "wrong-shape": "do not",
              "activation": "activation_function 'tanh'", "no-target-token": "--target-token"}[defect]
    if defect == "bert":
        _write(folder, "config.json", {"model_type": "bert", "hidden_size": 64})
    elif defect == "missing-spm":
        (folder / "target.spm").unlink()
    elif defect == "wrong-shape":
        _write(folder, "config.json", {**config, "d_model": 32})
    elif defect == "activation":
        _write(folder, "config.json", {**config, "activation_function": "tanh"})
    out = tmp_path / "model.pt"
    args = ["import", "transformers", str(folder), "-o", str(out)]
    if defect != "no-target-token":
        args += ["--target-token", LANGUAGE_TOKENS[0]]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_imported_checkpoint_records_what_it_needs(folders, tmp_path):
    """The file is self-contained: the target-language token, both SentencePiece models, separate
    vocabularies; `nmt translate` on the command line reads it."""
    out = tmp_path / "model.pt"
    import_transformers(folders["marian-tied"], out, target_token=LANGUAGE_TOKENS[1])
    state = load_checkpoint(out)
    assert state["target_token"] == LANGUAGE_TOKENS[1]
    assert state["tokenizer"]["tags"] == sorted(LANGUAGE_TOKENS)
    assert state["target_sentencepiece"] != state["sentencepiece"]
    source = tmp_path / "in.txt"
    source.write_text("A man rides a bike.\n", encoding="utf-8")
    result = runner.invoke(app, ["translate", "-m", str(out), "-i", str(source), "--greedy", "--max-len-a", "0",
                                 "--max-len-b", "50"])
    assert result.exit_code == 0, result.output
    _, hf_text = transformers_generate(folders["marian-tied"], ["A man rides a bike."], 1, 50, LANGUAGE_TOKENS[1])
    assert result.stdout.strip() == hf_text[0]


def test_finetune_recipe_at_smoke_size(folders, tmp_path, warm_nmt):
    """`make finetune-transformers` on a built OPUS-MT-shaped folder and 500 Multi30k pairs: import, prepare
    --from-model, train, average, translate and score before and after."""
    import os
    import subprocess

    from .conftest import REPO

    data = tmp_path / "corpus"
    data.mkdir()
    for split, name, n in (("train", "train", 500), ("val", "val", 40), ("test_2016_flickr", "test", 30)):
        for lang in ("en", "de"):
            (data / f"{name}.{lang}").write_text(
                "\n".join(multi30k_lines(shared_data("multi30k"), split, lang, n)) + "\n", encoding="utf-8")
    exp = tmp_path / "ft"
    result = subprocess.run(
        ["make", "-o", ".venv/.installed", "finetune-transformers", f"MODEL_DIR={folders['marian-tied']}",
         f"DATA={data}", f"FT_TEST={data}/test", f"TARGET_TOKEN={LANGUAGE_TOKENS[0]}", f"FT_EXP={exp}",
         "FT_UPDATES=12", "FT_SAVE_EVERY=4", "FT_AVERAGE=2", "FT_MAX_TOKENS=1024", "FT_LR=1e-3", "FT_WARMUP=4",
         "FT_FLAGS=--precision fp32 --quiet", f"NMT={warm_nmt}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    scores = (exp / "scores.txt").read_text(encoding="utf-8")
    assert scores.count("nrefs:1") == 4 and "before fine-tuning" in scores and "after fine-tuning" in scores
    for when in ("before", "after"):
        assert len((exp / f"test.{when}.hyp").read_text(encoding="utf-8").splitlines()) == 30
    assert load_checkpoint(exp / "model.pt")["target_token"] == LANGUAGE_TOKENS[0]


def test_attention_of_a_model_with_a_target_vocabulary_of_its_own(folders, tmp_path):
    """`nmt attention --json` on an imported model with separate vocabularies labels the output with the target
    vocabulary's symbols (ids mean other symbols on the two sides)."""
    out = tmp_path / "model.pt"
    import_transformers(folders["marian-untied"], out)
    result = runner.invoke(app, ["attention", "A man rides a bike.", "-m", str(out), "--json",
                                 str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    maps = json.loads((tmp_path / "a.json").read_text())
    target = set(json.loads((folders["marian-untied"] / "target_vocab.json").read_text()))
    source = set(json.loads((folders["marian-untied"] / "vocab.json").read_text()))
    labels = [t for t in maps["target_out"] if t != "</s>"]
    assert labels and all(t in target for t in labels)
    assert any(t not in source for t in labels) or not (target - source)
