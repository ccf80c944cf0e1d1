"""What each part of the choice on val is worth, for one finished run: one row per way of choosing.

Each row gives select_on_val.py a different set of candidates (the recipe's own set; without the moving
average; one model alone: the moving average, the last checkpoint, the best single, the average of the last N)
or a fixed length-penalty grid, lets it choose on val exactly as the recipe does, and scores that choice on
test: sacreBLEU, chrF2 and the multimodal-MT literature's lowercased tokenized BLEU (`lc-bleu`). The choice
never sees test; test is read only to report the rows. Every translation is made once and shared by the rows.
A last row makes no choice: the multimodal-MT literature's fixed protocol (`--fixed`: the average of the last
10 epoch checkpoints, beam 5, length penalty 1.0), scored on val and test alike.

    python recipes/selection_levers.py --ckpt-dir EXP/ckpt --data EXP/data --windows 3,5,8,10 \
        --lenpens 0.6,1.0,1.4,2.0 --record EXP/levers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from select_on_val import MOVING_AVERAGE, candidates, choose, numbers, read_pairs

from nmt_cli.decode.score import LOWERCASE_TOKENIZED, score
from nmt_cli.decode.translate import Translator
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import numbered_checkpoints
from nmt_cli.textio import atomic_path

# Wu et al. 2021's evaluation of their text-only Transformer-Tiny on Multi30k (41.02 on test_2016_flickr): the
# average of the last 10 epoch checkpoints, fairseq's default beam 5 and length penalty 1.0.
LITERATURE_FIXED = (10, 5, 1.0)


def rows_of(names: list[str], windows: list[int]) -> list[tuple[str, list[str], bool]]:
    """The ways of choosing, as (label, candidate names, widen the grid); the first is the recipe's."""
    recipe = [n for n in names if n != "average of last 1" or 1 in windows]
    rows = [("recipe: all candidates, grid widened", recipe, True),
            ("recipe's candidates, fixed grid", recipe, False)]
    if MOVING_AVERAGE in recipe:
        rows.append(("without the moving average", [n for n in recipe if n != MOVING_AVERAGE], True))
    rows += [(f"{name} alone", [name], True) for name in names]
    return rows


def levers(ckpt_dir: Path, data: Path, windows: list[int], lenpens: list[float], beam: int, record: Path,
           precision: str = "fp32", widen: int = 4,
           fixed: tuple[int, int, float] | None = LITERATURE_FIXED) -> list[dict]:
    """Choose on val in each way of `rows_of`, score each choice on test, then add the `fixed` (window, beam,
    length penalty) row where the run saved that many checkpoints; write the rows to `record` (JSON) and return
    them."""
    meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
    src, tgt = meta["source_lang"], meta["target_lang"]
    sets = {split: read_pairs(data / f"{split}.raw.{src}", data / f"{split}.raw.{tgt}") for split in ("valid", "test")}
    hyps: dict[tuple[str, float, str, int], list[str]] = {}
    scored: dict[tuple[str, float, str, int], dict[str, float]] = {}
    rows = []
    with tempfile.TemporaryDirectory(dir=record.parent) as tmp:
        paths = dict(candidates(ckpt_dir, sorted({1, *windows}), True, Path(tmp)))
        translators: dict[str, Translator] = {}

        def translate(name: str, lenpen: float, split: str, size: int) -> list[str]:
            if (name, lenpen, split, size) not in hyps:
                if name not in translators:
                    translators[name] = Translator.from_checkpoint(paths[name], precision=precision, workers=0)
                hyps[name, lenpen, split, size] = translators[name].translate(sets[split][0], beam=size,
                                                                              lenpen=lenpen)
            return hyps[name, lenpen, split, size]

        def metrics(name: str, lenpen: float, split: str, size: int = beam) -> dict[str, float]:
            if (name, lenpen, split, size) not in scored:
                results = score(translate(name, lenpen, split, size), [sets[split][1]],
                                metrics=("bleu", "chrf", LOWERCASE_TOKENIZED), lang=tgt)
                scored[name, lenpen, split, size] = {r["metric"]: r["score"] for r in results}
            return scored[name, lenpen, split, size]

        for label, names, widened in rows_of(list(paths), windows):
            pick, scores = choose(names, lenpens, widen if widened else 0,
                                  lambda name, lenpen: metrics(name, lenpen, "valid")["bleu"])
            test = metrics(pick["model"], pick["lenpen"], "test")
            rows.append({"row": label, "model": pick["model"], "lenpen": pick["lenpen"], "val_bleu": pick["bleu"],
                         "val_lc_bleu": metrics(pick["model"], pick["lenpen"], "valid")[LOWERCASE_TOKENIZED],
                         "test_bleu": test["bleu"], "test_chrf": test["chrf"],
                         "test_lc_bleu": test[LOWERCASE_TOKENIZED], "lenpens_tried": len(scores) - len(names) + 1})
        if fixed is not None:
            window, size, lenpen = fixed
            name = f"average of last {window}"
            if name not in paths and len(numbered_checkpoints(ckpt_dir)) >= window:
                paths.update((n, path) for n, path in candidates(ckpt_dir, [window], False, Path(tmp)) if n == name)
            if name in paths:
                val, test = metrics(name, lenpen, "valid", size), metrics(name, lenpen, "test", size)
                rows.append({"row": f"fixed, not chosen on val: beam {size}", "model": name, "lenpen": lenpen,
                             "val_bleu": val["bleu"], "val_lc_bleu": val[LOWERCASE_TOKENIZED],
                             "test_bleu": test["bleu"], "test_chrf": test["chrf"],
                             "test_lc_bleu": test[LOWERCASE_TOKENIZED], "lenpens_tried": 0})
    record.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(record) as staged:
        staged.write_text(json.dumps({"ckpt_dir": str(ckpt_dir), "beam": beam, "rows": rows}, indent=2) + "\n")
    return rows


def fixed_choice(text: str) -> tuple[int, int, float]:
    """`--fixed WINDOW,BEAM,LENPEN` as numbers; a clear error otherwise."""
    parts = text.split(",")
    try:
        window, size, lenpen = int(parts[0]), int(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise NmtError(f"--fixed: expected WINDOW,BEAM,LENPEN such as 10,5,1.0 (got {text!r})") from None
    if len(parts) != 3 or window < 1 or size < 1 or lenpen < 0:
        raise NmtError(f"--fixed: expected WINDOW,BEAM,LENPEN with WINDOW and BEAM at least 1, LENPEN at least 0 "
                       f"(got {text!r})")
    return window, size, lenpen


def show(rows: list[dict]) -> None:
    """The rows as a table on stdout."""
    table = Table(title="the choice on val, scored on test")
    for column in ("way of choosing", "chosen", "lenpen", "val BLEU", "val lc-bleu", "test BLEU", "test chrF2",
                   "test lc-bleu"):
        table.add_column(column, justify="left" if column in ("way of choosing", "chosen") else "right")
    for r in rows:
        table.add_row(r["row"], r["model"], f"{r['lenpen']:g}", f"{r['val_bleu']:.2f}", f"{r['val_lc_bleu']:.2f}",
                      f"{r['test_bleu']:.2f}", f"{r['test_chrf']:.2f}", f"{r['test_lc_bleu']:.2f}")
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the run's data dir (valid/test .raw files)")
    parser.add_argument("--windows", default="3,5,8,10", help="the recipe's averaging windows")
    parser.add_argument("--lenpens", default="0.6,1.0,1.4,2.0", help="length penalties; the first picks the model")
    parser.add_argument("--widen", type=int, default=4)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--fixed", default="10,5,1.0",
                        help="a row chosen without val: WINDOW,BEAM,LENPEN ('none': no such row)")
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()
    try:
        if not (args.data / "meta.json").is_file():
            raise NmtError(f"{args.data}: no meta.json (not a data dir written by nmt prepare)")
        fixed = None if args.fixed == "none" else fixed_choice(args.fixed)
        rows = levers(args.ckpt_dir, args.data, numbers(args.windows, int), numbers(args.lenpens, float), args.beam,
                      args.record, args.precision, args.widen, fixed)
    except NmtError as e:
        print(f"selection_levers: {e}", file=sys.stderr)
        sys.exit(2)
    show(rows)


if __name__ == "__main__":
    main()
