"""A deterministic synthetic parallel corpus shaped like WMT14 en-de, for scale benchmarks.

- Words: each side draws from its own lexicon, word ranks Zipf-distributed (exponent 1.0); rank r is
  spelled as the base-S digits of r in that side's syllable inventory, so forms are unique, frequent words
  are short and BPE finds shared pieces. At 4.5M pairs about 1M distinct word types appear per side (820k at 0.5M).
- Sentence lengths: log-normal with WMT's mean of ~25 words, a long tail clipped at 250 words; the target
  length follows the source's with noise. Sentences are capitalised and end in punctuation, with commas,
  quotes, hyphens and numbers for the Moses tokenizer and normalizer to work on.
- About 3% of pairs are there to be filtered: an empty side, a side over 250 words, or a length ratio
  far above 1.5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LEXICON = 1_000_000  # word ranks per side; at 4.5M pairs nearly all are drawn (~1M types per side)
ZIPF_EXPONENT = 1.0
BLOCK = 50_000  # pairs generated (and written) at once

_EN_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "y", "ea", "ou")]
_DE_SYLLABLES = [c + v for c in "bdfghklmnprstwz" for v in ("a", "e", "i", "o", "u", "ä", "ö", "ü", "ei", "au")] + [
    "sch", "ß", "ch", "st"]


def _spell(rank: int, syllables: list[str]) -> str:
    base = len(syllables)
    pieces = []
    rank += 1
    while rank:
        rank, digit = divmod(rank - 1, base)
        pieces.append(syllables[digit])
    return "".join(reversed(pieces))


class _Side:
    def __init__(self, syllables: list[str], lexicon: int = LEXICON) -> None:
        self.lexicon = lexicon
        self.words = [_spell(r, syllables) for r in range(lexicon)]
        weights = 1.0 / np.arange(1, lexicon + 1, dtype=np.float64) ** ZIPF_EXPONENT
        self.cdf = np.cumsum(weights / weights.sum())

    def sentences(self, rng: np.random.Generator, lengths: np.ndarray) -> list[str]:
        ids = np.searchsorted(self.cdf, rng.random(int(lengths.sum())), side="right").clip(0, self.lexicon - 1)
        punct = rng.random(len(lengths))
        commas = rng.random(int(lengths.sum())) < 0.06
        words, out, pos = self.words, [], 0
        id_list, comma_list = ids.tolist(), commas.tolist()
        for i, n in enumerate(lengths.tolist()):
            if n == 0:
                out.append("")
                continue
            toks = [words[w] + ("," if c else "") for w, c in zip(id_list[pos : pos + n], comma_list[pos : pos + n])]
            pos += n
            toks[0] = toks[0].capitalize()
            p = punct[i]
            if p < 0.05:
                toks[min(1, n - 1)] = f'"{toks[min(1, n - 1)]}"'
            elif p < 0.10:
                toks.append(f"{int(p * 100000)}-{int(p * 1000) % 97}")
            elif p < 0.14:
                toks[-1] += "-" + words[int(p * 1000)]
            out.append(" ".join(toks).rstrip(",") + ("?" if p > 0.95 else "."))
        return out


def generate(prefix: str | Path, pairs: int, seed: int = 1, src: str = "en", tgt: str = "de",
             lexicon: int = LEXICON) -> None:
    """Write `prefix.src` and `prefix.tgt` with `pairs` lines each (same output for the same arguments); word
    ranks from `lexicon` per side (a longer tail of types: WMT14 en-fr's 36M pairs with UN and giga-fren)."""
    source, target = _Side(_EN_SYLLABLES, lexicon), _Side(_DE_SYLLABLES, lexicon)
    rng = np.random.default_rng(seed)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.{src}", "w", encoding="utf-8") as fs, open(f"{prefix}.{tgt}", "w", encoding="utf-8") as ft:
        for start in range(0, pairs, BLOCK):
            n = min(BLOCK, pairs - start)
            src_len = np.rint(rng.lognormal(np.log(25) - 0.18, 0.6, n)).clip(1, 250).astype(np.int64)
            tgt_len = np.rint(src_len * rng.lognormal(0.0, 0.12, n)).clip(1, 250).astype(np.int64)
            noise = rng.random(n)
            tgt_len[noise < 0.005] = 0  # empty target
            src_len[(noise >= 0.005) & (noise < 0.01)] = 0  # empty source
            long = (noise >= 0.01) & (noise < 0.015)
            src_len[long], tgt_len[long] = 260, 265  # over the length limit
            skew = (noise >= 0.015) & (noise < 0.03)
            tgt_len[skew] = np.minimum(src_len[skew] * 3 + 3, 250)  # length ratio far above 1.5
            fs.write("\n".join(source.sentences(rng, src_len)) + "\n")
            ft.write("\n".join(target.sentences(rng, tgt_len)) + "\n")
