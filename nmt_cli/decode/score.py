"""sacreBLEU corpus scores (BLEU, chrF, TER) with signatures, and the paper-era tokenized compound-split BLEU."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF, TER

from nmt_cli.errors import NmtError
from nmt_cli.text import moses as text
from nmt_cli.text.languages import base_language, is_asian

METRICS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}
# sacreBLEU's BLEU tokenizers (spm and flores ones download a model, so they are left out).
TOKENIZERS = ("13a", "intl", "zh", "char", "ja-mecab", "ko-mecab", "none")


def default_tokenize(lang: str | None) -> str:
    """The BLEU tokenizer a target language's results are reported with: zh -> zh; ja -> ja-mecab and
    ko -> ko-mecab where MeCab is installed (sacrebleu[ja] / sacrebleu[ko]), else char; otherwise 13a."""
    base = base_language(lang or "")
    if base == "zh":
        return "zh"
    if base in ("ja", "ko"):
        module = {"ja": "MeCab", "ko": "mecab_ko"}[base]
        return f"{base}-mecab" if importlib.util.find_spec(module) is not None else "char"
    return "13a"


def mecab_fallback(lang: str | None) -> str | None:
    """A line saying that BLEU for Japanese or Korean falls back to characters because MeCab is missing (and
    how to install it), or None."""
    base = base_language(lang or "")
    if base not in ("ja", "ko") or default_tokenize(lang) != "char":
        return None
    return (f"MeCab is not installed, so BLEU tokenizes {lang} by characters instead of {base}-mecab: "
            f"pip install 'sacrebleu[{base}]' for the standard one")


def score(hyps: Sequence[str], refs: Sequence[Sequence[str]], metrics: Sequence[str] = ("bleu", "chrf", "ter"),
          tokenized_bleu_lang: str | None = None, tokenize: str | None = None, lang: str | None = None) -> list[dict]:
    """One record per metric: name, score, signature and sacreBLEU's full line.

    BLEU tokenizes with `tokenize`, or by default as `lang` (the target language) wants (`default_tokenize`);
    TER supports Asian scripts for an unspaced target language.

    With `tokenized_bleu_lang`, adds tensor2tensor's tokenized BLEU with compound splitting
    (Moses-tokenize both sides, split ``a-b`` compounds) as reported in the paper.
    """
    for i, ref in enumerate(refs):
        if len(ref) != len(hyps):
            raise NmtError(f"hypotheses have {len(hyps)} lines but reference {i + 1} has {len(ref)}")
    if tokenize is not None and tokenize not in TOKENIZERS:
        raise NmtError(f"unknown --tokenize {tokenize!r} (choose from {', '.join(TOKENIZERS)})")
    tokenize = tokenize or default_tokenize(lang)
    unspaced = is_asian(lang or "")
    results = []
    for name in metrics:
        if name == LOWERCASE_TOKENIZED:
            results.append(lowercase_tokenized_bleu(hyps, refs, lang))
            continue
        if name not in METRICS:
            raise NmtError(f"unknown metric {name!r} (choose from {', '.join([*METRICS, LOWERCASE_TOKENIZED])})")
        options = {"bleu": {"tokenize": tokenize}, "ter": {"asian_support": unspaced}}.get(name, {})
        try:
            metric = METRICS[name](**options)
        except RuntimeError as e:  # ja-mecab / ko-mecab without their extra
            raise NmtError(f"--tokenize {tokenize}: {' '.join(str(e).split())}") from None
        result = metric.corpus_score(list(hyps), [list(r) for r in refs])
        results.append({"metric": name, "score": round(result.score, 4), "signature": str(metric.get_signature()),
                        "text": str(result)})
    if tokenized_bleu_lang and is_asian(tokenized_bleu_lang):
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


# The multimodal-MT literature's Multi30k metric (Wu et al. 2021 and the papers it compares with): BLEU on
# lowercased, Moses-tokenized text, without the aggressive hyphen splits. Lowercased first, as Multi30k's own
# tokenized files are: Moses' German non-breaking prefixes hold capitalized words ("Bart."), so the other order
# keeps a sentence-final "Bart." whole and gives a reference length one token short of the papers' 12,103.
LOWERCASE_TOKENIZED = "lc-bleu"


def lowercase_tokenized_bleu(hyps: Sequence[str], refs: Sequence[Sequence[str]], lang: str | None) -> dict:
    """BLEU on lowercased, then Moses-tokenized hypotheses and references (`lang`'s rules, hyphens kept whole),
    with its reference length in the record ("ref_len"), which papers print beside it."""
    if not lang:
        raise NmtError(f"--metrics {LOWERCASE_TOKENIZED} tokenizes as the target language does: give --lang (or "
                       "-m MODEL)")
    if is_asian(lang):
        raise NmtError(f"--metrics {LOWERCASE_TOKENIZED}: Moses tokenization does not split {lang} text into words")

    def prep(line: str) -> str:
        return text.tokenize(line.lower(), lang, aggressive_dash=False)

    metric = BLEU(tokenize="none", force=True)
    result = metric.corpus_score([prep(h) for h in hyps], [[prep(r) for r in ref] for ref in refs])
    return {"metric": LOWERCASE_TOKENIZED, "score": round(result.score, 4), "ref_len": result.ref_len,
            "signature": f"lowercase+moses-tok:{lang}|" + str(metric.get_signature()), "text": str(result)}


def target_language_of(path: str | Path) -> str:
    """The target language recorded in a checkpoint, an exported folder (nmt.json) or a data dir (meta.json)."""
    import json

    path = Path(path)
    for name in ("nmt.json", "meta.json"):
        if path.is_dir() and (path / name).is_file():
            try:
                return str(json.loads((path / name).read_text(encoding="utf-8"))["target_lang"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                raise NmtError(f"{path / name}: no target_lang (not written by nmt?)") from None
    if path.is_dir():
        raise NmtError(f"{path}: neither a checkpoint, an exported folder nor a data dir")
    from nmt_cli.model.checkpoint import load_checkpoint, require_keys

    return str(require_keys(load_checkpoint(path), path, ("target_lang",))["target_lang"])


def score_files(hypotheses: Path | None, references: list[Path], metrics: list[str],
                tokenized_bleu_lang: str | None = None, tokenize: str | None = None, lang: str | None = None,
                model: Path | None = None) -> tuple[list[dict], str | None]:
    """`nmt score`: the hypotheses file (None: stdin) against each reference file, line by line; the target
    language from `lang` or the model, data dir or export given. Returns the scores and a warning (MeCab
    missing) or None."""
    from nmt_cli.textio import read_lines, read_stdin

    hyps = read_lines(hypotheses) if hypotheses is not None else read_stdin()
    if not hyps:
        raise NmtError(f"{hypotheses or '<stdin>'}: no hypotheses (empty file): nothing to score")
    refs = [read_lines(r) for r in references]
    for r, lines in zip(references, refs):
        if len(lines) != len(hyps):
            raise NmtError(f"{hypotheses or '<stdin>'} has {len(hyps)} lines but {r} has {len(lines)}")
    if model is not None:
        recorded = target_language_of(model)
        if lang is not None and lang != recorded:
            raise NmtError(f"--lang {lang}, but {model} translates into {recorded}")
        lang = recorded
    warning = mecab_fallback(lang) if tokenize is None else None
    return score(hyps, refs, metrics, tokenized_bleu_lang, tokenize, lang), warning


def print_scores(results: list[dict], as_json: bool = False) -> None:
    """The scores as JSON, or as a table followed by each metric's signature on a line of its own."""
    if as_json:
        print(json.dumps(results, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scores")
    table.add_column("metric")
    table.add_column("score", justify="right")
    table.add_column("details")
    for r in results:
        table.add_row(r["metric"], f"{r['score']:.2f}", r["text"])
    console = Console(soft_wrap=True)  # signatures are printed whole, on lines of their own, never cut
    console.print(table)
    for r in results:
        console.print(f"{r['metric']} signature: {r['signature']}", markup=False, highlight=False)
