"""Translation speed on CPU: sentences/s and target tokens/s on Multi30k test_2016_flickr with a trained
`small` model, for beam 4 and greedy, batch 1 and 64, fp32 and bf16.

Batch 64 runs all 1,000 sentences; batch 1 runs the first 200 (it is the slow, latency-bound case).
Each configuration runs `--repeat` times (after a one-batch warm-up); the table gives the first run, which
includes one-time costs such as oneDNN compiling its bf16 kernels, and the best run. Also checks that odd
input sizes (461, 1071 lines) come back whole.

    python benchmarks/translate.py [--model exp/multi30k/model.pt] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import REPO, machine, print_table, require_multi30k


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO / "exp" / "multi30k" / "model.pt"))
    parser.add_argument("--batch1-sentences", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration")
    args = parser.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"benchmark: {args.model} not found; run `make multi30k` first or pass --model")
    import torch

    from nmt_cli.textio import read_lines
    from nmt_cli.translate import Translator

    data = require_multi30k()
    path = data / "test_2016_flickr.en.gz"
    sources = read_lines(path if path.exists() else data / "test_2016_flickr.en")
    rows = []
    for precision in ("fp32", "bf16"):
        translator = Translator.from_checkpoint(args.model, device="cpu", precision=precision)
        translator.translate(sources[:64])  # warm-up
        for greedy in (False, True):
            for batch_size in (64, 1):
                subset = sources if batch_size > 1 else sources[: args.batch1_sentences]
                runs = []
                for _ in range(max(1, args.repeat)):
                    translator.generated_tokens = 0
                    start = time.perf_counter()
                    out = translator.translate(subset, beam=4, greedy=greedy, batch_size=batch_size)
                    runs.append(time.perf_counter() - start)
                    assert len(out) == len(subset)
                tokens = translator.generated_tokens
                rows.append([("greedy" if greedy else "beam 4"), batch_size, precision, len(subset),
                             len(subset) / runs[0], len(subset) / min(runs), tokens / min(runs)])
    translator = Translator.from_checkpoint(args.model, device="cpu")
    for n in (461, 1071):
        odd = (sources * 2)[:n]
        assert len(translator.translate(odd, greedy=True)) == n, n
    print_table(f"translate: Multi30k test_2016_flickr, small model, CPU ({machine()}, "
                f"{torch.get_num_threads()} threads)",
                ["search", "batch", "precision", "sentences", "sent/s (first run)", "sent/s (best)",
                 "tgt tok/s (best)"], rows)
    return rows


if __name__ == "__main__":
    main()
