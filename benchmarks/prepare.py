"""Time `nmt prepare` on Multi30k (train + val + test_2016_flickr) with each tokenizer and, on the same
tokenized text, the plain `subword-nmt apply-bpe` command; then, in one process on the same English lines,
raw text -> pieces by Moses + BPE and by SentencePiece (issue 25: SentencePiece at least as fast per line).
Prints lines/s for each.

    python benchmarks/prepare.py [--workers N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table, require_multi30k


def time_prepare(data: Path, out: Path, workers: int, *flags: str) -> tuple[float, int]:
    """Seconds of one `nmt prepare` run on Multi30k, and the lines it read (both sides)."""
    cmd = [sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train", str(data / "train"),
           "--valid", str(data / "val"), "--test", str(data / "test_2016_flickr"), "--out", str(out), "--quiet",
           *flags] + (["--workers", str(workers)] if workers else [])
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - start
    meta = json.loads((out / "meta.json").read_text())
    return seconds, 2 * sum(meta["splits"][s].get("filtered", {}).get("input_sentences", meta["splits"][s]["sentences"])
                            for s in meta["splits"])


def segment_rate(segmenter, lines: list[str], lang: str) -> float:
    """Lines per second of raw text -> pieces, one process (best of 2 passes; the second has warm caches)."""
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for line in lines:
            segmenter.segment(line, lang)
        best = max(best, len(lines) / (time.perf_counter() - start))
    return best


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    data = require_multi30k()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "data"
        prepare_s, lines = time_prepare(data, out, args.workers, "--bpe-merges", "10000")
        spm_out = Path(tmp) / "spm"
        spm_s, spm_lines = time_prepare(data, spm_out, args.workers, "--tokenizer", "sentencepiece",
                                        "--vocab-size", "10000")

        # The same tokenized text through subword-nmt's own CLI (one process, as people run it).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from nmt_cli.text.moses import tokenize
        from nmt_cli.textio import read_lines

        tokenized = Path(tmp) / "all.tok"
        with open(tokenized, "w", encoding="utf-8") as f:
            for split in ("train", "val", "test_2016_flickr"):
                for lang in ("en", "de"):
                    path = data / f"{split}.{lang}.gz"
                    for line in read_lines(path if path.exists() else data / f"{split}.{lang}"):
                        f.write(tokenize(line, lang) + "\n")
        n_tok = sum(1 for _ in open(tokenized, encoding="utf-8"))
        start = time.perf_counter()
        with open(tokenized, encoding="utf-8") as fin, open(Path(tmp) / "all.bpe", "w") as fout:
            subword_nmt = str(Path(sys.executable).with_name("subword-nmt"))
            subprocess.run([subword_nmt, "apply-bpe", "-c", str(out / "bpe.codes")], stdin=fin, stdout=fout,
                           check=True)
        apply_s = time.perf_counter() - start

        from nmt_cli.data.binarized import DataDir

        english = read_lines(data / "train.en.gz" if (data / "train.en.gz").exists() else data / "train.en")
        moses_rate = segment_rate(DataDir.open(out).segmenter(), english, "en")
        spm_rate = segment_rate(DataDir.open(spm_out).segmenter(), english, "en")
    rows = [
        ["nmt prepare (tokenize + learn + apply BPE + binarize)", lines, prepare_s, lines / prepare_s],
        ["nmt prepare --tokenizer sentencepiece (learn + apply + binarize)", spm_lines, spm_s, spm_lines / spm_s],
        ["subword-nmt apply-bpe CLI (apply only, tokenized input)", n_tok, apply_s, n_tok / apply_s],
        ["raw English -> pieces, one process: Moses + BPE (10k merges)", len(english), len(english) / moses_rate,
         moses_rate],
        ["raw English -> pieces, one process: SentencePiece (10k unigram)", len(english), len(english) / spm_rate,
         spm_rate],
    ]
    print_table(f"prepare: Multi30k en-de, 10k merges / pieces ({machine()})", ["step", "lines", "seconds", "lines/s"],
                rows)
    return rows


if __name__ == "__main__":
    main()
