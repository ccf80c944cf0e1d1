"""Time `nmt prepare` on Multi30k (train + val + test_2016_flickr) and, on the same tokenized text,
the plain `subword-nmt apply-bpe` command; print lines/s for both.

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


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    data = require_multi30k()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "data"
        cmd = [sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train", str(data / "train"),
               "--valid", str(data / "val"), "--test", str(data / "test_2016_flickr"), "--bpe-merges", "10000",
               "--out", str(out), "--quiet"] + (["--workers", str(args.workers)] if args.workers else [])
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        prepare_s = time.perf_counter() - start
        meta = json.loads((out / "meta.json").read_text())
        lines = 2 * sum(meta["splits"][s].get("filtered", {}).get("input_sentences", meta["splits"][s]["sentences"])
                        for s in meta["splits"])

        # The same tokenized text through subword-nmt's own CLI (one process, as people run it).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from nmt_cli.text import tokenize
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
    rows = [
        ["nmt prepare (tokenize + learn + apply BPE + binarize)", lines, prepare_s, lines / prepare_s],
        ["subword-nmt apply-bpe CLI (apply only, tokenized input)", n_tok, apply_s, n_tok / apply_s],
    ]
    print_table(f"prepare: Multi30k en-de, 10k merges ({machine()})", ["step", "lines", "seconds", "lines/s"], rows)
    return rows


if __name__ == "__main__":
    main()
