"""The second tokenizer pipeline: SentencePiece on raw text (issue 25), on real Chinese-English pairs (Tatoeba),
and the scoring rule that follows the target language."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmt_cli.data.binarized import DataDir
from nmt_cli.data.prepare import PrepareOptions, prepare
from nmt_cli.decode.score import default_tokenize, score
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import load_checkpoint, save_checkpoint
from nmt_cli.model.transformer import ModelConfig
from nmt_cli.text.segment import SentencePiece, train_sentencepiece

from .conftest import REPO, expect_error, require_extra, run_cli, shared_data, threshold

sys.path.insert(0, str(REPO / "recipes"))
from tatoeba_split import read_pairs, split  # noqa: E402


@pytest.fixture(scope="module")
def tatoeba(tmp_path_factory) -> Path:
    """2,400 real Tatoeba pairs split as the recipe splits them: train/valid/test .en/.zh in one folder."""
    pairs = read_pairs(shared_data("tatoeba-cmn-eng") / "cmn.txt.gz")
    random.Random(1).shuffle(pairs)
    splits, _ = split(pairs[:2400], 100, 100)
    root = tmp_path_factory.mktemp("tatoeba")
    for name, rows in splits.items():
        for column, lang in enumerate(("en", "zh")):
            (root / f"{name}.{lang}").write_text("".join(r[column] + "\n" for r in rows), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def spm_data(tatoeba, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spm") / "data"
    prepare(PrepareOptions("zh", "en", str(tatoeba / "train"), str(tatoeba / "valid"), out,
                           test=[str(tatoeba / "test")], tokenizer="sentencepiece", vocab_size=3000, workers=2,
                           quiet=True))
    return out


@pytest.fixture(scope="module")
def spm_model(spm_data, tmp_path_factory) -> Path:
    """A `tiny` zh->en model briefly trained on the SentencePiece data (its output is poor but deterministic)."""
    from nmt_cli.training.trainer import TrainOptions, train

    save = tmp_path_factory.mktemp("spm_ckpt")
    # 300 updates at eq. 3's rate: real (poor) sentences whatever thread count an earlier test left; 150 at twice
    # the rate gave all-empty or all-dot outputs, by the thread count
    train(TrainOptions(data=spm_data, save_dir=save, arch="tiny", max_tokens=2048, max_updates=300, warmup=100,
                       lr_scale=1.0, device="cpu", precision="fp32", quiet=True, seed=1))
    return save / "checkpoint_last.pt"


def test_sentencepiece_round_trip_on_real_chinese_and_german(tatoeba, tmp_path):
    """raw -> pieces -> raw gives the line back, full-width punctuation included (no NFKC), on real lines."""
    german = gzip.open(shared_data("multi30k") / "train.de.gz", "rt", encoding="utf-8").read().splitlines()[:2000]
    chinese = (tatoeba / "train.zh").read_text(encoding="utf-8").splitlines()
    (tmp_path / "de").write_text("\n".join(german) + "\n", encoding="utf-8")
    with pytest.raises(NmtError, match=r"--vocab-size 1000 is too small for the \d+ characters this corpus needs"):
        train_sentencepiece([tatoeba / "train.zh", tmp_path / "de"], 1000)
    model = train_sentencepiece([tatoeba / "train.zh", tmp_path / "de"], 3000)
    segmenter = SentencePiece(model)
    lines = [" ".join(line.split()) for line in chinese[:500] + german[:500]]
    assert sum("，" in line for line in lines) > 20  # the test holds real full-width punctuation
    for line in lines:
        pieces = segmenter.segment(line, "zh")
        assert "<unk>" not in pieces.split()  # byte fallback: nothing is unknown
        assert segmenter.desegment(pieces, "zh") == line
    # a character never seen in training comes back through byte pieces
    assert segmenter.desegment(segmenter.segment("龘 and 🦜", "zh"), "zh") == "龘 and 🦜"
    # Unicode spaces (NBSP, the ideographic space, a line separator) become plain spaces: no piece holds one, so
    # splitting a line of pieces on whitespace gives back the pieces SentencePiece made
    symbols = set(segmenter.symbols())
    for line in ("东京\u3000大阪", "10\u00a0km", "a\u2028b"):
        pieces = segmenter.segment(line, "zh").split()
        assert pieces == segmenter.processor.encode(" ".join(line.split()), out_type=str)
        assert all(p in symbols for p in pieces)


def test_prepare_with_sentencepiece_uses_its_vocabulary_and_ids(spm_data, tatoeba):
    data = DataDir.open(spm_data)
    meta = data.meta
    assert meta["tokenizer"]["name"] == "sentencepiece" and meta["tokenizer"]["byte_fallback"] is True
    assert meta["tokenizer"]["character_coverage"] == 0.9995 and meta["bpe_merges"] is None
    assert (spm_data / "spm.model").is_file() and not (spm_data / "bpe.codes").exists()
    segmenter = data.segmenter()
    assert data.vocab.symbols == segmenter.symbols() and len(data.vocab) == 3000
    assert data.vocab.symbols[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    # the binarized ids are the SentencePiece ids of the raw text
    raw = (tatoeba / "valid.zh").read_text(encoding="utf-8").splitlines()
    valid = data.split("valid")
    for i in range(20):
        ids = segmenter.processor.encode(raw[i])
        assert valid.src[i].tolist() == ids
    # zh-en: the length-ratio filter is off (pieces of two scripts do not compare), so nothing is dropped by it
    filtered = meta["splits"]["train"]["filtered"]
    assert filtered["max_ratio"] is None and filtered["dropped"]["ratio"] == 0


def test_a_sentencepiece_model_translates_raw_text_alike_everywhere(spm_model, spm_data, tmp_path):
    """nmt translate, the Python API, nmt serve and the CTranslate2 export give the same greedy output."""
    from nmt_cli.decode.translate import Translator

    sources = (spm_data / "valid.raw.zh").read_text(encoding="utf-8").splitlines()[:30]
    api = Translator.from_checkpoint(spm_model).translate(sources, greedy=True)
    assert sum(bool(line.strip()) for line in api) >= 25
    (tmp_path / "in.zh").write_text("\n".join(sources) + "\n", encoding="utf-8")
    result = run_cli("translate", "-m", spm_model, "-i", tmp_path / "in.zh", "-o", tmp_path / "out.en", "--greedy")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.en").read_text(encoding="utf-8").splitlines() == api
    # an averaged model carries the SentencePiece model too
    averaged = tmp_path / "avg.pt"
    assert run_cli("average", spm_model, spm_model, "-o", averaged).exit_code == 0
    assert load_checkpoint(averaged)["sentencepiece"] == (spm_data / "spm.model").read_bytes()

    require_extra("uvicorn")
    from nmt_cli.serve.batching import ServeLimits

    from .test_serve import Server

    with Server(Translator.from_checkpoint(spm_model), ServeLimits()) as server:
        status, body = server.post({"text": sources, "greedy": True})
    assert status == 200 and body["translations"] == api

    require_extra("ctranslate2")
    from nmt_cli.export.ct2 import CTranslate2Translator, export_ctranslate2

    folder = export_ctranslate2(spm_model, tmp_path / "ct2")
    assert (folder / "spm.model").read_bytes() == (spm_data / "spm.model").read_bytes()
    assert not (folder / "bpe.codes").exists()
    assert CTranslate2Translator.from_dir(folder).translate(sources, greedy=True) == api
    # the exported folder translates raw Chinese without torch
    script = ("import sys; sys.modules['torch'] = None\n"
              "from nmt_cli.export.ct2 import CTranslate2Translator\n"
              f"print(CTranslate2Translator.from_dir({str(folder)!r}).translate({sources[:3]!r}, greedy=True))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(api[:3])


def test_fine_tuning_data_takes_everything_from_the_model(spm_model, tatoeba, toy_model, toy_data, tmp_path):
    """prepare --from-model needs no -s/-t and reuses the SentencePiece model; a tokenizer mismatch is refused."""
    result = run_cli("prepare", "--from-model", spm_model, "--train", tatoeba / "test", "--valid", tatoeba / "valid",
                     "--out", tmp_path / "ft", "--quiet")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "ft" / "meta.json").read_text())
    assert (meta["source_lang"], meta["target_lang"], meta["tokenizer"]["name"]) == ("zh", "en", "sentencepiece")
    assert (tmp_path / "ft" / "spm.model").read_bytes() == load_checkpoint(spm_model)["sentencepiece"]
    expect_error(run_cli("prepare", "--from-model", spm_model, "--tokenizer", "moses", "--train", tatoeba / "test",
                         "--valid", tatoeba / "valid", "--out", tmp_path / "ft2", "--quiet"),
                 "trained with --tokenizer sentencepiece, not moses")
    expect_error(run_cli("prepare", "--from-model", spm_model, "-s", "en", "--train", tatoeba / "test",
                         "--valid", tatoeba / "valid", "--out", tmp_path / "ft3", "--quiet"), "zh->en, not en->en")
    # --init-from a Moses model on SentencePiece data: one line
    expect_error(run_cli("train", tmp_path / "ft", "--save-dir", tmp_path / "ck", "--init-from", toy_model,
                         "--max-updates", "1", "--device", "cpu"),
                 "--tokenizer moses data", "prepared with --tokenizer sentencepiece")
    assert not (tmp_path / "ft2").exists() and not (tmp_path / "ft3").exists()


def test_sentencepiece_bad_input(tatoeba, tmp_path):
    base = ["prepare", "--train", tatoeba / "train", "--valid", tatoeba / "valid", "--quiet"]
    expect_error(run_cli(*base, "-s", "zh", "-t", "en", "--out", tmp_path / "a", "--tokenizer", "jieba"),
                 "'--tokenizer'", "'jieba' is not one of 'moses', 'sentencepiece'")
    expect_error(run_cli(*base, "-s", "zh", "-t", "en", "--out", tmp_path / "b", "--tokenizer", "sentencepiece",
                         "--vocab-size", "900000"), "--vocab-size 900000 is larger than this corpus allows",
                 "use --vocab-size")
    expect_error(run_cli(*base, "-s", "zh", "-t", "en", "--out", tmp_path / "c", "--tokenizer", "sentencepiece",
                         "--spm-type", "word"), "'word' is not one of 'unigram', 'bpe'")
    expect_error(run_cli(*base, "-t", "en", "--out", tmp_path / "d"), "--source-lang/-s and --target-lang/-t")
    for name in "abcd":
        assert not (tmp_path / name).exists()
    assert not list(tmp_path.glob(".*tmp"))
    # sides the wrong way round: the "zh" side holds no Chinese; a warning with the counts, and it still runs
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for name in ("train", "valid"):
        for a, b in (("en", "zh"), ("zh", "en")):
            (swapped / f"{name}.{a}").write_bytes((tatoeba / f"{name}.{b}").read_bytes())
    result = run_cli("prepare", "--train", swapped / "train", "--valid", swapped / "valid", "--quiet", "-s", "zh",
                     "-t", "en", "--out", tmp_path / "g", "--tokenizer", "sentencepiece", "--vocab-size", "3000")
    assert result.exit_code == 0
    warning = [line for line in result.stderr.splitlines() if "Chinese characters" in line]
    assert len(warning) == 1 and "train.zh: only 0 of 2," in warning[0], result.stderr


def test_a_filter_that_drops_many_pairs_says_so(tatoeba, tmp_path):
    """The ratio filter forced on zh-en (Moses pieces) drops many pairs: a warning line, not only the summary."""
    result = run_cli("prepare", "-s", "zh", "-t", "en", "--train", tatoeba / "train", "--valid", tatoeba / "valid",
                     "--out", tmp_path / "d", "--bpe-merges", "500", "--max-ratio", "1.5", "--quiet")
    assert result.exit_code == 0
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    dropped = meta["splits"]["train"]["filtered"]["dropped"]["ratio"]
    share = dropped / meta["splits"]["train"]["filtered"]["input_sentences"]
    assert share > 0.05
    assert f"{dropped:,} of" in result.stderr and "dropped over --max-ratio 1.5" in result.stderr
    # by default zh-en has no ratio filter, en-de keeps Moses' 1.5
    assert PrepareOptions("zh", "en", "", "", Path()).ratio_limit() is None
    assert PrepareOptions("en", "de", "", "", Path()).ratio_limit() == 1.5
    assert PrepareOptions("ja", "zh-TW", "", "", Path()).ratio_limit() == 1.5


def test_score_tokenizes_as_the_target_language_wants(spm_model, spm_data, tmp_path):
    assert [default_tokenize(x) for x in ("zh", "zh-TW", "cmn", "en", "de", None)] == ["zh", "zh", "zh", "13a", "13a",
                                                                                        "13a"]
    assert default_tokenize("ja") in ("ja-mecab", "char")
    refs = ["我们今天去公园。", "他很喜欢读书。"]
    hyps = ["我们今天去公园。", "他喜欢读书。"]
    zh = score(hyps, [refs], ("bleu",), lang="zh")[0]
    plain = score(hyps, [refs], ("bleu",))[0]
    assert "tok:zh" in zh["signature"] and "tok:13a" in plain["signature"]
    assert zh["score"] > plain["score"]  # 13a sees each sentence as one word; zh splits the characters
    (tmp_path / "h").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    (tmp_path / "r").write_text("\n".join(refs) + "\n", encoding="utf-8")
    base = ["score", "--ref", tmp_path / "r", "-i", tmp_path / "h", "--metrics", "bleu", "--json"]
    for extra, tokenizer in ((["-l", "zh"], "zh"), (["--tokenize", "char"], "char"), ([], "13a"),
                             (["-m", spm_data], "13a")):  # the data dir translates into English
        result = run_cli(*base, *extra)
        assert result.exit_code == 0, result.output
        assert f"tok:{tokenizer}" in json.loads(result.stdout)[0]["signature"]
    result = run_cli(*base, "-m", spm_model)
    assert "tok:13a" in json.loads(result.stdout)[0]["signature"]
    expect_error(run_cli(*base, "--tokenize", "jieba"), "unknown --tokenize 'jieba'")
    expect_error(run_cli(*base, "-m", spm_model, "-l", "zh"), "--lang zh, but", "translates into en")


def test_a_checkpoint_whose_sentencepiece_model_is_missing_is_refused(spm_model, tmp_path):
    state = load_checkpoint(spm_model)
    state["sentencepiece"] = None
    save_checkpoint(state, tmp_path / "broken.pt")
    expect_error(run_cli("translate", "-m", tmp_path / "broken.pt", input="你好。\n"), "broken.pt",
                 "SentencePiece, but its model is missing")
    state["sentencepiece"] = b"not a model"
    save_checkpoint(state, tmp_path / "garbled.pt")
    expect_error(run_cli("translate", "-m", tmp_path / "garbled.pt", input="你好。\n"), "not a SentencePiece model")


def test_tatoeba_split_is_deterministic_and_keeps_test_sentences_out_of_training():
    pairs = read_pairs(shared_data("tatoeba-cmn-eng") / "cmn.txt.gz")
    first, record = split(pairs, 1000, 1000)
    again, _ = split(list(pairs), 1000, 1000)
    assert first == again
    assert len(first["valid"]) == len(first["test"]) == 1000
    held = {s for name in ("valid", "test") for en, zh, _ in first[name] for s in (en, zh)}
    assert not any(en in held or zh in held for en, zh, _ in first["train"])
    valid_sides = {s for en, zh, _ in first["valid"] for s in (en, zh)}
    assert not any(en in valid_sides or zh in valid_sides for en, zh, _ in first["test"])
    assert record["train"] + record["valid"] + record["test"] + record["duplicate_pairs"] + \
        record["dropped_sharing_a_sentence_with_valid_or_test"] == record["input_pairs"] == len(pairs)


def test_attention_and_alignments_of_a_sentencepiece_model(spm_model, spm_data, tmp_path):
    """nmt attention and --alignments work with SentencePiece pieces; Chinese is aligned by character."""
    sources = (spm_data / "valid.raw.zh").read_text(encoding="utf-8").splitlines()[:8]
    result = run_cli("attention", sources[0], "-m", spm_model, "-o", tmp_path / "a.svg", "--json", tmp_path / "a.json")
    assert result.exit_code == 0, result.output
    raw = json.loads((tmp_path / "a.json").read_text())
    assert raw["source"][-1] == "</s>" and any(p.startswith("\u2581") for p in raw["source"] + raw["target_out"])
    (tmp_path / "in.zh").write_text("\n".join(sources) + "\n", encoding="utf-8")
    result = run_cli("translate", "-m", spm_model, "-i", tmp_path / "in.zh", "--alignments", "--greedy")
    assert result.exit_code == 0, result.output
    for line, source in zip(result.stdout.splitlines(), sources):
        text, pairs = line.split("\t")
        characters = len("".join(source.split()))
        for pair in pairs.split():
            i, j = map(int, pair.split("-"))
            assert 0 <= i < characters and 0 <= j < len(text.split())
    from nmt_cli.model.attention import piece_words

    surface = DataDir.open(spm_data).segmenter().surface
    assert piece_words(["\u2581我们", "去", "公园", "。"], "我们去公园。", surface, characters=True) == [0, 2, 3, 5]
    assert piece_words(["\u2581我们", "去", "公园", "。"], "我们去公园。", surface) == [0, 0, 0, 0]


def test_transformers_export_is_the_same_model(spm_model, spm_data, tmp_path):
    """`nmt export transformers` (Marian): the tokenizer gives nmt's ids, teacher-forced log-probabilities equal
    nmt's within 1e-4, and greedy generation gives nmt's greedy output."""
    transformers = require_extra("transformers")
    from nmt_cli.decode.translate import Translator
    from nmt_cli.export.hf import export_transformers

    folder = export_transformers(spm_model, tmp_path / "hf")
    assert (folder / "README.md").read_text().startswith("---\nlanguage:\n- zh\n- en")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    assert type(model).__name__ == "MarianMTModel" and "Marian" in type(tokenizer).__name__
    nmt = Translator.from_checkpoint(spm_model)
    vocab, net = nmt.vocab, nmt.ensemble.models[0]
    sources = (spm_data / "valid.raw.zh").read_text(encoding="utf-8").splitlines()[:60]
    refs = (spm_data / "valid.raw.en").read_text(encoding="utf-8").splitlines()[:60]
    ids = nmt.encode(sources)
    assert [tokenizer(s)["input_ids"] for s in sources] == [x + [vocab.eos] for x in ids]
    # Unicode spaces (nmt makes them ASCII before SentencePiece; the exported model's normalizer does the same)
    spaced = [s.replace(" ", sp, 1) + sp + "end" for s in sources[:10] + refs[:10]
              for sp in ("\u3000", "\u00a0", "\u2009", "\t", "\u2028")]
    assert sum(sp in s for s in spaced for sp in ("\u3000", "\u00a0")) >= 40
    assert [tokenizer(s)["input_ids"] for s in spaced] == [x + [vocab.eos] for x in nmt.encode(spaced)]
    worst = 0.0
    for source, ref in zip(ids[:30], refs[:30]):
        target = vocab.encode(nmt.segmenter.segment(ref, "en"))
        src, prev = torch.tensor([source + [vocab.eos]]), torch.tensor([[vocab.bos] + target])
        with torch.no_grad():
            ours = torch.log_softmax(net.logits(net(src, prev)).float(), -1)
            theirs = torch.log_softmax(model(input_ids=src, decoder_input_ids=prev).logits.float(), -1)
        gold = torch.tensor(target + [vocab.eos])
        worst = max(worst, (ours[0, range(len(gold)), gold] - theirs[0, range(len(gold)), gold]).abs().max().item())
    threshold("largest log-probability difference, nmt vs Transformers", worst, high=1e-4)
    greedy = nmt.translate(sources, greedy=True)
    same = 0
    for source, expected in zip(ids, greedy):
        limit = nmt.max_output_tokens(len(source), 1.0, 50)
        out = model.generate(torch.tensor([source + [vocab.eos]]), num_beams=1, do_sample=False,
                             max_new_tokens=limit + 1)
        same += tokenizer.decode(out[0], skip_special_tokens=True).strip() == expected.strip()
    threshold("greedy lines equal to nmt's (of 60)", same, low=59)
    expect_error(run_cli("export", "transformers", "-m", spm_model, "-o", folder), "already exists")
    for command in (["translate", "-m", folder], ["export", "ctranslate2", "-m", folder, "-o", tmp_path / "ct2"]):
        expect_error(run_cli(*command, input="你好\n"), "a Hugging Face Transformers folder", "from_pretrained")


def test_transformers_export_refuses_what_it_cannot_hold(toy_model, spm_model, tmp_path):
    """A pre-norm model (Moses + BPE: FSMT) and a learned-position one (SentencePiece: Marian): one line each,
    nothing written."""
    require_extra("transformers")
    from nmt_cli.model.transformer import Transformer

    for source, overrides, why in ((toy_model, dict(pre_norm=True), "pre-norm layers (FSMT's are post-norm)"),
                                   (spm_model, dict(learned_positions=True), "learned positions (Marian's")):
        state = load_checkpoint(source)
        config = ModelConfig.from_dict({**state["config"], **overrides})
        state.update(model=Transformer(config).state_dict(), config=config.to_dict())
        save_checkpoint(state, tmp_path / "odd.pt")
        expect_error(run_cli("export", "transformers", "-m", tmp_path / "odd.pt", "-o", tmp_path / "hf"), why)
        assert not (tmp_path / "hf").exists()


def test_marian_layout_and_what_it_cannot_hold():
    """Marian's positions are nmt's sinusoids with the sines first; pre-norm, learned positions and narrow
    heads are refused with one line."""
    from nmt_cli.export.hf import marian_permutation, marian_state_dict
    from nmt_cli.model.transformer import Transformer, make_config, sinusoidal_positions

    d, positions = 8, torch.arange(10, dtype=torch.float32)[:, None]
    marian = sinusoidal_positions(10, d)[:, marian_permutation(d)]
    frequencies = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    torch.testing.assert_close(marian[:, : d // 2], torch.sin(positions * frequencies))
    torch.testing.assert_close(marian[:, d // 2 :], torch.cos(positions * frequencies))
    symbols = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(26)]
    for overrides, why in ((dict(pre_norm=True), "pre-norm"), (dict(learned_positions=True), "learned positions"),
                           (dict(heads=2, head_dim=8), "do not make up d_model")):
        model = Transformer(make_config("tiny", len(symbols), **overrides))
        state = {"model": model.state_dict(), "config": model.config.to_dict(), "vocab": symbols}
        with pytest.raises(NmtError, match=why):
            marian_state_dict(state)


def test_serve_counts_byte_fallback_pieces_before_the_work(spm_model):
    """SentencePiece spells a character outside its vocabulary in one piece per UTF-8 byte, so a line of emoji
    has ~4x more pieces than characters: the server's decoder-work bound covers them, and a request over the
    budget gets its 413 before the translator sees it."""
    from nmt_cli.decode.translate import Translator
    from nmt_cli.serve.batching import ServeLimits
    from nmt_cli.serve.requests import token_bound

    from .test_serve import Server, SlowTranslator

    translator = Translator.from_checkpoint(spm_model)
    emoji = "\U0001F600" * 20
    lines = [emoji, "\U00020000\U00020001\U00020002 rare", "汉字 \U0001F600 and text", "plain words", "a\u3000b"]
    for line in lines:
        assert len(translator.encode([line])[0]) <= token_bound(line), line
    pieces = len(translator.encode([emoji])[0])
    assert pieces >= 4 * len(emoji)  # what a characters-based bound (20) missed
    slow = SlowTranslator(translator)
    slow.release.set()
    request = {"text": [emoji], "greedy": True, "max_len_a": 1, "max_len_b": 0}  # up to `pieces` steps
    with Server(slow, ServeLimits(max_work=pieces // 2)) as server:
        status, body = server.post(request)
        assert status == 413 and "tokens" in body["error"], body
        assert not slow.calls
    with Server(slow, ServeLimits(max_work=token_bound(emoji) + 1)) as server:
        status, body = server.post(request)  # within the budget: served
        assert status == 200 and slow.calls
