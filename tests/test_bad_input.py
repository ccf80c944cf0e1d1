"""Every bad input the commands read gives one line on stderr naming the problem, and exit code 2."""

from __future__ import annotations

import json

import pytest

from nmt_cli.decode.translate import Translator
from nmt_cli.model.checkpoint import load_checkpoint, save_checkpoint

from .conftest import expect_error, recipe_module, run_cli, write_task


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
    expect_error(run_cli("learn-bpe", raw / "train.en", "-n", "0", "-o", tmp_path / "c"), "--merges")
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
    expect_error(run_cli(*args), "train.en.bin", "expects")
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
    expect_error(run_cli("average", "--last", "2", toy_model, "-o", tmp_path / "a.pt"), "a file, not a save directory")
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


def test_output_paths_that_are_directories_or_under_files(raw, toy_data, tmp_path):
    codes = tmp_path / "codes"
    assert run_cli("learn-bpe", raw / "train.en", "-n", "10", "-o", codes).exit_code == 0
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    expect_error(run_cli("learn-bpe", raw / "train.en", "-n", "10", "-o", tmp_path / "adir"), "adir",
                 "is a directory")
    expect_error(run_cli("learn-bpe", raw / "train.en", "-n", "10", "-o", tmp_path / "afile" / "c"), "afile",
                 "not a directory")
    expect_error(run_cli("apply-bpe", "-c", codes, "-i", raw / "train.en", "-o", tmp_path / "adir"), "adir",
                 "is a directory")
    expect_error(run_cli("apply-bpe", "-c", codes, "-i", raw / "train.en", "-o", tmp_path / "afile" / "o"), "afile",
                 "not a directory")
    base = ["prepare", "-s", "en", "-t", "de", "--train", raw / "train", "--valid", raw / "val", "--bpe-merges", "10",
            "--quiet", "--workers", "1"]
    expect_error(run_cli(*base, "--out", tmp_path / "afile" / "d"), "afile", "not a directory")
    # --force onto a file or a symlink is refused: it replaces only a data dir nmt made (a typo costs nothing)
    expect_error(run_cli(*base, "--out", tmp_path / "afile", "--force"), "afile", "not a data dir")
    assert (tmp_path / "afile").read_text() == "x"
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("precious")
    (tmp_path / "link").symlink_to(target)
    expect_error(run_cli(*base, "--out", tmp_path / "link", "--force"), "link", "not a data dir")
    assert (target / "keep").read_text() == "precious" and (tmp_path / "link").is_symlink()
    (tmp_path / "plainfile").write_text("x")
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "plainfile", "--arch", "tiny", "--quiet",
                         "--device", "cpu"), "plainfile", "not a directory")


def test_codes_files_that_are_not_codes(raw, tmp_path):
    (tmp_path / "latin1").write_bytes(b"#version: 0.2\nca f\xe9\n")
    (tmp_path / "prose").write_text("#version: 0.2\nthis is not a codes file\n")
    (tmp_path / "adir").mkdir()
    for codes, fragments in ((tmp_path / "missing", ("no such file",)), (tmp_path / "adir", ("is a directory",)),
                             (tmp_path / "latin1", ("latin1:2", "UTF-8")),
                             (tmp_path / "prose", ("prose:2", "not a BPE codes file"))):
        expect_error(run_cli("apply-bpe", "-c", codes, "-i", raw / "train.en"), str(codes), *fragments)
        expect_error(run_cli("binarize", "-s", "en", "-t", "de", "--train", raw / "train", "--valid", raw / "val",
                             "--out", tmp_path / "d", "--codes", codes), str(codes), *fragments)
    assert not (tmp_path / "d").exists()


def test_apply_bpe_refuses_non_utf8_stdin(raw, tmp_path):
    codes = tmp_path / "codes"
    assert run_cli("learn-bpe", raw / "train.en", "-n", "10", "-o", codes).exit_code == 0
    expect_error(run_cli("apply-bpe", "-c", codes, input=b"fine\n\xff bad\n"), "<stdin>:2", "UTF-8")
    expect_error(run_cli("apply-bpe", "-c", codes, "-o", tmp_path / "out", input=b"fine\n\xff bad\n"), "<stdin>:2")
    assert not (tmp_path / "out").exists()


def test_broken_data_dirs_name_the_file(toy_data, tmp_path):
    import shutil

    def copy(name: str):
        d = tmp_path / name
        shutil.copytree(toy_data, d)
        return d

    args = ["--save-dir", tmp_path / "ck", "--arch", "tiny", "--max-updates", "1", "--quiet", "--device", "cpu"]
    d = copy("nokeys")
    (d / "meta.json").write_text("{}")
    expect_error(run_cli("train", d, *args), "meta.json", "lacks source_lang")
    d = copy("nobin")
    (d / "train.de.bin").unlink()
    expect_error(run_cli("train", d, *args), "train.de.bin", "no such file")
    d = copy("shortidx")
    (d / "valid.en.idx").write_bytes((d / "valid.en.idx").read_bytes()[:-3])
    expect_error(run_cli("train", d, *args), "valid.en.idx", "truncated")
    d = copy("cutidx")
    (d / "train.en.idx").write_bytes((d / "train.en.idx").read_bytes()[:-16])
    expect_error(run_cli("train", d, *args), "train.en.idx")


def test_checkpoints_that_are_text_averaged_or_malicious(toy_model, toy_data, tmp_path):
    import pickle

    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    expect_error(run_cli("translate", "-m", text, input="W1.\n"), "notes.txt: a text file, not a checkpoint")
    expect_error(run_cli("average", text, toy_model, "-o", tmp_path / "avg.pt"), "notes.txt: a text file")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "image.pt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    expect_error(run_cli("translate", "-m", tmp_path / "empty.pt", input="W1.\n"), "empty.pt: an empty file")
    expect_error(run_cli("translate", "-m", tmp_path / "image.pt", input="W1.\n"), "a binary file of another kind")
    expect_error(run_cli("translate", "-m", toy_data, input="W1.\n"), "a data dir of nmt prepare, not a model")
    expect_error(run_cli("train", toy_data / "meta.json", "--save-dir", tmp_path / "s", "--quiet"),
                 "meta.json: a file, not a data dir")

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"format": "nmt-checkpoint-2", "x": Evil()}))
    result = run_cli("translate", "-m", evil, input="W1.\n")
    expect_error(result, "evil.pt", "not a readable checkpoint")
    assert "owned" not in result.output
    # an averaged model cannot resume training: say so
    save = tmp_path / "ck"
    save.mkdir()
    assert run_cli("average", toy_model, "-o", save / "checkpoint_last.pt").exit_code == 0
    expect_error(run_cli("train", toy_data, "--save-dir", save, "--arch", "tiny", "--quiet", "--device", "cpu"),
                 "averaged or exported model", "--init-from")


def test_translate_and_score_limits(toy_model, tmp_path):
    for args, fragment in ((("--beam", "0"), "--beam must be at least 1"), (("--nbest", "0"), "--nbest"),
                           (("--batch-size", "0"), "--batch-size"), (("--nbest", "5", "--beam", "4"), "larger than"),
                           (("--nbest", "2", "--greedy"), "greedy"), (("--lenpen", "-1"), "--lenpen"),
                           (("--max-tokens", "0"), "--max-tokens"), (("--threads", "-2"), "--threads"),
                           (("--parallel-batches", "-1"), "--parallel-batches")):
        expect_error(run_cli("translate", "-m", toy_model, *args, input="W1 w2.\n"), fragment)
    src = tmp_path / "src"
    src.write_text("W1 w2.\n\nW3 w4 w5.\n")
    result = run_cli("translate", "-m", toy_model, "-i", src, "--nbest", "3", "--beam", "3")
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and [int(x.split("\t")[0]) for x in lines] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    (tmp_path / "empty").write_text("")
    expect_error(run_cli("score", "--ref", tmp_path / "empty", "-i", tmp_path / "empty"), "empty", "nothing")


def test_average_of_a_directory_needs_last(toy_model, tmp_path):
    expect_error(run_cli("average", toy_model.parent, "-o", tmp_path / "a.pt"), "is a directory", "--last N")
    assert not (tmp_path / "a.pt").exists()


def test_version_help_and_summary(raw, tmp_path):
    from nmt_cli import __version__

    assert run_cli("--version").stdout.strip() == f"nmt {__version__}"
    help_text = run_cli("train", "-h").stdout
    assert "Usage" in help_text and "--arch" in help_text and "tiny|small" in help_text
    result = run_cli("prepare", "-s", "en", "-t", "de", "--train", raw / "train", "--valid", raw / "val", "--out",
                     tmp_path / "d", "--bpe-merges", "20", "--workers", "1")
    assert result.exit_code == 0
    assert "training pairs dropped: 0 empty, 0 over --max-len, 0 over --max-ratio" in result.stderr


def test_checkpoint_lacking_what_translation_needs(toy_model, tmp_path):
    """translate, export and prepare --from-model name the checkpoint and the keys it lacks, in one line."""
    state = load_checkpoint(toy_model)
    del state["bpe_codes"]
    partial = tmp_path / "partial.pt"
    save_checkpoint(state, partial)
    src = tmp_path / "in.en"
    src.write_text("w1 w2\n")
    expect_error(run_cli("translate", "-m", partial, "-i", src, "-o", tmp_path / "out"), str(partial),
                 "lacks bpe_codes")
    assert not (tmp_path / "out").exists()
    pytest.importorskip("ctranslate2")
    expect_error(run_cli("export", "ctranslate2", "-m", partial, "-o", tmp_path / "ct2"), "lacks bpe_codes")


def test_errors_say_what_the_wrong_thing_is(toy_model, toy_data, raw, tmp_path):
    """A save dir or a folder of raw text given as data, a save dir given as a model, a command's own name, a
    tokenized BLEU that would score unsplit text: each error says what was given and what to give."""
    save_dir = toy_model.parent
    expect_error(run_cli("train", save_dir, "--save-dir", tmp_path / "s", "--quiet"), "a save dir of nmt train",
                 "--out folder of nmt prepare")
    expect_error(run_cli("train", raw, "--save-dir", tmp_path / "s", "--quiet"), "raw text?", "nmt prepare")
    expect_error(run_cli("translate", "-m", save_dir, input="W1.\n"), "checkpoints (.pt) among", "not a model",
                 f"did you mean {save_dir / 'checkpoint_best.pt'}?")
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "ft", "--init-from", save_dir, "--quiet"),
                 "is a directory, expected a checkpoint file", f"did you mean {save_dir / 'checkpoint_best.pt'}?")
    result = run_cli("export", "ctranslate2", "-m", tmp_path / "nope.pt", "-o", tmp_path / "o")
    expect_error(result, "nope.pt")
    assert result.stderr.startswith("nmt export ctranslate2: error:"), result.stderr
    (tmp_path / "hyp").write_text("我 很 好\n", encoding="utf-8")
    expect_error(run_cli("score", "--ref", tmp_path / "hyp", "-i", tmp_path / "hyp", "--tokenized-bleu", "zh"),
                 "--tokenized-bleu zh", "--metrics bleu")


def test_translate_options_are_checked_before_anything_is_printed(toy_model, tmp_path):
    """A bad search option is the only line on stderr (no progress line first), and not-a-number is refused."""
    src = tmp_path / "in.en"
    src.write_text("W1 w2.\nW3.\n", encoding="utf-8")
    out = tmp_path / "out.de"
    expect_error(run_cli("translate", "-m", toy_model, "-i", src, "-o", out, "--beam", "0"), "--beam")
    for flag in ("--max-len-a", "--lenpen"):
        expect_error(run_cli("translate", "-m", toy_model, "-i", src, "-o", out, flag, "nan"), flag, "finite")
    # the server's ranges hold for the command line too: 1e20 as an integer would overflow the search's tensors
    expect_error(run_cli("translate", "-m", toy_model, "-i", src, "-o", out, "--max-len-b", "100000000000000000000"),
                 "--max-len-b at most 100000", "got")
    expect_error(run_cli("translate", "-m", toy_model, "-i", src, "-o", out, "--max-len-a", "1e6"),
                 "--max-len-a must be at most 100")
    assert not out.exists()


def test_backtranslation_leaves_empty_and_over_long_monolingual_lines_out_and_counts_them(tmp_path, capsys):
    """The monolingual half is filtered before back-translation, with one line on stderr giving the counts; the
    real sources set apart for the ceiling row stay paired with what is kept."""
    bt = recipe_module("backtranslation")
    limit = bt.MAX_MONO_WORDS
    en = [f"source {i} ." for i in range(60)]
    de = [f"ziel {i} ." for i in range(60)]
    for i in range(0, 60, 7):
        de[i] = "  "
    for i in range(3, 60, 11):
        de[i] = " ".join(["wort"] * limit + [str(i)])  # one word over
    de[5] = " ".join(["wort"] * (limit - 1) + ["5"])  # at the limit: kept
    raw = tmp_path / "raw"
    raw.mkdir()
    for lang, lines in (("en", en), ("de", de)):
        (raw / f"train.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    bt.split(raw, tmp_path / "corpora", "en", "de", seed=1)
    corpora = tmp_path / "corpora"

    def lines(name: str) -> list[str]:
        return (corpora / name).read_text(encoding="utf-8").splitlines()

    parallel = {int(line.split()[1]) for line in lines("parallel.en")}
    half = sorted(set(range(60)) - parallel)
    empty = [i for i in half if not de[i].strip()]
    long = [i for i in half if len(de[i].split()) > limit]
    assert empty and long and 5 in half + sorted(parallel)
    assert [int(s.split()[1]) for s in lines("mono_real.en")] == [i for i in half if i not in empty + long]
    assert lines("mono.de") == [de[i] for i in half if i not in empty + long]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        f"{raw / 'train.de'}: left {len(empty)} empty and {len(long)} over-long (more than {limit} words) lines out "
        f"of the monolingual half's {len(half)} (first at line {min(empty + long) + 1})"), err
    # a language written without spaces counts characters; nothing left is an error naming the file
    assert bt.usable_monolingual([0, 1], ["字" * (limit + 1), "字" * limit], "zh", raw / "mono.zh") == [1]
    with pytest.raises(bt.NmtError, match="mono.zh: no line of the monolingual half is left"):
        bt.usable_monolingual([0], [""], "zh", raw / "mono.zh")


def test_distillation_refuses_a_teacher_of_another_pair_or_other_data(toy_model, tmp_path, monkeypatch, capsys):
    """A teacher of another language pair, or whose vocabulary leaves much of the training text unknown, is
    refused in one line with exit code 2 before it translates anything; a matching one passes the check."""
    import gzip
    import sys

    from .conftest import shared_data

    distill = recipe_module("distillation")
    toy = tmp_path / "toy"
    write_task(toy / "train", 200, seed=5)
    sources, targets = ((toy / f"train.{lang}").read_text().splitlines() for lang in ("en", "de"))
    distill.check_teacher(toy_model, "en", "de", sources, targets)  # the toy model's own kind of text
    raw = tmp_path / "raw"
    raw.mkdir()
    for lang in ("en", "de"):
        with gzip.open(shared_data("multi30k") / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            (raw / f"train.{lang}").write_text("".join(next(f) for _ in range(50)), encoding="utf-8")
    for pair, fragment in ((("de", "en"), "the teacher translates en->de, the data is de->en"),
                           (("en", "de"), "its vocabulary does not cover the training sources (en)")):
        out = tmp_path / f"out-{pair[0]}"
        monkeypatch.setattr(sys, "argv", ["distillation.py", "--raw", str(raw), "--teacher", str(toy_model),
                                          "--out", str(out), "--src", pair[0], "--tgt", pair[1], "--max-updates",
                                          "1"])
        with pytest.raises(SystemExit) as stop:
            distill.main()
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err and str(toy_model) in err, err
        assert not (out / "corpora").exists()


def test_file_outputs_are_replaced_whole_and_their_missing_folders_made(toy_model, tmp_path):
    """The rule of docs/commands.md for every command that writes a file: missing folders above it are made, an
    existing file is replaced (by the complete new one), and no temporary file stays beside it."""
    source = tmp_path / "in.en"
    source.write_text("W1 W2 W3 .\nW4 W5 .\n", encoding="utf-8")
    out = tmp_path / "new" / "deeper" / "out.de"
    model = tmp_path / "other" / "place" / "model.pt"
    for _ in range(2):  # made, then replaced
        assert run_cli("translate", "-m", toy_model, "-i", source, "-o", out, "--greedy").exit_code == 0
        assert run_cli("average", toy_model, toy_model, "-o", model).exit_code == 0
        out.write_text("stale\n")
    assert run_cli("translate", "-m", toy_model, "-i", source, "-o", out, "--greedy").exit_code == 0
    assert out.read_text(encoding="utf-8").splitlines() == Translator.from_checkpoint(toy_model).translate(
        ["W1 W2 W3 .", "W4 W5 ."], greedy=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.de"]
    assert sorted(p.name for p in model.parent.iterdir()) == ["model.pt"]
    assert load_checkpoint(model)["averaged_from"] == [str(toy_model)] * 2
