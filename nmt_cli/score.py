"""sacreBLEU corpus scores (BLEU, chrF, TER) with signatures, and the paper-era tokenized compound-split BLEU."""

from __future__ import annotations

from collections.abc import Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from . import text
from .errors import NmtError

METRICS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}
UNSPACED_LANGUAGES = ("zh", "ja", "ko", "th", "my", "km", "lo")  # written without spaces between words


def score(hyps: Sequence[str], refs: Sequence[Sequence[str]], metrics: Sequence[str] = ("bleu", "chrf", "ter"),
          tokenized_bleu_lang: str | None = None) -> list[dict]:
    """One record per metric: name, score, signature and sacreBLEU's full line.

    With `tokenized_bleu_lang`, adds tensor2tensor's tokenized BLEU with compound splitting
    (Moses-tokenize both sides, split ``a-b`` compounds) as reported in the paper.
    """
    for i, ref in enumerate(refs):
        if len(ref) != len(hyps):
            raise NmtError(f"hypotheses have {len(hyps)} lines but reference {i + 1} has {len(ref)}")
    results = []
    for name in metrics:
        if name not in METRICS:
            raise NmtError(f"unknown metric {name!r} (choose from {', '.join(METRICS)})")
        metric = METRICS[name]()
        result = metric.corpus_score(list(hyps), [list(r) for r in refs])
        results.append({"metric": name, "score": round(result.score, 4), "signature": str(metric.get_signature()),
                        "text": str(result)})
    if tokenized_bleu_lang in UNSPACED_LANGUAGES:
        raise NmtError(f"--tokenized-bleu {tokenized_bleu_lang}: Moses tokenization does not split Chinese, Japanese, "
                       "Korean or Thai text into words, so its BLEU would score whole clauses; use sacreBLEU's BLEU "
                       "(--metrics bleu)")
    if tokenized_bleu_lang:
        def prep(line: str) -> str:
            return text.split_compounds(text.tokenize(line, tokenized_bleu_lang, aggressive_dash=False))

        metric = BLEU(tokenize="none", force=True)
        result = metric.corpus_score([prep(h) for h in hyps], [[prep(r) for r in ref] for ref in refs])
        results.append({"metric": "tokenized_bleu", "score": round(result.score, 4),
                        "signature": "moses-tok+compound-split|" + str(metric.get_signature()),
                        "text": str(result)})
    return results
