"""The paper's Table 3 (variations on the Transformer architecture) on a prepared data dir: one model per row,
each changing one thing from a stated base, trained for the same number of updates; dev perplexity and dev
BLEU of each, written as a table shaped like the paper's.

    python recipes/variations.py --data EXP/data --out EXP/variations --base small --updates 3000 \
        [--rows A,B,C,D,E] [--device cpu] [--precision bf16] [--launcher "torchrun ..."] [--train-flags "..."]

Rows, from the base's N, d_model, d_ff, h, d_k, P_drop (for the paper's base they are exactly its rows):
(A) h in {1, h/2, 2h, 4h} at constant h x d_k = d_model; (B) d_k in {d_k/4, d_k/2} with h kept; (C) N in
{N/3, 2N/3, 4N/3}, d_model in {d/2, 2d} (d_k = d_model / h), d_ff in {d_ff/2, 2 d_ff}; (D) P_drop in
{0, P_drop + 0.1}, label smoothing in {0, 0.2}; (E) learned positions instead of sinusoids. As in the paper,
the dev set is the data dir's valid split: no averaging, beam 4, length penalty 0.6, the last checkpoint;
nothing is chosen on test. Rows already trained (`ROW/.done`) are not trained again. Writes OUT/variations.md
(beside the paper's own numbers for the same rows), OUT/variations.json and OUT/variations.png (dev PPL per row).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nmt_cli.errors import NmtError  # noqa: E402
from nmt_cli.model.transformer import PRESETS, ModelConfig  # noqa: E402
from nmt_cli.textio import atomic_path  # noqa: E402

ROW_GROUPS = ("base", "A", "B", "C", "D", "E")
# The paper's Table 3 (newstest2013, base model, 100k steps): (PPL (dev), BLEU (dev), params x 10^6 or None) of
# each row, by group and place in the group; `rows_for` lists the rows in the paper's order.
PAPER = {("base", 0): (4.92, 25.8, 65),
         ("A", 0): (5.29, 24.9, None), ("A", 1): (5.00, 25.5, None), ("A", 2): (4.91, 25.8, None),
         ("A", 3): (5.01, 25.4, None),
         ("B", 0): (5.16, 25.1, 58), ("B", 1): (5.01, 25.4, 60),
         ("C", 0): (6.11, 23.7, 36), ("C", 1): (5.19, 25.3, 50), ("C", 2): (4.88, 25.5, 80),
         ("C", 3): (5.75, 24.5, 28), ("C", 4): (4.66, 26.0, 168), ("C", 5): (5.12, 25.4, 53),
         ("C", 6): (4.75, 26.2, 90),
         ("D", 0): (5.77, 24.6, None), ("D", 1): (4.95, 25.5, None), ("D", 2): (4.67, 25.3, None),
         ("D", 3): (5.47, 25.7, None),
         ("E", 0): (4.92, 25.7, None)}


@dataclass
class Row:
    """One line of the table: its group (A-E or base) and what it changes from the base."""

    group: str
    changes: dict = field(default_factory=dict)  # ModelConfig fields (layers, d_model, ...) and label_smoothing

    @property
    def name(self) -> str:
        if not self.changes:
            return "base"
        return self.group + "-" + "-".join(f"{k}{v}" for k, v in self.changes.items()).replace("_", "")


def rows_for(base: ModelConfig, label_smoothing: float = 0.1) -> list[Row]:
    """Table 3's rows for `base`, each a change of one (or, for A and C's widths, a coupled pair of) setting."""
    n, d, ff, h, dk, p = base.layers, base.d_model, base.ffn, base.heads, base.dk, base.dropout
    rows = [Row("base")]
    for heads in dict.fromkeys((1, h // 2, 2 * h, 4 * h)):
        if heads >= 1 and heads != h and d % heads == 0:
            rows.append(Row("A", {"heads": heads, "head_dim": d // heads}))
    for width in dict.fromkeys((dk // 4, dk // 2)):
        if width >= 1:
            rows.append(Row("B", {"head_dim": width}))
    for layers in dict.fromkeys((max(1, n // 3), max(1, 2 * n // 3), 4 * n // 3)):
        if layers != n:
            rows.append(Row("C", {"layers": layers}))
    for width in (d // 2, 2 * d):
        rows.append(Row("C", {"d_model": width, "head_dim": width // h}))
    for inner in (ff // 2, 2 * ff):
        rows.append(Row("C", {"ffn": inner}))
    for rate in (0.0, round(p + 0.1, 2)):
        rows.append(Row("D", {"dropout": rate}))
    for eps in (0.0, 0.2):
        if eps != label_smoothing:
            rows.append(Row("D", {"label_smoothing": eps}))
    rows.append(Row("E", {"learned_positions": True}))
    return rows


def train_flags(row: Row) -> list[str]:
    flags = []
    for key, value in row.changes.items():
        if key == "learned_positions":
            flags.append("--learned-positions")
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def config_of(base: ModelConfig, row: Row) -> ModelConfig:
    from dataclasses import replace

    return replace(base, **{k: v for k, v in row.changes.items() if k != "label_smoothing"})


def evaluate(row_dir: Path, data: Path, device: str) -> dict:
    """Dev perplexity (the last validation) and dev BLEU (beam 4, lenpen 0.6) of a row's last checkpoint."""
    from nmt_cli.data.binarized import DataDir
    from nmt_cli.decode.score import score
    from nmt_cli.decode.translate import Translator

    records = [json.loads(line) for line in (row_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    valid = [r for r in records if r.get("event") == "valid"]
    if not valid:
        raise NmtError(f"{row_dir / 'train.jsonl'}: no validation recorded")
    d = DataDir.open(data)
    sources = (d.path / f"valid.raw.{d.source_lang}").read_text(encoding="utf-8").splitlines()
    refs = (d.path / f"valid.raw.{d.target_lang}").read_text(encoding="utf-8").splitlines()
    translator = Translator.from_checkpoint(row_dir / "checkpoint_last.pt", device=device, workers=0)
    hyps = translator.translate(sources, beam=4, lenpen=0.6)
    bleu = score(hyps, [refs], ("bleu",), lang=d.target_lang)[0]
    from nmt_cli.model.transformer import count_parameters

    model = translator.ensemble.models[0]
    return {"valid_ppl": valid[-1]["valid_ppl"], "valid_bleu": bleu["score"], "bleu_signature": bleu["signature"],
            "updates": valid[-1]["update"], "parameters": count_parameters(model)}


def markdown(base_name: str, results: list[dict]) -> str:
    """The rows as the paper prints them: a cell is empty where the row keeps the base's value."""
    def values(r: dict) -> dict:
        c = r["config"]
        return {"N": c["layers"], "d_model": c["d_model"], "d_ff": c["ffn"], "h": c["heads"], "d_k": r["dk"],
                "d_v": r["dk"], "P_drop": c["dropout"], "ε_ls": r["label_smoothing"],
                "positions": "learned" if c.get("learned_positions") else "sinusoid"}

    columns = list(values(results[0]))
    base = values(results[0])
    lines = ["| | " + " | ".join(columns) + " | train steps | PPL (dev) | BLEU (dev) | params ×10⁶ | paper: PPL, "
             "BLEU, params |", "|---" * (len(columns) + 6) + "|"]
    for r in results:
        is_base = r["row"]["group"] == "base"
        cells = [str(v) if is_base or v != base[k] else "" for k, v in values(r).items()]
        cells += [str(r["updates"]), f"{r['valid_ppl']:.2f}", f"{r['valid_bleu']:.1f}", f"{r['parameters'] / 1e6:.1f}"]
        paper = PAPER.get((r["row"]["group"], r["row"]["place"]))
        cells.append(f"{paper[0]:.2f}, {paper[1]:.1f}" + (f", {paper[2]}" if paper[2] else "") if paper else "")
        lines.append(f"| {base_name if is_base else r['row']['group']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    """Dev perplexity per row, as a bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["row"]["name"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(names)), 4.0))
    ax.bar(range(len(names)), [r["valid_ppl"] for r in results],
           color=["#555555" if r["row"]["group"] == "base" else "#4c72b0" for r in results])
    ax.axhline(results[0]["valid_ppl"], color="#555555", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("PPL (dev)")
    ax.set_title("Table 3 variations: dev perplexity per row (dashed: the base)")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base", default="small", choices=sorted(PRESETS))
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--rows", default="A,B,C,D,E", help="groups to train besides the base, e.g. A,E")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--launcher", default="", help="runs `-m nmt_cli train ...`: e.g. torchrun --standalone "
                        "--nproc_per_node 8 (default: this Python)")
    parser.add_argument("--nmt", default="", help="the nmt command, without --launcher (default: this Python's "
                        "-m nmt_cli)")
    parser.add_argument("--train-flags", default="", help="more nmt train flags, the same for every row")
    args = parser.parse_args()
    try:
        groups = {g.strip() for g in args.rows.split(",") if g.strip()} | {"base"}
        unknown = groups - set(ROW_GROUPS)
        if unknown:
            raise NmtError(f"--rows: unknown group(s) {', '.join(sorted(unknown))} (choose from A, B, C, D, E)")
        if args.updates < 1:
            raise NmtError(f"--updates must be at least 1 (got {args.updates})")
        if not (args.data / "meta.json").is_file():
            raise NmtError(f"{args.data}: not a data dir (no meta.json); run nmt prepare first")
        vocab = len((args.data / "vocab.txt").read_text(encoding="utf-8").splitlines())
        base = ModelConfig(vocab_size=vocab, **PRESETS[args.base])
        extra = shlex.split(args.train_flags)
        results = []
        rows = rows_for(base)
        places = {id(r): [x for x in rows if x.group == r.group].index(r) for r in rows}
        for row in (r for r in rows if r.group in groups):
            row_dir = args.out / row.name
            if not (row_dir / ".done").exists():
                if args.launcher:  # torchrun takes `-m nmt_cli` too
                    nmt = [*shlex.split(args.launcher), "-m", "nmt_cli"]
                else:
                    nmt = shlex.split(args.nmt) or [sys.executable, "-m", "nmt_cli"]
                command = [*nmt, "train", str(args.data), "--save-dir",
                           str(row_dir), "--arch", args.base, "--max-updates", str(args.updates), "--seed", "1",
                           "--device", args.device, "--precision", args.precision, "--keep-last", "1", "--quiet",
                           *train_flags(row), *extra]
                print(f"variations: {row.name}: {' '.join(command)}", flush=True)
                if subprocess.run(command).returncode != 0:
                    raise NmtError(f"{row.name}: nmt train failed (its output is above)")
                (row_dir / ".done").touch()
            config = config_of(base, row)
            result = {"row": {"group": row.group, "place": places[id(row)], "name": row.name, "changes": row.changes},
                      "config": {k: v for k, v in config.to_dict().items() if k != "vocab_size"}, "dk": config.dk,
                      "label_smoothing": row.changes.get("label_smoothing", 0.1),
                      **evaluate(row_dir, args.data, args.device)}
            print(f"variations: {row.name}: dev PPL {result['valid_ppl']:.2f}, dev BLEU {result['valid_bleu']:.1f}, "
                  f"{result['parameters'] / 1e6:.1f}M parameters", flush=True)
            results.append(result)
    except NmtError as e:
        print(f"variations: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    table = markdown(args.base, results)
    note = (f"Table 3 of the paper on {args.data} ({args.base} base, {args.updates} updates each, seed 1; dev = the "
            f"data dir's valid split, beam 4, lenpen 0.6, last checkpoint, no averaging; per-piece perplexity; "
            f"every row trained with `{' '.join(extra) or 'the defaults'}`). "
            "Empty cells keep the base's value; the last column is the paper's Table 3 for the same row (its base "
            "model on WMT14 newstest2013, 100k steps).\n\n")
    with atomic_path(args.out / "variations.json") as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    with atomic_path(args.out / "variations.md") as tmp:
        tmp.write_text(note + table, encoding="utf-8")
    plot(results, args.out / "variations.png")
    print(note + table)


if __name__ == "__main__":
    main()
