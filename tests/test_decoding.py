"""Sampling, no-repeat n-grams, forced prefixes and lexical constraints: each checked by an equivalence
(top-k 1 and a cold temperature are greedy search; a seed samples alike in any batch; an empty prefix or no
constraint changes nothing) or by counting (sample frequencies against the model's probabilities, phrases
present, no bigram twice), through the Python API, the command line and the server."""

from __future__ import annotations

import gzip
import math
import random
from collections import Counter

import pytest
import torch

from nmt_cli.decode.sampling import Sampling
from nmt_cli.decode.search import sample_search
from nmt_cli.decode.steering import draw
from nmt_cli.decode.translate import Translator
from nmt_cli.model.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from nmt_cli.model.transformer import Transformer

from .conftest import expect_error, run_cli, shared_data, threshold

SHORT = dict(max_len_b=20)  # the briefly trained model loops: keep its outputs short


@pytest.fixture(scope="module")
def translator(multi30k_tiny) -> Translator:
    return Translator.from_checkpoint(multi30k_tiny[0], workers=1)


@pytest.fixture(scope="module")
def val(multi30k_tiny) -> tuple[list[str], list[str]]:
    root = multi30k_tiny[1]
    return ((root / "val.en").read_text(encoding="utf-8").splitlines(),
            (root / "val.de").read_text(encoding="utf-8").splitlines())


def output_ids(translator: Translator, lines: list[str], **options) -> list[list[int]]:
    ids: list = []
    translator.translate_nbest(lines, ids_out=ids, **options)
    return [out for _, out in ids]


def repeats_a_bigram(ids: list[int]) -> bool:
    bigrams = list(zip(ids, ids[1:]))
    return len(bigrams) != len(set(bigrams))


def test_top_k_1_and_a_cold_temperature_are_greedy_and_a_seed_samples_alike_in_any_batch(translator, val):
    lines = val[0][:24]
    greedy = translator.translate_nbest(lines, greedy=True, **SHORT)
    # At T = 1e-30 every log-probability gap of float32 (>= ~1e-7) becomes > 1e23, so the tempered distribution
    # is one-hot at the mode: only an exact tie could draw otherwise, by construction on any rounding. (At
    # T = 1e-4, a top-2 gap under ~1e-3, common in a briefly trained model, lets the draw leave the mode.)
    for sampling in (Sampling(topk=1, seed=4), Sampling(temperature=1e-30, seed=5)):
        sampled = translator.translate_nbest(lines, sampling=sampling, **SHORT)
        assert [r[0][0] for r in sampled] == [r[0][0] for r in greedy]
        assert [r[0][1] for r in sampled] == pytest.approx([r[0][1] for r in greedy], abs=1e-3)

    batched = translator.translate_nbest(lines, sampling=Sampling(seed=7), nbest=3, **SHORT)
    alone = [translator.translate_nbest([line], sampling=Sampling(seed=7), nbest=3, **SHORT)[0] for line in lines]
    assert [[t for t, _ in r] for r in batched] == [[t for t, _ in r] for r in alone]
    assert [s for r in batched for _, s in r] == pytest.approx([s for r in alone for _, s in r], abs=1e-3)
    # Draws differ: between the samples of a line, and from another seed's.
    threshold("lines whose 3 samples all differ, of 24", sum(len(set(t for t, _ in r)) == 3 for r in batched),
              low=16)
    other = translator.translate_nbest(lines, sampling=Sampling(seed=8), nbest=3, **SHORT)
    threshold("lines whose first sample another seed changes, of 24",
              sum(a[0][0] != b[0][0] for a, b in zip(batched, other)), low=16)


def chi_squared(counts: Counter, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, tokens expected fewer than 5 times pooled; and its
    degrees of freedom."""
    expected = probs * draws
    big = (expected >= 5).nonzero().squeeze(1).tolist()
    stat = sum((counts.get(t, 0) - expected[t].item()) ** 2 / expected[t].item() for t in big)
    rest_expected = draws - sum(expected[t].item() for t in big)
    rest = draws - sum(counts.get(t, 0) for t in big)
    if rest_expected >= 5:
        stat += (rest - rest_expected) ** 2 / rest_expected
        return stat, len(big)
    return stat, len(big) - 1


def test_sample_frequencies_match_the_models_probabilities(translator, val):
    """4,000 draws of one sentence's first token, plain, tempered and truncated, against the distribution
    each should follow (Pearson's chi-squared, 6 standard deviations above its mean: a draw that ignored
    the temperature or the truncation is hundreds of deviations off)."""
    vocab, ensemble, draws = translator.vocab, translator.ensemble, 4000
    ids = translator.encode([val[0][3]])[0]
    src = torch.tensor([ids + [vocab.eos]])
    with torch.inference_mode():
        states = ensemble.start(src, 1, 2)
        log_probs = ensemble.log_probs(torch.tensor([vocab.bos]), states, vocab.bos)[0]
        ensemble.release(states)
    sorted_probs, order = log_probs.softmax(-1).sort(descending=True)
    nucleus = order[: int((sorted_probs.cumsum(0) - sorted_probs < 0.95).sum())]
    for sampling, expected in (
            (Sampling(seed=1), log_probs.softmax(-1)),
            (Sampling(temperature=2.0, seed=2), (log_probs / 2).softmax(-1)),
            (Sampling(topk=5, seed=3), torch.zeros_like(log_probs).index_put_(
                (order[:5],), sorted_probs[:5] / sorted_probs[:5].sum())),
            (Sampling(topp=0.95, seed=4), torch.zeros_like(log_probs).index_put_(
                (nucleus,), log_probs.softmax(-1)[nucleus] / log_probs.softmax(-1)[nucleus].sum()))):
        hyps = sample_search(ensemble, src, vocab.bos, vocab.eos, sampling, draws, max_len_a=0, max_len_b=1)[0]
        first = Counter(h.tokens[0] if h.tokens else vocab.eos for h in hyps)
        assert set(first) <= set(expected.nonzero().squeeze(1).tolist()), sampling
        stat, df = chi_squared(first, expected, draws)
        assert df >= 2, sampling  # enough distinct tokens for the test to mean something
        threshold(f"chi-squared deviations, {sampling}", (stat - df) / math.sqrt(2 * df), high=6)


def repeat_free_length(ids: list[int], n: int) -> int:
    """The length of the longest prefix of `ids` in which no n-gram occurs twice."""
    seen: set[tuple[int, ...]] = set()
    for end in range(n, len(ids) + 1):
        gram = tuple(ids[end - n : end])
        if gram in seen:
            return end - 1
        seen.add(gram)
    return len(ids)


def test_no_repeat_ngram_removes_every_repeated_ngram_and_changes_greedy_only_where_it_repeated(
        translator, val, multi30k_tiny, tmp_path):
    """With `no_repeat_ngram` n, no output repeats an n-gram (greedy, beam, sampling; n = 2 and 3), on an
    untrained model (the fixture's, its weights drawn afresh), which repeats itself on every line, and on the
    briefly trained one, which repeats on some lines or none depending on rounding along its training. Greedy
    search with the rule equals greedy search without it up to the first token that completed a repeat, and
    differs at that token: by construction on every line, so it is asserted on all 60 whatever the rounding."""
    state = load_checkpoint(multi30k_tiny[0])
    torch.manual_seed(0)
    state["model"] = Transformer(model_from_checkpoint(state)[0].config).state_dict()
    save_checkpoint(state, tmp_path / "untrained.pt")
    untrained = Translator.from_checkpoint(tmp_path / "untrained.pt", workers=1)
    lines = val[0][:30]
    compared = 0
    for model in (untrained, translator):
        plain = output_ids(model, lines, greedy=True, **SHORT)
        if model is untrained:
            threshold("untrained greedy outputs that repeat a bigram, of 30",
                      sum(repeat_free_length(ids, 2) < len(ids) for ids in plain), low=20)
        for n in (2, 3):
            for options in (dict(greedy=True), dict(beam=4), dict(sampling=Sampling(seed=1))):
                banned = output_ids(model, lines, no_repeat_ngram=n, **options, **SHORT)
                assert all(repeat_free_length(ids, n) == len(ids) for ids in banned), (n, options)
                if not options.get("greedy"):
                    continue
                # Up to the first repeat no greedy choice is banned; the token that completed it is.
                for line, (b, p) in enumerate(zip(banned, plain)):
                    keep = repeat_free_length(p, n)
                    assert b[:keep] == p[:keep], (n, line)
                    assert keep == len(p) and b == p or b[keep : keep + 1] != p[keep : keep + 1], (n, line)
                    compared += keep
    # Every output starts with at least n tokens that repeat nothing, so each line compares some of its tokens.
    threshold("greedy tokens compared with and without the rule (n = 2 and 3, 60 lines each)", compared, low=240)


def test_every_output_starts_with_its_prefix_and_an_empty_prefix_is_none(translator, val):
    lines, refs = val[0][:20], val[1][:20]
    prefixes = [" ".join(ref.split()[:2]) if i % 3 else "" for i, ref in enumerate(refs)]
    for options in (dict(greedy=True), dict(beam=4), dict(sampling=Sampling(seed=2))):
        outputs = translator.translate(lines, prefixes=prefixes, **options, **SHORT)
        plain = translator.translate(lines, **options, **SHORT)
        for prefix, output, without in zip(prefixes, outputs, plain):
            if prefix:
                forced = translator.decode(translator.vocab.encode(translator.segmenter.segment(prefix, "de")))
                assert output.startswith(forced), (prefix, output)
            else:
                assert output == without
        assert translator.translate(lines, prefixes=[""] * len(lines), **options, **SHORT) == plain
    # A prefix longer than the length limit is kept whole: the limit gives way.
    long_prefix = "Ein Mann mit einem roten Hut und einer blauen Jacke steht auf der Straße"
    out = translator.translate(["A man."], prefixes=[long_prefix], max_len_a=0, max_len_b=2)[0]
    assert out.startswith(long_prefix)


def flickr_test(n: int) -> tuple[list[str], list[str]]:
    folder = shared_data("multi30k")
    with gzip.open(folder / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as en, \
            gzip.open(folder / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as de:
        return [next(en).rstrip("\n") for _ in range(n)], [next(de).rstrip("\n") for _ in range(n)]


def reference_phrases(reference: str, rng: random.Random) -> list[str]:
    """1-2 phrases of 1-3 consecutive words of a reference (words of letters only)."""
    words = reference.split()
    phrases = []
    for _ in range(rng.randint(1, 2)):
        length = rng.randint(1, 3)
        starts = [i for i in range(len(words) - length + 1) if all(w.isalpha() for w in words[i : i + length])]
        if starts:
            start = rng.choice(starts)
            phrases.append(" ".join(words[start : start + length]))
    return phrases


def test_constraints_appear_in_every_output_and_other_lines_decode_as_without_them(translator):
    import sacrebleu

    sources, refs = flickr_test(200)
    rng = random.Random(5)
    constraints = [reference_phrases(ref, rng) if i % 4 else [] for i, ref in enumerate(refs)]
    options = dict(beam=4, max_len_b=10)
    plain = translator.translate_nbest(sources, **options)
    constrained = translator.translate_nbest(sources, constraints=constraints, **options)
    assert translator.unmet == [] and translator.warnings == []
    met = [phrase in out[0][0] for phrases, out in zip(constraints, constrained) for phrase in phrases]
    assert len(met) >= 150 and all(met), f"{sum(met)} of {len(met)} phrases present"
    assert all(c == p for c, p, phrases in zip(constrained, plain, constraints) if not phrases)
    bleu = [sacrebleu.corpus_bleu([r[0][0] for r in run], [refs]).score for run in (plain, constrained)]
    print(f"BLEU on 200 test_2016_flickr lines: plain {bleu[0]:.1f}, with reference phrases {bleu[1]:.1f}")
    threshold("BLEU gained by reference phrases as constraints", bleu[1] - bleu[0], low=1.0)

    # Phrases that cannot all fit in the length limit: the best hypothesis found, and a warning naming the line.
    outputs = translator.translate(["A dog.", "A man."], constraints=[[], ["Hund", "eine Frau", "Straße"]],
                                   max_len_a=0, max_len_b=3)
    assert outputs[1] and translator.warnings == [
        "line 2: its constraints could not all be met within the length limit; translated with the best "
        "hypothesis found"]
    translator.warnings.clear()
    translator.unmet.clear()


def test_the_command_line_samples_prefixes_and_constrains_and_refuses_bad_input_in_one_line(multi30k_tiny, val,
                                                                                            tmp_path):
    model = multi30k_tiny[0]
    lines = val[0][:6]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "prefix.de").write_text("Ein Mann\n\n\nZwei Frauen\n\n\n", encoding="utf-8")
    (tmp_path / "phrases.tsv").write_text("Hund\n\nrote Jacke\tStraße\n\n\n\n", encoding="utf-8")
    translator = Translator.from_checkpoint(model, workers=1)

    def run(*flags: str) -> list[str]:
        result = run_cli("translate", "-m", model, "-i", tmp_path / "in.en", "--max-len-b", "20", *flags)
        assert result.exit_code == 0, result.output
        return result.stdout.splitlines()

    assert run("--sampling", "--seed", "3", "--topp", "0.9") == translator.translate(
        lines, sampling=Sampling(topp=0.9, seed=3), **SHORT)
    assert len(run("--sampling", "--nbest", "3")) == 18
    prefixes = (tmp_path / "prefix.de").read_text(encoding="utf-8").splitlines()
    assert run("--prefix", tmp_path / "prefix.de") == translator.translate(lines, prefixes=prefixes, **SHORT)
    constrained = run("--constraints", tmp_path / "phrases.tsv", "--beam", "4")
    assert "Hund" in constrained[0] and "rote Jacke" in constrained[2] and "Straße" in constrained[2]
    assert run("--no-repeat-ngram-size", "2") == translator.translate(lines, no_repeat_ngram=2, **SHORT)

    out = tmp_path / "out.de"
    (tmp_path / "short.tsv").write_text("Hund\n", encoding="utf-8")
    (tmp_path / "empty.tsv").write_text("\nHund\t\n\n\n\n\n", encoding="utf-8")
    (tmp_path / "long.tsv").write_text("\n\nein Mann mit einem roten Hut\n\n\n\n", encoding="utf-8")
    for flags, fragments in (
            (["--prefix", tmp_path / "short.tsv"], ["short.tsv: 1 lines", "has 6"]),
            (["--constraints", tmp_path / "empty.tsv"], ["empty.tsv:2: constraint 2 is empty"]),
            (["--constraints", tmp_path / "long.tsv", "--max-len-a", "0", "--max-len-b", "3"],
             ["long.tsv:3: constraint 1 has", "length limit of 3"]),
            (["--sampling", "--topp", "0"], ["--topp must be in (0, 1]"]),
            (["--sampling", "--topp", "1.5"], ["--topp"]),
            (["--sampling", "--temperature", "0"], ["--temperature"]),
            (["--sampling", "--topk", "-1"], ["--topk"]),
            (["--sampling", "--beam", "4"], ["drop --beam"]),
            (["--sampling", "--greedy"], ["choose one"]),
            (["--topk", "5"], ["add --sampling"]),
            (["--constraints", tmp_path / "phrases.tsv", "--sampling"], ["--constraints needs beam search"]),
            (["--no-repeat-ngram", "-1"], ["--no-repeat-ngram"])):
        expect_error(run_cli("translate", "-m", model, "-i", tmp_path / "in.en", "-o", out, *flags), *fragments)
        assert not out.exists()
    expect_error(run_cli("translate", "-m", model, "--prefix", tmp_path / "prefix.de", input="A man.\n"),
                 "--prefix pairs its lines with the input's")


def test_the_server_samples_prefixes_and_constrains_per_request_and_refuses_bad_fields(translator, val):
    from concurrent.futures import ThreadPoolExecutor

    from nmt_cli.serve.batching import ServeLimits

    from .test_serve import Server

    lines = val[0][:8]
    phrases = [["Hund"], [], ["eine Frau", "Straße"], [], [], ["Mann"], [], []]
    prefixes = ["Ein Mann", "", "", "Zwei", "", "", "", ""]
    requests = [
        ({"text": lines[:4], "sampling": True, "seed": 9, "nbest": 2, "max_len_b": 20},
         translator.translate_nbest(lines[:4], sampling=Sampling(seed=9), nbest=2, **SHORT)),
        ({"text": lines, "prefix": prefixes, "max_len_b": 20, "no_repeat_ngram": 2},
         translator.translate_nbest(lines, prefixes=prefixes, no_repeat_ngram=2, **SHORT)),
        ({"text": lines, "constraints": phrases, "max_len_b": 20, "no_repeat_ngram": 2},
         translator.translate_nbest(lines, constraints=phrases, no_repeat_ngram=2, **SHORT)),
        ({"text": lines[2], "constraints": phrases[2], "max_len_b": 20},
         translator.translate_nbest([lines[2]], constraints=[phrases[2]], **SHORT))]
    too_long = " ".join(["Mann"] * 60)
    with Server(translator, ServeLimits(batch_wait_ms=300)) as server:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(server.post, [body for body, _ in requests]))
        for (body, expected), (status, answer) in zip(requests, answers):
            assert status == 200, answer
            if body.get("nbest", 1) > 1:
                assert answer["translations"] == [[t for t, _ in r] for r in expected]
            elif isinstance(body["text"], str):
                assert answer["translations"] == expected[0][0][0]
            else:
                assert answer["translations"] == [r[0][0] for r in expected]
        # A request whose constraint cannot be honoured fails alone, in the batch it shared with a good one.
        good = {"text": lines[:2], "constraints": [["Hund"], []], "max_len_b": 20}
        bad = {"text": lines[:2], "constraints": [[], [too_long]], "max_len_b": 20}
        with ThreadPoolExecutor(2) as pool:
            (good_status, good_answer), (bad_status, bad_answer) = pool.map(server.post, [good, bad])
        assert good_status == 200 and "Hund" in good_answer["translations"][0]
        assert bad_status == 422 and bad_answer["error"].startswith("constraints[1]: constraint 1 has 60 tokens")
        status, answer = server.post({"text": ["A man.", "A dog."], "constraints": [[], ["Hund", "eine Frau"]],
                                      "max_len_a": 0, "max_len_b": 2})
        assert status == 200 and answer["warnings"] == [
            "text[1]: its constraints could not all be met within the length limit; translated with the best "
            "hypothesis found"]
        for body, status, fragment in (
                ({"text": ["a"], "sampling": True, "topp": 0}, 422, "topp must be in (0, 1]"),
                ({"text": ["a"], "sampling": True, "temperature": 0}, 422, "temperature"),
                ({"text": ["a"], "sampling": True, "beam": 4}, 422, "drop \"beam\""),
                ({"text": ["a"], "topk": 4}, 422, "add \"sampling\""),
                ({"text": ["a"], "sampling": True, "seed": -1}, 422, "\"seed\" must be between"),
                ({"text": ["a", "b"], "prefix": ["x"]}, 422, "\"prefix\" has 1 items for 2 sentences"),
                ({"text": ["a"], "constraints": [["x", " "]]}, 422, "constraints[0][1] is empty"),
                ({"text": ["a"], "constraints": ["x"]}, 422, "\"constraints\"[0] must be a list of strings"),
                ({"text": ["a"], "constraints": [["x"] * 17]}, 413, "at most 16"),
                ({"text": ["a"], "constraints": [["x"]], "sampling": True}, 422, "constraints needs beam search"),
                ({"text": ["a"], "no_repeat_ngram": -2}, 422, "\"no_repeat_ngram\" must be between")):
            got, answer = server.post(body)
            assert got == status and fragment in answer["error"], (body, answer)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(topk=5), Sampling(topp=0.9), Sampling(temperature=0.5),
                                      Sampling(topk=200, topp=0.5)], ids=str)
def test_a_draw_gives_a_token_with_probability_whatever_the_uniform(sampling):
    """Uniforms at both ends of [0, 1), float64 as the search draws them (1 - 2^-30 rounds to 1.0 in float32):
    every draw is a token the (truncated) distribution gives mass, never a banned token or a padding row."""
    torch.manual_seed(0)
    real, rows = 70, 128  # the vocabulary, and the rows of the padded output layer
    log_probs = torch.full((rows,), -math.inf)
    log_probs[:real] = torch.randn(real).log_softmax(-1)
    log_probs[[0, 3, real - 1]] = -math.inf  # banned tokens, one of them the last real one
    uniforms = torch.tensor([0.0, 2.0**-60, 0.5, 1 - 2.0**-24, 1 - 2.0**-25, 1 - 2.0**-30, 1 - 2.0**-53],
                            dtype=torch.float64)
    tokens = draw(log_probs.expand(len(uniforms), rows).clone(), uniforms, sampling)
    order = (log_probs / sampling.temperature).softmax(-1).sort(descending=True)
    allowed = order.indices[: sampling.topk] if sampling.topk else order.indices
    if sampling.topp < 1:
        probs = order.values[: len(allowed)] / order.values[: len(allowed)].sum()
        allowed = allowed[: int(((probs.cumsum(0) - probs) < sampling.topp).sum())]
    allowed = {t for t in allowed.tolist() if log_probs[t] > -math.inf}
    assert set(tokens.tolist()) <= allowed, (tokens.tolist(), sorted(allowed))


def test_a_prefix_that_repeats_an_ngram_is_followed_whole_under_the_ban(translator, val):
    """Forced tokens are exempt from --no-repeat-ngram: a prefix with a repeated bigram starts every output
    (greedy, beam, sampling), in a batch beside lines without a prefix, and after it no bigram repeats."""
    lines = val[0][:4]
    prefixes = ["Ein Mann Ein Mann", "", "Ein Hund und ein Hund und", ""]
    forced = [translator.vocab.encode(translator.segmenter.segment(p, "de")) if p else [] for p in prefixes]
    assert repeats_a_bigram(forced[0]) and repeats_a_bigram(forced[2])
    for options in (dict(greedy=True), dict(beam=4), dict(sampling=Sampling(seed=2))):
        ids: list = []
        translator.translate_nbest(lines, prefixes=prefixes, no_repeat_ngram=2, ids_out=ids, **options, **SHORT)
        for (_, out), prefix in zip(ids, forced):
            assert out[: len(prefix)] == prefix, options
            bigrams = list(zip(out, out[1:]))
            assert all(bigrams[i] not in bigrams[:i] for i in range(max(0, len(prefix) - 1), len(bigrams))), options


def test_the_search_and_the_pipeline_share_one_length_limit(translator):
    """search.max_lengths (on tensors, in the search) equals the pipeline's limit (the CTranslate2 engine's and
    the constraint checks') over a grid of a, b and source lengths, the model's positions included."""
    from nmt_cli.decode.search import max_lengths

    pad, eos = translator.vocab.pad, translator.vocab.eos
    lengths = list(range(0, 160)) + [1000]
    src = torch.full((len(lengths), max(lengths) + 1), pad)
    for row, n in enumerate(lengths):
        src[row, :n] = 7
        src[row, n] = eos
    for a in [i / 10 for i in range(0, 31)] + [0.33, 1.15, 2.2]:
        for b in (0, 5, 50, 200):
            tensor = max_lengths(src, pad, eos, a, b, translator.max_positions).tolist()
            assert tensor == [translator.max_output_tokens(n, a, b) for n in lengths], (a, b)
    assert translator.max_output_tokens(90, 0.7, 0) == 62  # 0.7 * 90 = 62.99999999999999 in double precision


def test_constraints_track_overlapping_matches():
    """A failed partial match falls back to the longest one still alive, and phrases that overlap are all met:
    on random outputs, a sentence's constraints are complete exactly when every phrase occurs in the output, and
    only a token `wanted` names moves a hypothesis's bank up."""
    from nmt_cli.decode.constraints import START, Phrases, bank

    def met(phrases: list[list[int]], output: list[int]):
        rule, progress = Phrases(tuple(map(tuple, phrases))), START
        for token in output:
            after = rule.advance(progress, token)
            assert bank(after) <= bank(progress) or token in rule.wanted(progress)  # progress only by wanted tokens
            progress = after
        return rule.complete(progress), progress

    assert met([[1, 1, 2]], [1, 1, 1, 2])[0]
    assert met([[7], [7, 8]], [7, 8])[0]
    assert met([[1, 2, 1, 3]], [1, 2, 1, 2, 1, 3])[0]
    assert not met([[1, 2]], [1, 3, 2])[0]
    rng = random.Random(3)
    for _ in range(3000):
        phrases = [[rng.randint(1, 3) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]
        output = [rng.randint(1, 3) for _ in range(rng.randint(0, 12))]
        occurs = all(any(output[i : i + len(p)] == p for i in range(len(output))) for p in phrases)
        assert met(phrases, output)[0] == occurs, (phrases, output)
