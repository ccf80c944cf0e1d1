"""nmt prepare and its parts: round trips, determinism across workers, filtering, and bad input."""

from __future__ import annotations

import gzip
import json
import os
import signal
from pathlib import Path

import pytest

from nmt_cli.data.binarized import DataDir
from nmt_cli.data.prepare import PrepareOptions, _Stages, prepare

from .conftest import expect_error, run_cli, shared_data, write_task


@pytest.fixture(scope="module")
def multi30k_subset(tmp_path_factory) -> Path:
    """The first 2,000 training and 200 validation lines of Multi30k (read from ../shared/data)."""
    src = shared_data("multi30k")
    root = tmp_path_factory.mktemp("m30k")
    for split, n in (("train", 2000), ("val", 200)):
        for lang in ("en", "de"):
            with gzip.open(src / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            (root / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return root


def _prepare(root: Path, out: Path, workers: int, **kw) -> dict:
    return prepare(PrepareOptions("en", "de", str(root / "train"), str(root / "val"), out, bpe_merges=500,
                                  workers=workers, quiet=True, **kw))


def test_collated_batches_pad_each_sentence_as_a_loop_over_them_would(toy_data):
    """collate's whole-batch numpy gathers give what padding sentence by sentence gives, on real batches (one
    sentence, many, the longest first or last, indices in any order)."""
    import numpy as np

    from nmt_cli.data.binarized import collate, make_batches

    data = DataDir.open(toy_data)
    corpus, vocab = data.split("train"), data.vocab
    batches = make_batches(corpus.src.sizes, corpus.tgt.sizes, 256, 1)
    shuffled = np.random.default_rng(1).permutation(len(corpus))[:37]
    for indices in [*batches[:20], batches[0][:1], shuffled]:
        srcs, tgts = [corpus.src[int(i)] for i in indices], [corpus.tgt[int(i)] for i in indices]
        src = np.full((len(indices), max(map(len, srcs)) + 1), vocab.pad)
        prev = np.full((len(indices), max(map(len, tgts)) + 1), vocab.pad)
        target = prev.copy()
        for b, (s, t) in enumerate(zip(srcs, tgts)):
            src[b, : len(s) + 1] = [*s, vocab.eos]
            prev[b, : len(t) + 1] = [vocab.bos, *t]
            target[b, : len(t) + 1] = [*t, vocab.eos]
        batch = collate(corpus, indices, vocab)
        assert np.array_equal(batch.src.numpy(), src) and np.array_equal(batch.prev_output.numpy(), prev)
        real = np.flatnonzero(target.reshape(-1) != vocab.pad)
        assert np.array_equal(batch.target_index.numpy(), real)
        assert np.array_equal(batch.target.numpy(), target.reshape(-1)[real]) and batch.ntokens == len(real)


def test_binarized_ids_decode_to_bpe_text(multi30k_subset, tmp_path):
    _prepare(multi30k_subset, tmp_path / "d", workers=1)
    data = DataDir.open(tmp_path / "d")
    valid = data.split("valid")
    bpe_en = (tmp_path / "d" / "valid.bpe.en").read_text(encoding="utf-8").splitlines()
    assert len(valid) == len(bpe_en) == 200
    unk = data.vocab.symbols[data.vocab.unk]
    for i in range(len(valid)):
        expected = " ".join(p if p in data.vocab.index else unk for p in bpe_en[i].split())
        assert data.vocab.decode(valid.src[i]) == expected
    # training text has no unknown pieces: the vocabulary is built from it
    train = data.split("train")
    assert all(data.vocab.unk not in train.tgt[i] for i in range(len(train)))
    assert "@@" in " ".join(bpe_en)  # BPE really split words


def test_worker_count_does_not_change_output(multi30k_subset, tmp_path):
    _prepare(multi30k_subset, tmp_path / "w1", workers=1)
    _prepare(multi30k_subset, tmp_path / "w2", workers=2)
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    assert "meta.json" in names and "train.en.bin" in names
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_filter_counts_match_meta(tmp_path):
    raw = tmp_path / "raw"
    write_task(raw / "train", 100, seed=5)
    write_task(raw / "val", 10, seed=6)
    en = (raw / "train.en").read_text().splitlines()
    de = (raw / "train.de").read_text().splitlines()
    en[3], de[3] = "", "Ein Satz."  # empty side
    en[7] = " ".join(["w1"] * 40)  # too long
    en[9], de[9] = "w1 w2 w3 w4 w5 w6 w7 w8 w9.", "v1."  # ratio
    (raw / "train.en").write_text("\n".join(en) + "\n")
    (raw / "train.de").write_text("\n".join(de) + "\n")
    # (the toy corpus repeats one pair by chance; duplicates have their own test below)
    meta = _prepare(raw, tmp_path / "d", workers=1, max_len=30, max_ratio=3.0, remove_duplicates=False)
    filtered = meta["splits"]["train"]["filtered"]
    assert filtered["dropped"] == {"empty": 1, "too_long": 1, "ratio": 1, "copy": 0, "duplicate": 0, "language": 0}
    assert filtered["kept"] == meta["splits"]["train"]["sentences"] == 97
    assert len(DataDir.open(tmp_path / "d").split("train")) == 97
    on_disk = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert on_disk["splits"]["train"]["filtered"] == filtered
    assert on_disk["vocab_size"] == len(DataDir.open(tmp_path / "d").vocab)


def _cli_prepare(root: Path, out: Path, *extra: str):
    return run_cli("prepare", "-s", "en", "-t", "de", "--train", root / "train", "--valid", root / "val",
                   "--out", out, "--bpe-merges", "20", "--quiet", *extra)


def test_bad_inputs_give_one_line_errors(tmp_path):
    raw = tmp_path / "raw"
    write_task(raw / "train", 30, seed=1)
    write_task(raw / "val", 5, seed=2)
    out = tmp_path / "out"

    expect_error(run_cli("prepare", "-s", "en", "-t", "de", "--train", raw / "nope", "--valid", raw / "val",
                          "--out", out), "nope.en", "no such file")
    expect_error(_cli_prepare(raw, out, "--bpe-merges", "0"), "--bpe-merges")

    (raw / "val.de").write_text("eins\nzwei\n")
    expect_error(_cli_prepare(raw, out), "val.en has 5 lines", "val.de has 2")
    write_task(raw / "val", 5, seed=2)

    data = (raw / "train.de").read_bytes().split(b"\n")
    data[6] = b"caf\xe9 au lait"
    (raw / "train.de").write_bytes(b"\n".join(data))
    expect_error(_cli_prepare(raw, out), "train.de:7", "UTF-8")
    write_task(raw / "train", 30, seed=1)

    (raw / "train.en").write_text("\n" * 30)
    expect_error(_cli_prepare(raw, out), "empty corpus")
    write_task(raw / "train", 30, seed=1)
    assert not out.exists()

    assert _cli_prepare(raw, out).exit_code == 0
    assert (out / "meta.json").exists()
    expect_error(_cli_prepare(raw, out), "already exists", "--force")
    assert _cli_prepare(raw, out, "--force").exit_code == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging dirs left behind


def test_gzip_inputs_and_data_dir_without_meta_refused(tmp_path):
    raw = tmp_path / "raw"
    write_task(raw / "train", 30, seed=1)
    write_task(raw / "val", 5, seed=2)
    for lang in ("en", "de"):
        path = raw / f"train.{lang}"
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(path.read_bytes())
        path.unlink()
    assert _cli_prepare(raw, tmp_path / "d").exit_code == 0
    (tmp_path / "d" / "meta.json").unlink()
    expect_error(run_cli("train", tmp_path / "d", "--save-dir", tmp_path / "ck", "--arch", "tiny"), "meta.json")


def test_subcommands_pipeline(tmp_path):
    """learn-bpe, apply-bpe and binarize make a data dir that train accepts."""
    raw = tmp_path / "raw"
    write_task(raw / "train", 80, seed=1)
    write_task(raw / "val", 8, seed=2)
    codes = tmp_path / "codes"
    assert run_cli("learn-bpe", raw / "train.en", raw / "train.de", "-n", "20", "-o", codes).exit_code == 0
    assert len(codes.read_text().splitlines()) > 5
    for split in ("train", "val"):
        for lang in ("en", "de"):
            r = run_cli("apply-bpe", "-c", codes, "--tokenize", lang, "-i", raw / f"{split}.{lang}",
                        "-o", tmp_path / f"{split}.bpe.{lang}")
            assert r.exit_code == 0
    r = run_cli("binarize", "-s", "en", "-t", "de", "--train", tmp_path / "train.bpe", "--valid",
                tmp_path / "val.bpe", "--codes", codes, "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output
    data = DataDir.open(tmp_path / "d")
    assert len(data.split("train")) == 80 and data.bpe_codes == codes.read_text()


def test_help_lists_every_subcommand():
    out = run_cli("--help").output
    for command in ("prepare", "learn-bpe", "apply-bpe", "binarize", "train", "average", "translate", "score"):
        assert command in out


def test_punctuation_normalization_recorded_and_applied_by_translate(tmp_path, toy_model):
    """--normalize-punctuation runs Moses' normalizer (and drops non-printing characters) before tokenizing;
    meta.json records it, and a model trained on the data applies the same to its input."""
    from nmt_cli.decode.translate import Translator
    from nmt_cli.text.moses import normalize_punctuation

    raw = tmp_path / "raw"
    write_task(raw / "train", 60, seed=1)
    write_task(raw / "val", 6, seed=2)
    lines = (raw / "val.en").read_text(encoding="utf-8").splitlines()
    lines[0] = "„W1 w2“ – w3\u200b w4 ,w5."  # curly quotes, an en dash, a zero-width space
    (raw / "val.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plain = _prepare(raw, tmp_path / "plain", workers=1)
    normalized = _prepare(raw, tmp_path / "norm", workers=1, normalize=True)
    assert plain["tokenizer"]["normalize_punctuation"] is False
    assert normalized["tokenizer"]["normalize_punctuation"] is True
    bpe_plain = (tmp_path / "plain" / "valid.bpe.en").read_text(encoding="utf-8").splitlines()[0]
    bpe_norm = (tmp_path / "norm" / "valid.bpe.en").read_text(encoding="utf-8").splitlines()[0]
    assert "„" in bpe_plain and "„" not in bpe_norm and "\u200b" not in bpe_norm
    assert normalize_punctuation(lines[0], "en").startswith('"W1 w2"')
    # raw valid text stays as given (it is the BLEU reference)
    assert (tmp_path / "norm" / "valid.raw.en").read_text(encoding="utf-8").splitlines()[0] == lines[0]

    translator = Translator.from_checkpoint(toy_model)
    assert translator.segmenter.normalize is False
    translator.segmenter.normalize = True
    assert translator.encode([lines[0]]) == translator.encode([normalize_punctuation(lines[0], "en")])


def test_valid_pairs_longer_than_the_model_are_dropped_from_the_binarized_split(tmp_path):
    raw = tmp_path / "raw"
    write_task(raw / "train", 60, seed=1)
    write_task(raw / "val", 6, seed=2)
    en = (raw / "val.en").read_text(encoding="utf-8").splitlines()
    en[2] = " ".join(["w1"] * 1100)  # more pieces than the model's 1024 positions
    (raw / "val.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    meta = _prepare(raw, tmp_path / "d", workers=1)
    assert meta["splits"]["valid"]["dropped_too_long"] == 1 and meta["splits"]["valid"]["sentences"] == 5
    data = DataDir.open(tmp_path / "d")
    assert len(data.split("valid")) == 5 and max(data.split("valid").src.sizes) < 1024
    assert len((tmp_path / "d" / "valid.raw.en").read_text(encoding="utf-8").splitlines()) == 6  # all, for BLEU


def test_ordered_map_keeps_order_and_reads_its_input_only_a_window_ahead():
    """prepare's stages stream: at most workers x 3 chunks are read ahead of the results consumed."""
    from nmt_cli.data.workers import ordered_map

    consumed = []

    def jobs():
        for i in range(40):
            consumed.append(i)
            yield i

    out = []
    for result in ordered_map(abs, jobs(), workers=2):
        assert len(consumed) - len(out) <= 2 * 3
        out.append(result)
    assert out == list(range(40))
    assert list(ordered_map(abs, iter([-1, -2]), workers=1)) == [1, 2]


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


def _kill_self_on_three(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def test_ordered_map_raises_worker_errors_and_deaths_and_leaves_no_worker_behind():
    """An exception in a job is raised in the caller, a worker killed mid-job is reported instead of waited for
    forever, and leaving the loop early (error or break) leaves no worker process running."""
    import multiprocessing as mp

    from nmt_cli.data.workers import WorkerDied, ordered_map

    with pytest.raises(ValueError, match="three"):
        list(ordered_map(_fail_on_three, iter(range(10)), workers=2))
    assert not mp.active_children()
    with pytest.raises(WorkerDied):
        list(ordered_map(_kill_self_on_three, iter(range(10)), workers=2))
    assert not mp.active_children()
    results = ordered_map(abs, iter(range(-100, 0)), workers=2)
    assert next(results) == 100
    results.close()
    assert not mp.active_children()


def _kill_self_on_first(job: bytes) -> int:
    if job[:1] == b"k":
        os.kill(os.getpid(), signal.SIGKILL)
    return len(job)


def test_ordered_map_runs_no_thread_here_and_a_dead_worker_blocks_nothing():
    """Jobs go out by plain writes from the calling thread: no feeder thread in this process (a Queue's feeder
    blocked on a dead worker's full pipe once hung a Ctrl-C at exit). A worker killed while 1 MB jobs wait for
    it is one WorkerDied, with no thread and no worker left behind."""
    import multiprocessing as mp
    import threading

    from nmt_cli.data.workers import WorkerDied, ordered_map

    before = set(threading.enumerate())
    big = [b"x" * (1 << 20)] * 12
    for size in ordered_map(len, iter(big), workers=2):
        assert size == 1 << 20
        assert set(threading.enumerate()) == before
    with pytest.raises(WorkerDied, match="exit code -9"):
        list(ordered_map(_kill_self_on_first, iter([b"k" * (1 << 20)] + big), workers=2))
    assert set(threading.enumerate()) == before
    assert not mp.active_children()


def test_force_replaces_only_a_data_dir_prepare_made(toy_data, tmp_path):
    """`--out FILE --force` with FILE an ordinary file (a typo in --out) or a folder of something else: one
    line, exit 2, the file or folder untouched."""
    raw = toy_data.parent / "raw"
    args = ["prepare", "-s", "en", "-t", "de", "--train", raw / "train", "--valid", raw / "valid", "--bpe-merges",
            "20", "--quiet", "--workers", "1", "--force", "--out"]
    precious = tmp_path / "notes.txt"
    precious.write_text("do not lose me\n")
    expect_error(run_cli(*args, precious), "notes.txt: a file, not a data dir of nmt prepare")
    assert precious.read_text() == "do not lose me\n"
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(b"x")
    expect_error(run_cli(*args, folder), "photos: a folder with 1 file and 0 folders",
                 "the only folder --force replaces")
    assert (folder / "a.jpg").exists()
    assert run_cli(*args, tmp_path / "data").exit_code == 0  # and a data dir is replaced as before
    assert run_cli(*args, tmp_path / "data").exit_code == 0

    # A file named meta.json does not make a folder a data dir, nor does a data dir's meta.json make a user's
    # file beside it one of nmt's.
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    (lookalike / "meta.json").write_text('{"format": 1}\n')
    (lookalike / "precious.txt").write_text("mine\n")
    expect_error(run_cli(*args, lookalike), "lookalike: a folder with a meta.json and 1 entry nmt prepare does not "
                 "write (precious.txt)", "the only folder --force replaces")
    (tmp_path / "data" / "precious.txt").write_text("mine\n")
    expect_error(run_cli(*args, tmp_path / "data"), "(precious.txt)", "the only folder --force replaces")
    assert (lookalike / "precious.txt").exists() and (tmp_path / "data" / "precious.txt").exists()
    (tmp_path / "data" / "precious.txt").unlink()
    assert run_cli(*args, tmp_path / "data").exit_code == 0

    # An --out that holds an input: refused before anything is deleted.
    for side in ("en", "de"):
        (tmp_path / "data" / f"train.{side}").write_text((raw / f"train.{side}").read_text())
    inside = [*args[:6], tmp_path / "data" / "train", *args[7:], tmp_path / "data"]
    expect_error(run_cli(*inside), "data: holds the input file", "train.en", "choose another --out")
    assert (tmp_path / "data" / "train.en").exists() and (tmp_path / "data" / "meta.json").exists()


def test_a_corpus_without_two_character_words_learns_no_merges(tmp_path):
    """No word of two or more characters: nothing for BPE to merge; prepare writes zero merges instead of a
    traceback from the learner (max of an empty sequence)."""
    for lang, letters in (("en", "a b c d"), ("de", "e f g h")):
        (tmp_path / f"train.{lang}").write_text(f"{letters}\n" * 20)
        (tmp_path / f"valid.{lang}").write_text(f"{letters}\n" * 2)
    result = run_cli("prepare", "-s", "en", "-t", "de", "--train", tmp_path / "train", "--valid", tmp_path / "valid",
                     "--out", tmp_path / "data", "--quiet", "--workers", "1")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "data" / "bpe.codes").read_text().splitlines() == ["#version: 0.2"]


def test_workers_die_with_their_parent_even_mid_job(tmp_path):
    """kill -9 of a process whose workers are in the middle of a long job: they are gone within a second (they
    no longer finish their chunk first), and the zombie the killed parent leaves until reaped does not keep its
    staging folder from being removed."""
    import subprocess
    import sys
    import time

    from nmt_cli.textio import alive, remove_temporaries

    script = ("import os, sys, time\n"
              "from nmt_cli.data.workers import ordered_map\n"
              "def job(x):\n"
              "    os.write(1, f'{os.getpid()}\\n'.encode())\n"  # one write: print's two could interleave
              "    time.sleep(30)\n"
              "list(ordered_map(job, range(2), 2))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(proc.stdout.readline()) for _ in range(2)]
    staging = tmp_path / f".data.{proc.pid}.abcd.tmp"
    staging.mkdir()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(alive(w) for w in workers)
    time.sleep(0.1)
    assert not alive(proc.pid)  # a zombie (not reaped yet): not a running process
    remove_temporaries(tmp_path, "data")
    assert not staging.exists()
    proc.wait()


def test_workers_are_forked_while_no_other_thread_runs(multi30k_subset, tmp_path, monkeypatch):
    """A fork while another thread runs can give the child a lock that thread held (rich's refresh thread and
    the output stream's lock: a possible cause of the rare Ctrl-C hang). The progress bars are drawn without a
    thread, so every stage forks its workers with only the threads that ran before prepare began."""
    import threading

    import nmt_cli.data.prepare as prep
    from nmt_cli.data import workers

    before = set(threading.enumerate())
    seen: list[set] = []
    original_start = workers.mp.get_context("fork").Process.start

    def start(self):
        seen.append(set(threading.enumerate()) - before)
        return original_start(self)

    monkeypatch.setattr(workers.mp.get_context("fork").Process, "start", start)
    monkeypatch.setattr(prep, "_Stages", _VisibleStages)  # bars drawn as for a user at a terminal
    _prepare(multi30k_subset, tmp_path / "d", workers=2)
    assert len(seen) >= 6  # 2 workers x (tokenize, apply BPE, binarize)
    assert all(not extra for extra in seen), seen


class _VisibleStages(_Stages):
    def __init__(self, quiet, on_stage, staging):
        super().__init__(False, on_stage, staging)


@pytest.mark.parametrize("tokenizer", ["moses", "sentencepiece"])
def test_a_tag_on_source_lines_is_one_symbol_and_changes_nothing_else(multi30k_subset, tmp_path, tokenizer):
    """`--tag <BT>` on half the training sources (back-translation's tagged synthetic pairs): the tag is one
    vocabulary symbol at the start of those lines, BPE learns the same merges as without it, the model's
    segmenter keeps it whole, and a tag that is not one word is refused."""
    tagged = tmp_path / "tagged"
    tagged.mkdir()
    sources = (multi30k_subset / "train.en").read_text(encoding="utf-8").splitlines()
    (tagged / "train.en").write_text("".join(("<BT> " if i % 2 else "") + s + "\n" for i, s in enumerate(sources)),
                                     encoding="utf-8")
    (tagged / "train.de").write_text((multi30k_subset / "train.de").read_text(encoding="utf-8"), encoding="utf-8")
    options = dict(tokenizer=tokenizer, vocab_size=1000, max_ratio=9.0)
    meta = prepare(PrepareOptions("en", "de", str(tagged / "train"), str(multi30k_subset / "val"), tmp_path / "t",
                                  bpe_merges=500, workers=1, quiet=True, tags=("<BT>",), **options))
    assert meta["tokenizer"]["tags"] == ["<BT>"]
    data = DataDir.open(tmp_path / "t")
    tag = data.vocab.index["<BT>"]
    train = data.split("train")
    starts = [int(train.src[i][0]) == tag for i in range(len(train))]
    assert sum(starts) == len(sources) // 2 and all(int(t) != tag for i in range(len(train))
                                                     for t in train.src[i][1:])
    assert data.segmenter().segment("<BT> A man.", "en").split()[0] == "<BT>"
    if tokenizer == "moses":
        _prepare(multi30k_subset, tmp_path / "plain", workers=1, max_ratio=9.0)
        assert (tmp_path / "t" / "bpe.codes").read_text() == (tmp_path / "plain" / "bpe.codes").read_text()
    expect_error(run_cli("prepare", "-s", "en", "-t", "de", "--train", tagged / "train", "--valid",
                         multi30k_subset / "val", "--out", tmp_path / "bad", "--tag", "<B T>"), "--tag", "one word")


@pytest.mark.parametrize("tokenizer", ["moses", "sentencepiece"])
def test_lowercase_equals_lowercasing_the_files_first_and_the_model_lowercases_what_it_reads(multi30k_subset, tmp_path,
                                                                                           tokenizer, request):
    """`--lowercase` (the multimodal-MT literature's Multi30k text): the same BPE codes or SentencePiece model and
    the same training ids as preparing files lowercased beforehand, no cased piece in the vocabulary, recorded in
    meta.json so that the model's segmenter lowercases its input; refused on a model trained on cased text."""
    lowered = tmp_path / "lowered"
    lowered.mkdir()
    for split in ("train", "val"):
        for lang in ("en", "de"):
            text = (multi30k_subset / f"{split}.{lang}").read_text(encoding="utf-8")
            (lowered / f"{split}.{lang}").write_text(text.lower(), encoding="utf-8")
    options = dict(tokenizer=tokenizer, vocab_size=1000, max_ratio=9.0)
    meta = _prepare(multi30k_subset, tmp_path / "flag", workers=1, lowercase=True, **options)
    _prepare(lowered, tmp_path / "files", workers=1, **options)
    assert meta["tokenizer"]["lowercase"] is True
    if tokenizer == "moses":  # (SentencePiece's trainer gives scores that differ in the last bits run to run)
        assert (tmp_path / "flag" / "bpe.codes").read_text() == (tmp_path / "files" / "bpe.codes").read_text()
    for name in ("train.en.bin", "train.de.bin", "train.en.idx", "vocab.txt"):
        assert (tmp_path / "flag" / name).read_bytes() == (tmp_path / "files" / name).read_bytes(), name
    data = DataDir.open(tmp_path / "flag")
    cased = [s for s in data.vocab.symbols if not s.startswith("<") and s != s.lower()]
    assert not cased, cased[:5]
    segmenter = data.segmenter()
    assert segmenter.segment("A Man In A Blue Shirt.", "en") == segmenter.segment("a man in a blue shirt.", "en")
    assert DataDir.open(tmp_path / "files").segmenter().segment("A Man.", "en") != segmenter.segment("A Man.", "en")
    if tokenizer == "moses":
        cased_model, _ = request.getfixturevalue("multi30k_tiny")
        expect_error(run_cli("prepare", "--from-model", cased_model, "--lowercase", "--train", lowered / "train",
                             "--valid", lowered / "val", "--out", tmp_path / "bad"), str(cased_model), "--lowercase")


def test_each_filter_removes_its_defect_and_counts_it_and_each_can_be_turned_off(tmp_path):
    """A made-up corpus with a known number of each defect: 10 good pairs, 3 repeats of a good pair, 2 copies
    (source = target), 1 empty side, 1 side over --max-len, 1 pair over --max-ratio. meta.json counts each
    filter's drops, the summary line names them, and --keep-duplicates / --keep-copies keep those pairs."""
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    good = [(f"{words[i % 8]} {words[(i + 1) % 8]} {words[(i + 3) % 8]} w{i} .",
             f"{words[(i + 2) % 8]} {words[(i + 5) % 8]} x{i} y{i} .") for i in range(10)]
    defects = [good[4], good[4], good[7],  # duplicates
               ("same words here .", "same words here ."), ("copy me too .", "copy me too ."),  # copies
               ("nothing on the other side .", ""),  # empty
               (" ".join(words + words) + " .", "short but fine here ."),  # over --max-len 8
               ("alpha beta gamma delta omega sigma .", "kappa theta ."),  # over --max-ratio 1.5
               ]
    pairs = good + defects
    for name, rows in (("train", pairs), ("val", good[:2])):
        (tmp_path / f"{name}.en").write_text("".join(s + "\n" for s, _ in rows))
        (tmp_path / f"{name}.de").write_text("".join(t + "\n" for _, t in rows))
    args = ["prepare", "-s", "en", "-t", "de", "--train", tmp_path / "train", "--valid", tmp_path / "val",
            "--bpe-merges", "1000", "--max-len", "8", "--workers", "1"]
    result = run_cli(*args, "--out", tmp_path / "cleaned")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "cleaned" / "meta.json").read_text())
    filtered = meta["splits"]["train"]["filtered"]
    assert filtered["dropped"] == {"empty": 1, "too_long": 1, "ratio": 1, "copy": 2, "duplicate": 3, "language": 0}
    assert filtered["kept"] == meta["splits"]["train"]["sentences"] == 10 and filtered["input_sentences"] == 18
    assert "2 copies, 3 duplicates" in result.stderr
    kept = run_cli(*args, "--out", tmp_path / "kept", "--keep-duplicates", "--keep-copies")
    assert kept.exit_code == 0, kept.output
    filtered = json.loads((tmp_path / "kept" / "meta.json").read_text())["splits"]["train"]["filtered"]
    assert filtered["dropped"] == {"empty": 1, "too_long": 1, "ratio": 1, "copy": 0, "duplicate": 0, "language": 0}
    assert filtered["kept"] == 15
