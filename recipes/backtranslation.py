"""Back-translation as a low-resource simulation on real data (`make multi30k-bt`).

    python recipes/backtranslation.py --raw EXP/raw --out EXP/bt [--src en] [--tgt de] [--arch small]
        [--minutes 10] [--max-updates 0] [--backward-minutes M] [--backward-updates N] [--rows "parallel,..."]
        [--jobs 0] [--threads 0] [--bpe-merges 10000] [--precision auto] [--train-flags "..."]

Multi30k's training pairs are split with a fixed seed into a parallel half and a "monolingual" half whose
source side (English) is thrown away. A tgt->src model trained on the parallel half translates the
monolingual half back, with beam search (beam 4) and, separately, by sampling (Edunov et al., 2018). Then
one src->tgt model per row, each trained for the same minutes (or updates) with seed 1:

  parallel      the parallel half only
  parallel (seed 2)
                the same with seed 2: the seed noise a row's difference from the parallel half is weighed against
  beam BT       + the monolingual half with its beam back-translations as sources
  sampled BT    + the same with sampled back-translations
  tagged BT     + the sampled ones with a `<BT>` tag on each synthetic source (Caswell et al., 2019;
                `nmt prepare --tag <BT>`: one vocabulary symbol)
  all real      + the monolingual half with its real sources: the ceiling

The backward model may train longer than the rows (--backward-minutes, --backward-updates): a stronger one
gives better synthetic sources. --rows picks rows (the parallel half and the ceiling alone, to find a budget at
which the ceiling clearly beats the parallel half before paying for the other rows).

Models that do not need each other train at once, --jobs at a time (default: one per core, at most the
models still to make, so that a resumed run's last model gets every core), each step on --threads CPU threads
(default: the cores shared among the jobs). On a CPU, small models gain more from a core of their own than from
a second thread: two 1-thread runs side by side make more tokens per second in all than one 2-thread run. The
backward model starts first (the back-translated rows wait for it), then the other rows in the table's order.
When a step fails, the others are stopped; their finished steps are kept, so a second run resumes.

Each model's BPE is learned on its own training pairs (the parallel half, and for the rows that have them
the monolingual target side and its synthetic sources): no val or test text joins it. Each is chosen on val
(recipes/select_on_val.py: the best checkpoint or an average of the last ones, then the length penalty)
and scored on test_2016_flickr with sacreBLEU and chrF2. The table gives each row's val BLEU, its difference
from the parallel half on val and whether that difference exceeds the seed noise, and states the ceiling's
margin. Every step is skipped when its output exists, so a
second run resumes. Writes OUT/backtranslation.md, .json and .png (BLEU by row).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nmt_cli.decode.score import score  # noqa: E402
from nmt_cli.errors import NmtError  # noqa: E402
from nmt_cli.text.languages import is_unspaced  # noqa: E402
from nmt_cli.textio import atomic_path, read_lines  # noqa: E402

TAG = "<BT>"
# Longer monolingual lines are left out before back-translation: `nmt prepare`'s default --max-len is 250 tokens,
# so such a pair would be dropped from training anyway, after the cost of translating it.
MAX_MONO_WORDS = 250
PARALLEL, SECOND_SEED, CEILING = "parallel", "parallel (seed 2)", "all real"
ROWS = (PARALLEL, SECOND_SEED, "beam BT", "sampled BT", "tagged BT", CEILING)
BACKWARD = "backward model"


class Steps:
    """Runs each step's command on its share of the CPU threads; once one fails, stops the others."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads  # per step (0: torch's default)
        self.running: set[subprocess.Popen] = set()
        self.stopped = False
        self.lock = threading.Lock()

    def run(self, command: list, what: str) -> None:
        """Run one step's command (printed first, under the recipe's name); NmtError when it fails."""
        print(f"{Path(sys.argv[0]).stem}: {what}: {' '.join(map(str, command))}", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)} if self.threads else None
        with self.lock:
            if self.stopped:
                raise NmtError(f"{what}: not started: another step failed")
            process = subprocess.Popen([str(c) for c in command], env=env)
            self.running.add(process)
        code = process.wait()
        with self.lock:
            self.running.discard(process)
        if code != 0:
            raise NmtError(f"{what}: {command[0]} {command[1]} failed (its output is above)")

    def stop(self) -> None:
        """Start no more steps, and end the running ones (what they finished stays: a second run resumes)."""
        with self.lock:
            self.stopped = True
            for process in self.running:
                process.terminate()

    def thread_flags(self, translate: bool = False) -> list[str]:
        """nmt train's (or nmt translate's: one batch at a time on a single thread) flags for this share."""
        if not self.threads:
            return []
        one_batch = translate and self.threads == 1
        return ["--threads", str(self.threads), *(["--parallel-batches", "1"] if one_batch else [])]


def run_at_once(jobs: int, tasks: list[tuple[str, Callable[[Callable[[str], object]], object]]],
                steps: Steps) -> dict[str, object]:
    """Run named tasks `jobs` at a time, in the order given; each gets `after(name)`, which waits for an earlier
    task's result. The results by name; the first failure (others stopped) is raised."""
    futures: dict[str, Future] = {}

    def after(name: str) -> object:
        return futures[name].result()

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, task in tasks:
            futures[name] = pool.submit(task, after)
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = [f for f in futures.values() if f in done and f.exception() is not None]
        if failed:
            steps.stop()
            pool.shutdown(cancel_futures=True)
            raise failed[0].exception()
    return {name: future.result() for name, future in futures.items()}


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def raw_file(raw: Path, name: str) -> Path:
    """RAW/NAME, or RAW/NAME.gz (a recipe links the shared copy's .gz files)."""
    return raw / name if (raw / name).exists() else raw / f"{name}.gz"


def usable_monolingual(indices: list[int], lines: list[str], lang: str, name: Path) -> list[int]:
    """The `indices` of `lines` (of the file `name`) worth back-translating: empty lines and lines of more than
    MAX_MONO_WORDS words (characters in a language written without spaces) are left out, with their counts on
    stderr; NmtError when none is left."""
    def length(line: str) -> int:
        return len("".join(line.split())) if is_unspaced(lang) else len(line.split())

    empty = [i for i in indices if not lines[i].strip()]
    long = [i for i in indices if lines[i].strip() and length(lines[i]) > MAX_MONO_WORDS]
    if empty or long:
        unit = "characters" if is_unspaced(lang) else "words"
        print(f"{Path(sys.argv[0]).stem}: {name}: left {len(empty):,} empty and {len(long):,} over-long (more than "
              f"{MAX_MONO_WORDS} {unit}) lines out of the monolingual half's {len(indices):,} (first at line "
              f"{min(empty + long) + 1})", file=sys.stderr, flush=True)
    dropped = set(empty + long)
    kept = [i for i in indices if i not in dropped]
    if not kept:
        raise NmtError(f"{name}: no line of the monolingual half is left to back-translate")
    return kept


def split(raw: Path, out: Path, src: str, tgt: str, seed: int) -> None:
    """The parallel half (both sides) and the monolingual half (the target side; its real sources are kept
    apart for the ceiling row only)."""
    if (out / f"mono.{tgt}").exists():
        return
    sources, targets = read_lines(raw_file(raw, f"train.{src}")), read_lines(raw_file(raw, f"train.{tgt}"))
    if len(sources) != len(targets) or len(sources) < 4:
        raise NmtError(f"{raw}: train.{src} and train.{tgt} must hold the same number of lines, at least 4")
    order = list(range(len(sources)))
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    parallel = sorted(order[:half])
    mono = usable_monolingual(sorted(order[half:]), targets, tgt, raw_file(raw, f"train.{tgt}"))
    write_lines(out / f"parallel.{src}", [sources[i] for i in parallel])
    write_lines(out / f"parallel.{tgt}", [targets[i] for i in parallel])
    write_lines(out / f"mono_real.{src}", [sources[i] for i in mono])
    write_lines(out / f"mono.{tgt}", [targets[i] for i in mono])  # written last: the split is complete


def model(name: str, folder: Path, train: Path, src: str, tgt: str, raw: Path, args: argparse.Namespace,
          steps: Steps, tags: tuple[str, ...] = (), seed: int = 1, budget: tuple[float, int] | None = None) -> Path:
    """prepare, train (`budget`: minutes and updates, the rows' when None), choose on val: FOLDER/model.pt (each
    step skipped when its output exists)."""
    minutes, updates = budget or (args.minutes, args.max_updates)
    nmt = shlex.split(args.nmt)
    data = folder / "data"
    if not (data / "meta.json").exists():
        steps.run([*nmt, "prepare", "-s", src, "-t", tgt, "--train", train, "--valid", raw / "val", "--test",
                   raw / "test_2016_flickr", "--bpe-merges", args.bpe_merges, "--max-ratio", "9", "--out", data,
                   "--force", "--quiet", *[flag for tag in tags for flag in ("--tag", tag)]], f"{name}: prepare")
    if not (folder / "ckpt" / ".done").exists():
        steps.run([*nmt, "train", data, "--save-dir", folder / "ckpt", "--arch", args.arch, "--precision",
                   args.precision, "--max-time", minutes, "--max-updates", updates, "--keep-last", "10", "--seed",
                   seed, "--device", "cpu", "--quiet", *steps.thread_flags(), *shlex.split(args.train_flags)],
                  f"{name}: train")
        (folder / "ckpt" / ".done").touch()
    if not (folder / "model.pt").exists():
        steps.run([sys.executable, Path(__file__).with_name("select_on_val.py"), "--ckpt-dir", folder / "ckpt",
                   "--src", data / f"valid.raw.{src}", "--ref", data / f"valid.raw.{tgt}", "--windows", "3,5",
                   "--lenpens", "0.6,1.0", "--beam", "4", "--out", folder / "model.pt", "--record",
                   folder / "selection.json"], f"{name}: choose on val")
    return folder / "model.pt"


def row_folder(out: Path, row: str) -> Path:
    """OUT/<the row's name in lowercase, words joined by '-'>: where a row's model is made."""
    return out / re.sub(r"[^a-z0-9]+", "-", row.lower()).strip("-")


def unfinished(rows: list[str], out: Path, last_back_translation: Path | None) -> list[str]:
    """The rows (and the backward model, when `last_back_translation` is not yet written) whose model is not yet
    chosen: a resumed run shares the cores among these alone, so that a last row left gets them all."""
    backward = [BACKWARD] if last_back_translation is not None and not last_back_translation.exists() else []
    return backward + [row for row in rows if not (row_folder(out, row) / "model.pt").exists()]


def translate(model_path: Path, source: Path, output: Path, what: str, args: argparse.Namespace, steps: Steps,
              *flags: str) -> None:
    if not output.exists():
        steps.run([*shlex.split(args.nmt), "translate", "-m", model_path, "-i", source, "-o", output, "--quiet",
                   *steps.thread_flags(translate=True), *flags], what)


def row_corpus(row: str, corpora: Path, folder: Path, src: str, tgt: str) -> Path:
    """FOLDER/train.{src,tgt} of a row: the parallel half, and the monolingual half with the row's sources."""
    prefix = folder / "train"
    if (prefix.with_suffix(f".{tgt}")).exists():
        return prefix
    sources, targets = read_lines(corpora / f"parallel.{src}"), read_lines(corpora / f"parallel.{tgt}")
    if row == SECOND_SEED:  # the parallel half's own files, so that the two seeds see the same pairs
        row = PARALLEL
    synthetic = {"beam BT": f"bt.beam.{src}", "sampled BT": f"bt.sampled.{src}", "tagged BT": f"bt.sampled.{src}",
                 "all real": f"mono_real.{src}"}.get(row)
    if synthetic is not None:
        extra = read_lines(corpora / synthetic)
        if row == "tagged BT":
            extra = [f"{TAG} {line}" for line in extra]
        sources, targets = sources + extra, targets + read_lines(corpora / f"mono.{tgt}")
    write_lines(prefix.with_suffix(f".{src}"), sources)
    write_lines(prefix.with_suffix(f".{tgt}"), targets)  # written last
    return prefix


def evaluate(model_path: Path, folder: Path, src: str, tgt: str, args: argparse.Namespace, steps: Steps) -> dict:
    data = folder / "data"
    translate(model_path, data / f"test.raw.{src}", folder / "test.hyp", f"{folder.name}: test", args, steps)
    records = score(read_lines(folder / "test.hyp"), [read_lines(data / f"test.raw.{tgt}")], ("bleu", "chrf"),
                    lang=tgt)
    return {r["metric"]: round(r["score"], 2) for r in records} | {"signatures": [r["signature"] for r in records]}


def compare(results: list[dict]) -> str:
    """Mark each row's val difference from the parallel half ("vs_parallel") and whether it exceeds the seed
    noise (the two parallel seeds' val difference; "beyond_noise"); return a sentence on the ceiling's margin
    and the noise (empty when the parallel row is not among the results)."""
    by_row = {r["row"]: r for r in results}
    if PARALLEL not in by_row:
        return ""
    base = by_row[PARALLEL]["val_bleu"]
    noise = abs(by_row[SECOND_SEED]["val_bleu"] - base) if SECOND_SEED in by_row else None
    for r in results:
        if r["row"] not in (PARALLEL, SECOND_SEED):
            r["vs_parallel"] = round(r["val_bleu"] - base, 2)
            r["beyond_noise"] = None if noise is None else abs(r["vs_parallel"]) > noise
    parts = []
    if CEILING in by_row:
        margin = by_row[CEILING]["vs_parallel"]
        parts.append(f"The ceiling beats the parallel half by {margin:+.1f} BLEU on val "
                     f"({'at least' if margin >= 3 else 'less than'} the 3 a table that can show a gain needs).")
    parts.append(f"Seed noise (the parallel half with seeds 1 and 2, on val): {noise:.1f} BLEU." if noise is not None
                 else "No second seed of the parallel half: the seed noise is not measured.")
    return " ".join(parts)


def markdown(results: list[dict], note: str) -> str:
    lines = [note, "", "| row | training pairs | val BLEU | vs parallel (val) | BLEU | chrF2 | updates | "
             "train minutes | trained on |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "vs_parallel" in r:
            beyond = {True: ", beyond the seed noise", False: ", within the seed noise", None: ""}[r["beyond_noise"]]
            versus = f"{r['vs_parallel']:+.1f}{beyond}"
        else:
            versus = ""
        lines.append(f"| {r['row']} | {r['pairs']:,} | {r['val_bleu']:.1f} | {versus} | {r['bleu']:.1f} | "
                     f"{r['chrf']:.1f} | {r['updates']:,} | {r['train_minutes']:.1f} | "
                     f"{'; '.join(kind.split(':')[0] for kind in r.get('machines', []))} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    """BLEU per row on val (where the rows are compared) and on test, as paired bars (the ceiling's paler)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    names = [r["row"] for r in results]
    width = 0.4
    for offset, key, label, colours in ((-width / 2, "val_bleu", "val", ("#4c72b0", "#a6b9d8")),
                                        (width / 2, "bleu", "test_2016_flickr", ("#dd8452", "#eec1a8"))):
        xs = [i + offset for i in range(len(names))]
        ax.bar(xs, [r[key] for r in results], width, label=label,
               color=[colours[1] if r["row"] == CEILING else colours[0] for r in results])
        for x, r in zip(xs, results):
            ax.text(x, r[key], f"{r[key]:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("BLEU")
    ax.set_title("Back-translation on half of Multi30k (the ceiling paler)")
    ax.set_ylim(0, 1.2 * max(max(r["val_bleu"], r["bleu"]) for r in results) or 1)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def training(folder: Path) -> dict:
    """The updates a model trained, the minutes it took (from its last checkpoint), the machines it trained on
    (a resumed run may have moved; from its log) and its val BLEU (from its choice on val)."""
    from nmt_cli.model.checkpoint import load_checkpoint

    state = load_checkpoint(folder / "ckpt" / "checkpoint_last.pt")
    chosen = json.loads((folder / "selection.json").read_text(encoding="utf-8"))
    starts = [json.loads(line) for line in read_lines(folder / "ckpt" / "train.jsonl") if '"start"' in line]
    machines = list(dict.fromkeys(r.get("machine", "not recorded") for r in starts if r.get("event") == "start"))
    return {"updates": state["updates"], "train_minutes": round(state["progress"]["elapsed"] / 60, 1),
            "machines": machines, "val_bleu": round(chosen["val_bleu"], 2)}


def budget_words(minutes: float, updates: int) -> str:
    return " or ".join(([f"{minutes:g} minutes"] if minutes > 0 else []) + ([f"{updates} updates"] if updates > 0
                                                                             else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", type=Path, required=True, help="train, val, test_2016_flickr .SRC/.TGT(.gz)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--arch", default="small")
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes per model (0: no limit)")
    parser.add_argument("--max-updates", type=int, default=0, help="updates per model (0: no limit)")
    parser.add_argument("--backward-minutes", type=float, default=None,
                        help="the backward model's (default: --minutes)")
    parser.add_argument("--backward-updates", type=int, default=None,
                        help="the backward model's (default: --max-updates)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--jobs", type=int, default=0,
                        help="models trained at once (0: one per core, at most the models to train)")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads per step (0: the cores shared among the jobs)")
    parser.add_argument("--bpe-merges", type=int, default=10000)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--seed", type=int, default=1, help="of the split and of the sampling")
    parser.add_argument("--train-flags", default="", help="more nmt train flags, the same for every model")
    parser.add_argument("--nmt", default="nmt", help="the nmt command")
    args = parser.parse_args()
    src, tgt, corpora = args.src, args.tgt, args.out / "corpora"
    start = time.monotonic()
    backward_budget = (args.minutes if args.backward_minutes is None else args.backward_minutes,
                       args.max_updates if args.backward_updates is None else args.backward_updates)
    try:
        if args.minutes <= 0 and args.max_updates <= 0:
            raise NmtError("give --minutes or --max-updates: each model trains for the same budget")
        if backward_budget[0] <= 0 and backward_budget[1] <= 0:
            raise NmtError("--backward-minutes and --backward-updates are both 0: the backward model needs a budget")
        if args.jobs < 0 or args.threads < 0:
            raise NmtError(f"--jobs and --threads must be 0 (automatic) or more (got {args.jobs}, {args.threads})")
        rows = [row.strip() for row in args.rows.split(",") if row.strip()]
        unknown = [row for row in rows if row not in ROWS]
        if unknown or not rows:
            raise NmtError(f"--rows {args.rows!r}: {', '.join(map(repr, unknown)) or 'no row'}; rows are: "
                           f"{', '.join(ROWS)}")
        split(args.raw, corpora, src, tgt, args.seed)
        back_translated = any("BT" in row for row in rows)
        jobs = args.jobs or min(len(os.sched_getaffinity(0)), max(1, len(unfinished(
            rows, args.out, corpora / f"bt.sampled.{src}" if back_translated else None))))
        steps = Steps(args.threads or max(1, len(os.sched_getaffinity(0)) // jobs))

        def back_translate(after: Callable[[str], object]) -> None:
            backward = model(f"{tgt}->{src}", args.out / f"{tgt}{src}", corpora / "parallel", tgt, src, args.raw,
                             args, steps, budget=backward_budget)
            translate(backward, corpora / f"mono.{tgt}", corpora / f"bt.beam.{src}", "back-translate (beam 4)",
                      args, steps, "--beam", "4")
            translate(backward, corpora / f"mono.{tgt}", corpora / f"bt.sampled.{src}", "back-translate (sampling)",
                      args, steps, "--sampling", "--seed", str(args.seed))

        def train_row(row: str) -> Callable[[Callable[[str], object]], dict]:
            def task(after: Callable[[str], object]) -> dict:
                if "BT" in row:
                    after(BACKWARD)
                folder = row_folder(args.out, row)
                prefix = row_corpus(row, corpora, folder, src, tgt)
                forward = model(row, folder, prefix, src, tgt, args.raw, args, steps,
                                (TAG,) if row == "tagged BT" else (), seed=2 if row == SECOND_SEED else 1)
                result = {"row": row, "pairs": len(read_lines(prefix.with_suffix(f".{src}"))), **training(folder),
                          **evaluate(forward, folder, src, tgt, args, steps)}
                print(f"backtranslation: {row}: val BLEU {result['val_bleu']:.1f}; test BLEU {result['bleu']:.1f}, "
                      f"chrF2 {result['chrf']:.1f}", flush=True)
                return result
            return task

        # The backward model first: the back-translated rows wait for it; they come last for that reason.
        order = sorted((row for row in ROWS if row in rows), key=lambda row: "BT" in row)
        tasks = ([(BACKWARD, back_translate)] if back_translated else []) + [(row, train_row(row)) for row in order]
        done = run_at_once(jobs, tasks, steps)
        results = [done[row] for row in ROWS if row in rows]
    except NmtError as e:
        print(f"backtranslation: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    margin = compare(results)
    budget = budget_words(args.minutes, args.max_updates)
    backward_words = budget_words(*backward_budget)
    backward = f", the backward model {backward_words}" if backward_words != budget else ""
    note = (f"Back-translation on Multi30k {src}->{tgt} ({args.raw}): half of the training pairs parallel, the "
            f"other half target-only; {args.arch} models, {budget} of training each{backward}, split and sampling "
            f"seed {args.seed}, chosen on val, scored on test_2016_flickr (sacreBLEU, chrF2); "
            f"{(time.monotonic() - start) / 60:.0f} minutes for this run. {margin}").rstrip()
    with atomic_path(args.out / "backtranslation.json") as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    with atomic_path(args.out / "backtranslation.md") as tmp:
        tmp.write_text(markdown(results, note), encoding="utf-8")
    plot(results, args.out / "backtranslation.png")
    print(markdown(results, note))


if __name__ == "__main__":
    main()
