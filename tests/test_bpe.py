"""nmt's BPE learner writes exactly the codes subword-nmt writes for the same word counts."""

from __future__ import annotations

import contextlib
import gzip
import io
import random
from collections import Counter

import pytest
from subword_nmt.learn_bpe import learn_bpe as subword_nmt_learn_bpe

from nmt_cli.text.bpe import learn_bpe_codes
from nmt_cli.text.moses import tokenize

from .conftest import shared_data


def _reference(counts: Counter, merges: int, min_frequency: int = 2) -> str:
    """subword-nmt 0.3.8's own learner on a dictionary file of the counts (words in sorted order)."""
    dictionary = io.StringIO("".join(f"{w} {c}\n" for w, c in sorted(counts.items())))
    out = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):
        subword_nmt_learn_bpe(dictionary, out, merges, min_frequency=min_frequency, is_dict=True)
    return out.getvalue()


@pytest.fixture(scope="module")
def multi30k_counts() -> Counter:
    """Word counts of the whole Multi30k training set, both languages (real text, whitespace-split)."""
    data = shared_data("multi30k")
    counts: Counter = Counter()
    for lang in ("en", "de"):
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            for line in f:
                counts.update(line.split())
    return counts


def test_same_codes_as_subword_nmt_on_real_text(multi30k_counts):
    # 4,000 merges over ~40k types: subword-nmt goes back to its full statistics about twenty times (each
    # time the best count falls below its pruning threshold), so the pruning logic is exercised too.
    assert learn_bpe_codes(multi30k_counts, 4000) == _reference(multi30k_counts, 4000)


def test_tokenized_text(multi30k_counts):
    counts: Counter = Counter()
    for line in list(multi30k_counts)[:3000]:
        counts.update(tokenize(line, "en").split())
    assert learn_bpe_codes(counts, 1500) == _reference(counts, 1500)


def test_same_codes_when_merges_run_out(multi30k_counts):
    """More merges than pairs of count >= min_frequency: both stop at the same place."""
    small = Counter(dict(list(multi30k_counts.items())[:300]))
    ours = learn_bpe_codes(small, 100000, min_frequency=3)
    assert ours == _reference(small, 100000, min_frequency=3)
    assert 10 < len(ours.splitlines()) < 100000


def test_same_codes_on_repetitive_words():
    """Words of repeated symbols ("aaaa", "abab") exercise the overlap rules of the pair updates."""
    rng = random.Random(3)
    counts = Counter()
    for _ in range(3000):
        word = "".join(rng.choice("ab") for _ in range(rng.randint(1, 9)))
        counts[word * rng.randint(1, 3)] += rng.randint(1, 50)
    counts.update({"aaaaaaa": 500, "abababab": 400, "ba": 3, "\\x": 7, "é": 9})
    assert learn_bpe_codes(counts, 400) == _reference(counts, 400)
