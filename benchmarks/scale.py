"""`nmt prepare` and `nmt train` start-up at WMT14 scale, on a synthetic corpus shaped like WMT14 en-de.

    python benchmarks/scale.py --pairs 4500000 [--lexicon 3000000] [--tokenizer sentencepiece] [--json] [--work DIR]
                               [--keep]

Generates N pairs (benchmarks/synthetic.py: Zipfian words, ~1M types per side at 4.5M pairs, WMT-like
lengths, ~3% of pairs for the filters to drop) plus 3,000-pair valid and test sets, runs `nmt prepare`
with the WMT14 recipe's settings (35k merges, punctuation normalization, --max-len 250, --max-ratio 1.5,
all cores; or `--tokenizer sentencepiece`, a 37k-piece unigram model learned on a 1M-line sample) and then
`nmt train --arch base` on the result up to its first update. Prints a table per
stage (seconds, lines/s, peak RSS, disk); --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, machine, print_table

sys.path.insert(0, str(REPO))


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prepare_worker(work: str, merges: int, tokenizer: str = "moses", workers: int = 0) -> None:
    """Child process: nmt prepare with the recipe's settings on `workers` processes (0: every core); one JSON
    line per stage on stdout."""
    from nmt_cli.data.prepare import PrepareOptions, prepare

    w = Path(work)
    opts = PrepareOptions("en", "de", str(w / "train"), str(w / "valid"), w / "data", test=[str(w / "test")],
                          bpe_merges=merges, max_len=250, max_ratio=1.5, force=True, quiet=True, normalize=True,
                          workers=workers or os.cpu_count() or 1, tokenizer=tokenizer, vocab_size=37_000)
    prepare(opts, on_stage=lambda record: print(json.dumps(record), flush=True))


def train_worker(data: str, save: str) -> None:
    """Child process: open the data dir, build the batches (measuring the index), train to the first update."""
    from nmt_cli.data.binarized import DataDir, make_batches
    from nmt_cli.training.trainer import TrainOptions, train

    before = _rss_mb()
    d = DataDir.open(data)
    corpus = d.split("train")
    batches = make_batches(corpus.src.sizes, corpus.tgt.sizes, 4096, 1)
    index_mb = _rss_mb() - before
    del batches, corpus, d
    start = time.time()
    train(TrainOptions(data=Path(data), save_dir=Path(save), arch="base", max_updates=1, max_tokens=4096,
                       device="cpu", quiet=True, keep_last=0, log_interval=1, precision="bf16"))
    first = next(json.loads(x) for x in (Path(save) / "train.jsonl").read_text().splitlines() if '"train"' in x)
    print(json.dumps({"train_first_update_s": first["time"] - start, "train_index_mb": index_mb,
                      "train_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _du_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def synthetic_lexicon() -> int:
    import synthetic

    return synthetic.LEXICON


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=500_000)
    parser.add_argument("--merges", type=int, default=35_000)
    parser.add_argument("--lexicon", type=int, default=synthetic_lexicon(),
                        help="word ranks per side (default 1M, WMT14 en-de-like; 3M: a longer tail, as en-fr's)")
    parser.add_argument("--tokenizer", default="moses", choices=("moses", "sentencepiece"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
    parser.add_argument("--workers", type=int, default=0, help="nmt prepare's --workers (0: every core)")
    parser.add_argument("--prepare-worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--train-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare_worker:
        prepare_worker(args.prepare_worker[0], int(args.prepare_worker[1]), args.prepare_worker[2],
                       int(args.prepare_worker[3]))
        return {}
    if args.train_worker:
        train_worker(*args.train_worker)
        return {}

    import synthetic

    work = args.work or Path(tempfile.mkdtemp(prefix="nmt-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        synthetic.generate(work / "train", args.pairs, seed=1, lexicon=args.lexicon)
        synthetic.generate(work / "valid", 3000, seed=2)
        synthetic.generate(work / "test", 3000, seed=3)
        generate_s = time.perf_counter() - start
        corpus_mb = sum((work / f"train.{lang}").stat().st_size for lang in ("en", "de")) / 2**20

        start = time.perf_counter()
        child = subprocess.run([sys.executable, __file__, "--prepare-worker", str(work), str(args.merges),
                                args.tokenizer, str(args.workers)], capture_output=True, text=True)
        prepare_s = time.perf_counter() - start
        if child.returncode != 0:
            sys.exit(f"scale: nmt prepare failed: {child.stderr.strip().splitlines()[-1:]}")
        stages = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        prepare_peak = max(s["peak_rss_mb"] for s in stages)
        data_mb = _du_mb(work / "data")

        child = subprocess.run([sys.executable, __file__, "--train-worker", str(work / "data"), str(work / "ckpt")],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"scale: nmt train failed: {child.stderr.strip().splitlines()[-1:]}")
        train = json.loads(child.stdout.strip().splitlines()[-1])
        meta = json.loads((work / "data" / "meta.json").read_text())
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)

    result = {
        "pairs": args.pairs, "lexicon": args.lexicon, "merges": args.merges, "tokenizer": args.tokenizer,
        "workers": args.workers or os.cpu_count(),
        "generate_s": round(generate_s, 1),
        "corpus_mb": round(corpus_mb, 1), "prepare_s": round(prepare_s, 1),
        "prepare_peak_rss_mb": round(prepare_peak, 1), "data_dir_mb": round(data_mb, 1),
        "train_first_update_s": round(train["train_first_update_s"], 1),
        "train_peak_rss_mb": round(train["train_peak_rss_mb"], 1), "train_index_mb": round(train["train_index_mb"], 1),
        "kept_pairs": meta["splits"]["train"]["filtered"]["kept"], "dropped": meta["splits"]["train"]["filtered"][
            "dropped"], "vocab_size": meta["vocab_size"], "stages": stages, "machine": machine(),
    }
    if args.json:
        print(json.dumps(result))
        return result
    rows = [[s["stage"], s["seconds"], f"{s['lines'] / max(s['seconds'], 1e-9):,.0f} {s.get('unit', 'lines')}/s",
             s["peak_rss_mb"], s.get("disk_mb", 0.0)] for s in stages]
    rows.append(["whole prepare (process)", prepare_s, f"{2 * args.pairs / prepare_s:,.0f} lines/s", prepare_peak,
                 data_mb])
    rows.append(["train start-up to first update (base, bf16)", train["train_first_update_s"], "",
                 train["train_peak_rss_mb"], 0.0])
    what = f"{args.merges:,} merges" if args.tokenizer == "moses" else "SentencePiece, 37,000 pieces"
    print_table(f"scale: {args.pairs:,} synthetic WMT14-like pairs, {what} ({machine()})",
                ["stage", "seconds", "rate", "peak RSS MB", "disk MB"], rows)
    print(f"corpus {corpus_mb:,.0f} MB generated in {generate_s:.0f} s; kept {result['kept_pairs']:,} pairs "
          f"(dropped {result['dropped']}); vocabulary {result['vocab_size']:,}; train data index "
          f"{result['train_index_mb']:,.0f} MB")
    return result


if __name__ == "__main__":
    main()
