"""nmt translate and the search: invariances, exactness on a tiny problem, streaming, and bad input."""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from nmt_cli.decode.pipeline import default_workers
from nmt_cli.decode.search import EnsembleModel, beam_search, greedy_search, length_penalty
from nmt_cli.decode.translate import Translator
from nmt_cli.model import ops
from nmt_cli.model.transformer import Transformer, make_config
from nmt_cli.torch_env import DECODING_KERNEL_CACHE

from .conftest import expect_error, mapped_allocator, require_tcmalloc, run_cli, threshold


@pytest.fixture(scope="module")
def translator(toy_model) -> Translator:
    return Translator.from_checkpoint(toy_model)


@pytest.fixture(scope="module")
def sources(toy_data) -> list[str]:
    lines = (toy_data.parent / "raw" / "valid.en").read_text().splitlines()
    rng = random.Random(0)
    # unseen sentences too, so the model is unsure and beams really differ
    extra = [" ".join(f"w{rng.randrange(24)}" for _ in range(rng.randint(1, 12))) for _ in range(30)]
    return lines + extra


def test_batch_size_and_input_order_do_not_change_translations(translator, sources):
    one = translator.translate(sources, beam=4, batch_size=1)
    many = translator.translate(sources, beam=4, batch_size=64)
    assert one == many
    by_tokens = translator.translate(sources, beam=4, max_tokens=50)
    assert by_tokens == one
    order = list(range(len(sources)))
    random.Random(1).shuffle(order)
    shuffled = translator.translate([sources[i] for i in order], beam=4)
    assert [shuffled[order.index(i)] for i in range(len(sources))] == one
    threshold("beam outputs ending in '.'", sum(h.endswith(".") for h in one), low=len(one) // 2 + 1)


def test_beam_one_equals_greedy(translator, sources):
    assert translator.translate(sources, beam=1, lenpen=0.0) == translator.translate(sources, greedy=True)


def test_two_workers_translate_exactly_what_one_does(toy_model, translator, sources, monkeypatch):
    """Two batches searched at once, each on its own thread with half the CPU threads: the same translations
    in input order (scores to rounding). Afterwards the calling thread, and a thread started later, keep the
    count they had."""
    threads = torch.get_num_threads()
    two = Translator.from_checkpoint(toy_model, workers=2)
    ran_on = []
    search = two.search

    def recorded(*args):
        ran_on.append((threading.get_ident(), torch.get_num_threads()))
        return search(*args)

    monkeypatch.setattr(two, "search", recorded)
    assert two.translate(sources, beam=4, batch_size=7) == translator.translate(sources, beam=4, batch_size=7)
    nbest2 = two.translate_nbest(sources, beam=3, nbest=2, batch_size=5)
    nbest1 = translator.translate_nbest(sources, beam=3, nbest=2, batch_size=5)
    assert [[text for text, _ in r] for r in nbest2] == [[text for text, _ in r] for r in nbest1]
    # scores to rounding: one thread adds up some reductions in another order than two
    assert max(abs(a[1] - b[1]) for x, y in zip(nbest2, nbest1) for a, b in zip(x, y)) < 1e-4
    assert two.translate(sources, greedy=True, batch_size=9) == translator.translate(sources, greedy=True,
                                                                                     batch_size=9)
    assert len({ident for ident, _ in ran_on} - {threading.get_ident()}) >= 2
    assert {n for _, n in ran_on} == {max(1, threads // 2)}
    assert torch.get_num_threads() == threads
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [threads]
    assert default_workers("cpu", 2) == 2 and default_workers("cpu", 1) == 1 and default_workers("cuda", 8) == 1


def test_nbest_scores_sorted_and_first_is_best(translator, sources):
    nbest = translator.translate_nbest(sources[:10], beam=5, nbest=3)
    best = translator.translate(sources[:10], beam=5)
    for hyps, top in zip(nbest, best):
        assert 1 <= len(hyps) <= 3 and hyps[0][0] == top
        scores = [s for _, s in hyps]
        assert scores == sorted(scores, reverse=True)


def _exhaustive_best(model: Transformer, src: torch.Tensor, max_tokens: int, lenpen: float):
    """Score every output of up to `max_tokens` tokens (then </s>) by full recomputation."""
    vocab = model.config.vocab_size
    symbols = list(range(3, vocab))  # never <pad> or <s>; </s> ends the output
    memory, mask = model.encode(src)
    best = (-math.inf, None)
    for length in range(0, max_tokens + 1):
        for tokens in itertools.product(symbols, repeat=length):
            prev = torch.tensor([[1, *tokens]])
            lprobs = torch.log_softmax(model.logits(model.decode(prev, memory, mask)), -1)[0]
            logp = sum(float(lprobs[t, tok]) for t, tok in enumerate(tokens)) + float(lprobs[length, 2])
            score = logp / length_penalty(length + 1, lenpen)
            if score > best[0]:
                best = (score, list(tokens))
    return best


def _fairseq_beam_search(model: Transformer, src: torch.Tensor, beam: int, lenpen: float, limit: int):
    """Beam search the plain way, one sentence, every prefix rescored from scratch: each step the 2 * beam best
    continuations; </s> among the best `beam` finishes a hypothesis, the best `beam` others stay open; stop
    with `beam` finished (fairseq's rule). At the limit, only </s>. Returns the best (score, tokens)."""
    memory, mask = model.encode(src)
    open_hyps: list[tuple[float, list[int]]] = [(0.0, [])]
    finished: list[tuple[float, list[int]]] = []
    for step in range(limit + 1):
        candidates = []
        for logp, tokens in open_hyps:
            prev = torch.tensor([[1, *tokens]])
            lprobs = torch.log_softmax(model.logits(model.decode(prev, memory, mask))[0, -1], -1)
            allowed = [2] if step == limit else range(2, model.config.vocab_size)  # never <pad> or <s>
            candidates += [(logp + float(lprobs[tok]), tokens, tok) for tok in allowed]
        candidates.sort(key=lambda c: -c[0])
        for logp, tokens, tok in candidates[:beam]:
            if tok == 2 and len(finished) < beam:
                finished.append((logp / length_penalty(step + 1, lenpen), tokens))
        open_hyps = [(logp, [*tokens, tok]) for logp, tokens, tok in candidates[: 2 * beam] if tok != 2][:beam]
        if len(finished) >= beam or not open_hyps:
            break
    return max(finished, key=lambda f: f[0])


@pytest.mark.parametrize("lenpen", [0.0, 0.6, 1.0])
def test_beam_search_stops_where_fairseq_does(lenpen):
    """The batched search (cached keys and values, finished sentences leaving the batch, per-sentence limits)
    returns what the plain search with fairseq's stopping rule returns; the exhaustive search searches on."""
    torch.manual_seed(3)
    model = Transformer(make_config("tiny", 9, d_model=16, ffn=32, heads=2, dropout=0.0)).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4.0)  # peaky, but unsure enough that hypotheses end at different steps
    lengths = [5, 2, 7, 3, 6, 4]
    src = torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.long)  # <pad> = 0
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(3, 9, (n,))
        src[i, n] = 2
    with torch.no_grad():
        hyps = beam_search(EnsembleModel([model]), src, bos=1, eos=2, beam=3, lenpen=lenpen, max_len_a=1.0,
                           max_len_b=2)
        exhaustive = beam_search(EnsembleModel([model]), src, bos=1, eos=2, beam=3, lenpen=lenpen, max_len_a=1.0,
                                 max_len_b=2, exhaustive=True)
        for i, n in enumerate(lengths):
            score, tokens = _fairseq_beam_search(model, src[i : i + 1, : n + 1], 3, lenpen, n + 2)
            assert hyps[i][0].tokens == tokens
            assert hyps[i][0].score == pytest.approx(score, abs=1e-4)
            assert exhaustive[i][0].score >= hyps[i][0].score - 1e-6
    if lenpen > 0:
        threshold("sentences the exhaustive search scores higher",
                  sum(e[0].score > h[0].score + 1e-4 for e, h in zip(exhaustive, hyps)), low=1)


@pytest.mark.parametrize("lenpen", [0.0, 0.6, 1.0])
def test_wide_beam_finds_the_exhaustive_optimum(lenpen):
    torch.manual_seed(4)
    vocab = 7  # <pad> <s> </s> <unk> + 3 symbols
    model = Transformer(make_config("tiny", vocab, d_model=16, ffn=32, heads=2, dropout=0.0)).eval()
    with torch.no_grad():
        model.embed.weight.mul_(8.0)  # a peaky distribution, so the search problem is not trivial
    ensemble = EnsembleModel([model])
    for seed in range(6):
        torch.manual_seed(seed)
        src = torch.cat([torch.randint(3, vocab, (1, 4)), torch.tensor([[2]])], 1)
        max_tokens = 3
        with torch.no_grad():
            exp_score, exp_tokens = _exhaustive_best(model, src, max_tokens, lenpen)
        # a beam as wide as all prefixes of length max_tokens - 1 keeps every candidate alive
        beam = (vocab - 2) ** (max_tokens - 1)
        hyps = beam_search(ensemble, src, bos=1, eos=2, beam=beam, lenpen=lenpen, max_len_a=0.0, max_len_b=max_tokens,
                           exhaustive=True)
        assert hyps[0][0].tokens == exp_tokens
        assert hyps[0][0].score == pytest.approx(exp_score, abs=1e-4)
        greedy = greedy_search(ensemble, src, bos=1, eos=2, max_len_a=0.0, max_len_b=max_tokens)[0]
        if lenpen == 0.0:  # greedy can only do as well as the optimum
            assert greedy.score <= exp_score + 1e-5


@pytest.mark.parametrize("grouped", [False, True])
def test_ensemble_of_one_model_twice_equals_the_model(toy_model, sources, translator, grouped, monkeypatch):
    """The ensemble averages full distributions; one model takes the output layer of `linear_log_softmax_topk`
    (also with top-k through group maxima, as for real vocabularies and batches: the toy vocabulary has 49)."""
    if grouped:
        monkeypatch.setattr(ops, "GROUPED_TOPK_MIN", 0)
        monkeypatch.setattr(ops, "TOPK_GROUP", 2)
    double = Translator.from_checkpoint([toy_model, toy_model])
    assert double.translate(sources[:20], beam=4) == translator.translate(sources[:20], beam=4)
    assert double.translate(sources[:20], greedy=True) == translator.translate(sources[:20], greedy=True)


def test_translator_sizes_onednn_kernel_cache_unless_user_did(toy_model, monkeypatch):
    """Beam search's changing row counts need a larger oneDNN kernel cache than training; a user's value wins."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    Translator.from_checkpoint(toy_model)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DECODING_KERNEL_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "77")
    Translator.from_checkpoint(toy_model)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "77"


def test_empty_and_overlong_lines(translator):
    long_line = " ".join(["w3"] * 1500)
    out = translator.translate(["", "W1 w2.", long_line, "   "], beam=2, max_len_b=5)
    assert out[0] == "" and out[3] == "" and out[1]
    assert len(translator.warnings) == 1 and translator.warnings[0].startswith("line 3:")


def test_cli_file_and_stdin(toy_model, tmp_path, translator):
    src = tmp_path / "in.en"
    lines = ["W1 w2 w3.", "", "W4 w5.", "W7 w7 w8 w9."]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.de"
    r = run_cli("translate", "-m", toy_model, "-i", src, "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    expected = translator.translate(lines)
    assert out.read_text().splitlines() == expected
    r = run_cli("translate", "-m", toy_model, input="\n".join(lines) + "\n")
    assert r.exit_code == 0 and r.stdout.splitlines() == expected
    r = run_cli("translate", "-m", toy_model, "-i", src, "--nbest", "2")
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert [row[0] for row in rows] == ["1", "1", "2", "2", "3", "3", "4", "4"]  # exactly N per input line
    assert rows[0][2] == expected[0]


def test_piped_stdin_is_searched_in_sorted_batches_like_a_file(toy_model, sources, translator, monkeypatch):
    """Lines that have already arrived on stdin are translated together (several batches, sorted by length,
    searched `workers` at a time), not one arrival-order batch at a time; the output is the file's."""
    from nmt_cli.decode.pipeline import TextTranslator

    lines = (sources * 4)[:150]
    expected = translator.translate(lines)
    chunks = []
    real = TextTranslator.translate_nbest

    def recorded(self, sentences, **options):
        chunks.append(len(sentences))
        return real(self, sentences, **options)

    monkeypatch.setattr(TextTranslator, "translate_nbest", recorded)
    r = run_cli("translate", "-m", toy_model, "--batch-size", "8", input="\n".join(lines) + "\n")
    assert r.exit_code == 0 and r.stdout.splitlines() == expected
    assert sum(chunks) == len(lines) and max(chunks) > 8


def test_streaming_stdin_answers_before_input_ends(toy_model):
    """A line is translated and flushed while stdin stays open."""
    proc = subprocess.Popen([sys.executable, "-m", "nmt_cli", "translate", "-m", str(toy_model)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("W1 w2.\n")
        proc.stdin.flush()
        first = proc.stdout.readline()
        assert first.strip()
        proc.stdin.write("W3.\n")
        proc.stdin.close()
        rest = proc.stdout.read()
        assert len(rest.splitlines()) == 1
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_translate_on_cpu_runs_on_tcmalloc_and_translates_as_on_the_system_allocator(toy_model, sources):
    """`nmt translate` on CPU executes itself again with tcmalloc preloaded (its memory map shows the library
    once torch is loaded), reading its input from stdin after the restart; `--cpu-allocator system` keeps
    glibc's malloc; the translations are the same."""
    require_tcmalloc()
    allocators, outputs = {}, {}
    for choice in ("auto", "system"):
        proc = subprocess.Popen([sys.executable, "-m", "nmt_cli", "translate", "-m", str(toy_model), "--threads", "1",
                                 "--cpu-allocator", choice, "--quiet"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            allocators[choice] = mapped_allocator(proc.pid)
            outputs[choice], err = proc.communicate("\n".join(sources[:20]) + "\n", timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
    assert allocators["auto"].startswith("libtcmalloc") and allocators["system"] == "system", allocators
    assert len(outputs["auto"].splitlines()) == 20 and outputs["auto"] == outputs["system"]


def test_bad_translate_input(toy_model, tmp_path):
    expect_error(run_cli("translate", "-m", tmp_path / "none.pt", "-i", toy_model), "none.pt", "no such checkpoint")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(toy_model.read_bytes()[:5000])  # a checkpoint cut short: its zip archive begins, then stops
    expect_error(run_cli("translate", "-m", junk), "junk.pt", "corrupt or truncated")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    expect_error(run_cli("translate", "-m", foreign), "not an nmt checkpoint")
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"W1 w2.\nW3 \xff w4.\n")
    expect_error(run_cli("translate", "-m", toy_model, "-i", bad), "bad.en:2", "UTF-8")
    expect_error(run_cli("translate", "-m", toy_model, "-i", bad, "--precision", "fp16"), "fp16")
    if not torch.cuda.is_available():
        expect_error(run_cli("translate", "-m", toy_model, "--device", "cuda"), "no CUDA")
    out = tmp_path / "never.de"
    run_cli("translate", "-m", toy_model, "-i", bad, "-o", out)
    assert not out.exists()


def test_beam_one_equals_greedy_on_an_untrained_model(toy_data, sources):
    """Untrained, outputs run to the length limit with </s> often second best: only a </s> among the top `beam`
    candidates may finish a hypothesis, so beam 1 stays on greedy's path."""
    from nmt_cli.data.binarized import DataDir

    data = DataDir.open(toy_data)
    torch.manual_seed(4)
    model = Transformer(make_config("tiny", len(data.vocab))).eval()
    with torch.no_grad():  # pull </s> towards the other outputs, so that it is often a close second
        model.embed.weight[data.vocab.eos] += 5 * model.embed.weight[4:].mean(0)
    # (with the old rule, any </s> among the top 2 x beam finishing a hypothesis, ~25 of these 40 differ)
    translator = Translator([model], data.vocab, data.segmenter(), "en", "de", torch.device("cpu"))
    beam = translator.translate(sources[:40], beam=1, lenpen=0.0)
    assert beam == translator.translate(sources[:40], greedy=True)
    threshold("longest output, words", max(len(h.split()) for h in beam), low=11)  # it really ran long


def test_text_module_loads_sacremoses_without_joblib():
    """The start-up saving is real (no joblib after importing nmt's text layer), and harmless: a later
    `import joblib` gets the real module, and tokenization works."""
    code = ("import sys, nmt_cli.text.moses as t; assert 'joblib' not in sys.modules, 'joblib imported'; "
            "assert t.tokenize('Hello, world-wide!', 'en') == 'Hello , world @-@ wide !'; "
            "import joblib; assert joblib.Parallel is not None and joblib.delayed is not None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cli_loads_without_the_garbage_collector_and_translates_with_it(toy_model, tmp_path, monkeypatch):
    """`nmt` (main) starts up with the collector off (full collections walk all of torch's objects) and turns it
    back on, frozen, once the model is loaded: the translation itself runs with the collector on."""
    import gc

    from nmt_cli.cli import main as cli
    from nmt_cli.decode.pipeline import TextTranslator
    from nmt_cli.export import engines

    seen: dict[str, bool] = {}
    load, translate_nbest = engines.load_translator, TextTranslator.translate_nbest

    def loading(*args, **kwargs):
        seen["loading"] = gc.isenabled()
        return load(*args, **kwargs)

    def translating(self, *args, **kwargs):
        seen["translating"] = gc.isenabled()
        return translate_nbest(self, *args, **kwargs)

    monkeypatch.setattr(engines, "load_translator", loading)
    monkeypatch.setattr(TextTranslator, "translate_nbest", translating)
    src = tmp_path / "in.en"
    src.write_text("A man is riding a bike.\n", encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["nmt", "translate", "-m", str(toy_model), "-i", str(src), "-o",
                                      str(tmp_path / "out.de")])
    try:
        with pytest.raises(SystemExit) as exit:
            cli.main()
    finally:
        gc.unfreeze()
    assert exit.value.code == 0
    assert seen == {"loading": False, "translating": True} and gc.isenabled()
    assert (tmp_path / "out.de").read_text(encoding="utf-8").count("\n") == 1


def test_searches_reuse_cache_buffers_without_changing_results(toy_model, sources):
    """The ensemble's CachePool hands the same buffers to the next search (stale contents never read): long,
    short, then long batches translate as a fresh translator does, and no buffer beyond the first search's."""
    fresh = Translator.from_checkpoint(toy_model).translate(sources, beam=4)
    translator = Translator.from_checkpoint(toy_model)
    pool = translator.ensemble.pool
    assert translator.translate(sources, beam=4) == fresh
    kept = {b.data_ptr() for b in pool.free}
    assert len(kept) == 1  # the cache (finished sentences are dropped in place)
    assert translator.translate(sources[:3], greedy=True) == [translator.translate([s], greedy=True)[0]
                                                              for s in sources[:3]]
    assert translator.translate(sources, beam=4) == fresh
    assert {b.data_ptr() for b in pool.free} == kept


def test_cache_pool_keeps_the_largest_and_hands_out_the_smallest_that_fits():
    from nmt_cli.model.transformer import CachePool

    pool = CachePool(keep=2)
    cpu = torch.device("cpu")
    small, large, huge = (torch.empty(n) for n in (10, 100, 1000))
    pool.give([small, large, huge])
    assert [b.numel() for b in pool.free] == [1000, 100]  # the smallest dropped
    assert pool.take(50, torch.float32, cpu) is large
    assert pool.take(50, torch.float32, cpu).numel() == 1000
    assert pool.take(50, torch.float32, cpu).numel() == 50 and not pool.free  # a new one
    pool.give([torch.empty(100, dtype=torch.bfloat16)])
    assert pool.take(50, torch.float32, cpu).dtype == torch.float32  # another dtype is never handed out


def test_one_translator_searches_on_several_threads_at_once(translator, sources):
    """Searches share the ensemble's CachePool; concurrent ones each get buffers of their own."""
    from concurrent.futures import ThreadPoolExecutor

    expected = translator.translate(sources, beam=4, batch_size=8)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: translator.translate(sources, beam=4, batch_size=8), range(3)))
    assert all(r == expected for r in results)


def test_the_model_files_decoding_settings_are_the_defaults(toy_model, sources, tmp_path):
    """A model file that carries the beam and length penalty chosen for it (as `make multi30k` chooses them on
    val): translate and the Python API search with them unless told otherwise (serve and the exports:
    test_serve.py, test_export.py), and translate says so in one line; a flag overrides each."""
    from nmt_cli.model.checkpoint import load_checkpoint, save_checkpoint, with_decoding

    model = tmp_path / "model.pt"
    save_checkpoint(with_decoding(load_checkpoint(toy_model), 2, 1.5, "chosen on val: BLEU 99.00"), model)
    chosen = Translator.from_checkpoint(model)
    plain = Translator.from_checkpoint(toy_model)
    assert chosen.search_settings() == (2, 1.5) and plain.search_settings() == (4, 0.6)
    assert chosen.search_settings(5, None) == (5, 1.5)
    assert chosen.translate(sources) == plain.translate(sources, beam=2, lenpen=1.5)
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    result = run_cli("translate", "-m", model, "-i", tmp_path / "in.txt", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == plain.translate(sources, beam=2, lenpen=1.5)
    assert result.stderr.strip() == ("nmt translate: beam 2 and length penalty 1.5 from the model file (chosen on "
                                     "val: BLEU 99.00); --beam and --lenpen override")
    result = run_cli("translate", "-m", model, "-i", tmp_path / "in.txt", "--quiet", "--lenpen", "0.6")
    assert result.stdout.splitlines() == plain.translate(sources, beam=2, lenpen=0.6)
    assert "nmt translate: beam 2 from the model file" in result.stderr and "length penalty" not in result.stderr
    both = run_cli("translate", "-m", model, "-i", tmp_path / "in.txt", "--quiet", "--lenpen", "0.6", "--beam", "4")
    assert both.stderr == "" and both.stdout.splitlines() == plain.translate(sources)
    expect_error(run_cli("translate", "-m", model, "-i", tmp_path / "in.txt", "--nbest", "3"),
                 "--nbest 3 is larger than --beam 2")
    broken = tmp_path / "broken.pt"
    save_checkpoint({**load_checkpoint(toy_model), "decoding": {"beam": 0}}, broken)
    expect_error(run_cli("translate", "-m", broken, "-i", tmp_path / "in.txt"), "broken.pt",
                 "decoding settings are not valid")
