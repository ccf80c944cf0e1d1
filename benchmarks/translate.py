"""Translation speed on CPU: sentences/s and target tokens/s on Multi30k test_2016_flickr with a trained
`small` model, for beam 4 and greedy, batch 1 and 64, fp32 and bf16, one batch at a time and two at once
(`--parallel-batches 2`: two search threads, each on half the cores).

Batch 64 runs all 1,000 sentences; batch 1 runs the first 200 (it is the slow, latency-bound case).
Each engine runs in a fresh process of its own, each configuration `--repeat` times (after a one-batch
warm-up); the table gives the first run, which includes one-time costs such as oneDNN compiling its
kernels, and the best run. Also checks that odd input sizes (461, 1071 lines) come back whole.

Then the decoding options, each next to plain beam 4 on the same model and lines (batch 64, default
workers): sampling (whole distribution, and top-k 10), no repeated trigrams, a forced prefix (each
reference's first two words) and lexical constraints (1-2 phrases of 1-3 words from each reference), with
sent/s, the ratio to plain beam 4, and BLEU against the references; with `--exported`, CTranslate2's rows for
the options it has.

Then whole processes, as a user runs them: start-up (`import torch` alone, and one line through
`nmt translate`, median of 3) and `nmt translate -i FILE -o OUT` over all 1,000 sentences (sent/s of the
whole process, start-up included; with its default workers, and with one). With `--exported DIR` (from
`nmt export ctranslate2`, same model) both tables also run CTranslate2 on that folder, through the same
text pipeline and batching.

    python benchmarks/translate.py [--model exp/multi30k/model.pt] [--repeat 2] [--exported DIR]
                                   [--whole-only | --decode-only | --options-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, flickr_test_sources, machine, print_table


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO / "exp" / "multi30k" / "model.pt"))
    parser.add_argument("--batch1-sentences", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration")
    parser.add_argument("--exported", help="an `nmt export ctranslate2` folder of the same model")
    parser.add_argument("--whole-only", action="store_true", help="only the whole-process table")
    parser.add_argument("--decode-only", action="store_true", help="only the in-process (search) table")
    parser.add_argument("--options-only", action="store_true", help="only the decoding options' table")
    parser.add_argument("--engine-rows", help=argparse.SUPPRESS)  # internal: one engine's rows, as JSON
    args = parser.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"benchmark: {args.model} not found; run `make multi30k` first or pass --model")
    if args.engine_rows:
        print(json.dumps(engine_rows(args)))
        return []
    import torch

    from nmt_cli.decode.translate import Translator

    sources = flickr_test_sources()
    if args.options_only:
        return decoding_options(args)
    if not args.decode_only:
        whole_process(args, sources)
    if args.whole_only:
        return []
    rows = []
    engines = ["fp32", "bf16"] + (["exported"] if args.exported else [])
    for engine in engines:  # each in a fresh process: no engine runs beside another's idle thread pools
        for workers in (1, 2):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--exported", args.exported or "",
                                  "--repeat", str(args.repeat), "--batch1-sentences", str(args.batch1_sentences),
                                  "--engine-rows", f"{engine}:{workers}"], check=True, capture_output=True,
                                 text=True).stdout
            rows += json.loads(out.splitlines()[-1])
    translator = Translator.from_checkpoint(args.model, device="cpu")
    for n in (461, 1071):
        odd = (sources * 2)[:n]
        assert len(translator.translate(odd, greedy=True)) == n, n
    print_table(f"translate: Multi30k test_2016_flickr, small model, CPU ({machine()}, "
                f"{torch.get_num_threads()} threads)",
                ["search", "batch", "precision", "workers", "sentences", "sent/s (first run)", "sent/s (best)",
                 "tgt tok/s (best)"], rows)
    if not args.decode_only:
        decoding_options(args)
    return rows


def reference_phrases(reference: str, rng) -> list[str]:
    """1-2 phrases of 1-3 consecutive words of a reference (words of letters only), as a user who knows some of
    the right terms would give them."""
    words, phrases = reference.split(), []
    for _ in range(rng.randint(1, 2)):
        length = rng.randint(1, 3)
        starts = [i for i in range(len(words) - length + 1) if all(w.isalpha() for w in words[i : i + length])]
        if starts:
            start = rng.choice(starts)
            phrases.append(" ".join(words[start : start + length]))
    return phrases


def decoding_options(args) -> list[list]:
    """Sampling, no-repeat n-grams, prefixes and constraints next to plain beam 4: sent/s and BLEU."""
    import random

    import sacrebleu
    from common import require_multi30k

    from nmt_cli.decode.sampling import Sampling
    from nmt_cli.decode.translate import Translator
    from nmt_cli.textio import read_lines

    sources = flickr_test_sources()
    data = require_multi30k()
    refs = read_lines(data / "test_2016_flickr.de.gz" if (data / "test_2016_flickr.de.gz").exists()
                      else data / "test_2016_flickr.de")
    rng = random.Random(5)
    options = {
        "beam 4": {},
        "sampling": dict(sampling=Sampling(seed=1)),
        "sampling, top-k 10": dict(sampling=Sampling(topk=10, seed=1)),
        "beam 4, no repeated trigram": dict(no_repeat_ngram=3),
        "beam 4, prefix (2 reference words)": dict(prefixes=[" ".join(r.split()[:2]) for r in refs]),
        "beam 4, constraints (1-2 reference phrases)": dict(constraints=[reference_phrases(r, rng) for r in refs]),
    }
    engines = [("nmt fp32", Translator.from_checkpoint(args.model, device="cpu"))]
    if args.exported:
        from nmt_cli.export.ct2 import CTranslate2Translator

        engines.append(("ctranslate2", CTranslate2Translator.from_dir(args.exported)))
    rows = []
    for name, translator in engines:
        translator.translate(sources[:64])  # warm-up
        plain = None
        for label, extra in options.items():
            if "constraints" in extra and translator.constraints_refusal:
                continue
            runs = []
            for _ in range(max(1, args.repeat)):
                start = time.perf_counter()
                out = translator.translate(sources, **({} if "sampling" in extra else {"beam": 4}), **extra)
                runs.append(time.perf_counter() - start)
            translator.warnings.clear()
            translator.unmet.clear()
            rate = len(sources) / min(runs)
            plain = plain or rate
            bleu = sacrebleu.corpus_bleu(out, [refs]).score
            rows.append([name, label, len(sources), round(rate, 1), f"{plain / rate:.2f}x", round(bleu, 1)])
    print_table(f"translate options: Multi30k test_2016_flickr, small model, batch 64, CPU ({machine()})",
                ["engine", "decoding", "sentences", "sent/s (best)", "time vs beam 4", "BLEU"], rows)
    return rows


def engine_rows(args) -> list[list]:
    """Beam 4 and greedy, batch 64 and 1, of one engine and worker count ("ENGINE:WORKERS"): fp32 or bf16
    (nmt), or `exported` (CTranslate2, without importing torch; at batch 64 also with one call per batch,
    CTranslate2's native batching, where nmt's per-sentence length limits make one call per distinct limit)."""

    sources = flickr_test_sources()
    kind, workers = args.engine_rows.split(":")
    if kind == "exported":
        from nmt_cli.export.ct2 import CTranslate2Translator

        translator = CTranslate2Translator.from_dir(args.exported, workers=int(workers))
        label = "ctranslate2 " + json.loads((Path(args.exported) / "nmt.json").read_text())["quantization"]
    else:
        from nmt_cli.decode.translate import Translator

        translator = Translator.from_checkpoint(args.model, device="cpu", precision=kind, workers=int(workers))
        label = kind
    translator.translate(sources[:64])  # warm-up
    rows = []
    configurations = [(greedy, batch_size, True) for greedy in (False, True) for batch_size in (64, 1)]
    if kind == "exported":
        configurations += [(False, 64, False), (True, 64, False)]
    for greedy, batch_size, per_sentence_limits in configurations:
        if kind == "exported":
            translator.per_sentence_limits = per_sentence_limits
        subset = sources if batch_size > 1 else sources[: args.batch1_sentences]
        runs = []
        for _ in range(max(1, args.repeat)):
            translator.generated_tokens = 0
            start = time.perf_counter()
            out = translator.translate(subset, beam=4, greedy=greedy, batch_size=batch_size)
            runs.append(time.perf_counter() - start)
            assert len(out) == len(subset)
        tokens = translator.generated_tokens
        engine = label if per_sentence_limits else label + ", one call per batch"
        rows.append([("greedy" if greedy else "beam 4"), batch_size, engine, int(workers), len(subset),
                     round(len(subset) / runs[0], 1), round(len(subset) / min(runs), 1),
                     round(tokens / min(runs), 1)])
    return rows


def _timed(cmd: list[str], stdin: str | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, input=stdin, text=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def whole_process(args, sources: list[str]) -> None:
    """Start-up and whole-process throughput of `nmt translate`, as a user runs it."""
    nmt = [sys.executable, "-m", "nmt_cli", "translate", "--quiet"]
    torch_s = statistics.median(_timed([sys.executable, "-c", "import torch"]) for _ in range(3))
    rows = [["python -c 'import torch'", "-", f"{torch_s:.2f}", "-"]]
    models = [(args.model, "fp32", []), (args.model, "fp32", ["--parallel-batches", "1"]), (args.model, "bf16", [])]
    if args.exported:
        models += [(args.exported, "exported", []), (args.exported, "exported", ["--parallel-batches", "1"])]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "test.en"
        src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
        for model, kind, extra in models:
            flags = ["-m", model] + (["--precision", kind] if kind != "exported" else []) + extra
            one = statistics.median(_timed(nmt + flags, stdin=sources[0] + "\n") for _ in range(3))
            full = _timed(nmt + flags + ["-i", str(src), "-o", str(Path(tmp) / "out")])
            rows.append([f"nmt translate -m {Path(model).name} ({kind}) {' '.join(extra)}".rstrip()
                         + ", beam 4, batch 64", len(sources), f"{one:.2f}", f"{len(sources) / full:.1f}"])
    print_table(f"translate, whole process: Multi30k test_2016_flickr ({machine()})",
                ["command", "sentences", "one line: s (median of 3)", "whole file: sent/s"], rows)


if __name__ == "__main__":
    main()
