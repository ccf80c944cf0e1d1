"""Choose, on the validation set only, the model and length penalty a recipe ships.

Candidates: the best single checkpoint (by validation loss), the average of the last N numbered
checkpoints for each N of --windows (those with more checkpoints than saved are left out), and the moving
average of the weights (`nmt train --ema`) of the last numbered checkpoint, where the run kept one (unless
--no-ema: what the choice would be without it, the same training). Each is scored
by sacreBLEU of its beam search on val (against lowercased references for a model that translates into lowercased
text) at the first length penalty of --lenpens; the winner is then scored
at the other length penalties, and where the best of those lies at the edge of the grid (its largest, or its
smallest above 0), the grid is widened by its own outer step until the best lies inside (at most --widen more).
Ties keep the earlier candidate. Writes the chosen model to --out (atomically)
and every score to --record (JSON), and prints one line per candidate.

    python recipes/select_on_val.py --ckpt-dir EXP/ckpt --src valid.raw.en --ref valid.raw.de \
        --windows 3,5,8,10 --lenpens 0.6,1.0,1.4,2.0 --beam 4 --out EXP/model.pt --record EXP/selection.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from nmt_cli.decode.score import score
from nmt_cli.decode.translate import Translator
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import (
    average_checkpoints,
    load_checkpoint,
    model_only,
    numbered_checkpoints,
    save_checkpoint,
    with_decoding,
)
from nmt_cli.textio import atomic_path, read_lines

MOVING_AVERAGE = "moving average (--ema)"


def numbers(text: str, kind: type) -> list:
    """A comma- or space-separated list, e.g. "3,5,8"."""
    return [kind(x) for x in text.replace(",", " ").split()]


def next_lenpen(tried: dict[float, float]) -> float | None:
    """The length penalty to try next, given the val BLEU of each tried so far (in the order tried; ties keep
    the earlier): one outer step beyond the grid's edge where the best lies on it, else None."""
    if len(tried) < 2:
        return None
    best = max(tried, key=lambda lenpen: tried[lenpen])
    grid = sorted(tried)
    if best == grid[-1]:
        return round(grid[-1] + (grid[-1] - grid[-2]), 4)
    if best == grid[0] and grid[0] > 0:
        return max(0.0, round(grid[0] - (grid[1] - grid[0]), 4))
    return None


def candidates(ckpt_dir: Path, windows: list[int], ema: bool, tmp: Path) -> list[tuple[str, Path]]:
    """The models to choose among, as (name, path): the best single checkpoint, the average of the last N
    numbered checkpoints for each N of `windows` that the run saved, and the moving average of the last one where
    the run kept one and `ema` asks for it; the averages are written into `tmp`."""
    best = ckpt_dir / "checkpoint_best.pt"
    numbered = numbered_checkpoints(ckpt_dir)
    if not best.exists() and not numbered:
        raise NmtError(f"{ckpt_dir}: no checkpoints to choose from")
    found = [("best single", best)] if best.exists() else []
    for n in windows:
        if n <= len(numbered):
            path = tmp / f"last{n}.pt"
            save_checkpoint(average_checkpoints(numbered[-n:]), path)
            found.append((f"average of last {n}", path))
    if ema and numbered and load_checkpoint(numbered[-1]).get("ema"):
        path = tmp / "ema.pt"
        save_checkpoint(average_checkpoints(numbered[-1:], ema=True), path)
        found.append((MOVING_AVERAGE, path))
    if not found:
        raise NmtError(f"{ckpt_dir}: no checkpoint_best.pt and fewer numbered checkpoints than --windows asks")
    return found


def choose(names: list[str], lenpens: list[float], widen: int, bleu: Callable[[str, float], float],
           report: Callable[[dict], None] = lambda score: None) -> tuple[dict, list[dict]]:
    """The model (by name) and length penalty val prefers, and every score taken: each model at the first length
    penalty, then the winner at the others, the grid widened outward (at most `widen` more) while its best lies
    on the edge. `bleu(name, lenpen)` scores on val; ties keep the earlier model or penalty."""
    if not lenpens:
        raise NmtError("--lenpens: give at least one length penalty")
    scores: list[dict] = []

    def take(name: str, lenpen: float) -> float:
        scores.append({"model": name, "lenpen": lenpen, "bleu": bleu(name, lenpen)})
        report(scores[-1])
        return scores[-1]["bleu"]

    for name in names:
        take(name, lenpens[0])
    name = names[max(range(len(names)), key=lambda i: (scores[i]["bleu"], -i))]
    tried = {lenpens[0]: scores[names.index(name)]["bleu"]}
    queue = list(lenpens[1:])
    while queue:
        lenpen = queue.pop(0)
        tried[lenpen] = take(name, lenpen)
        further = next_lenpen(tried) if not queue and widen > 0 else None
        if further is not None and further not in tried:
            widen -= 1
            queue.append(further)
    pick = max((s for s in scores if s["model"] == name), key=lambda s: s["bleu"])
    return pick, scores


def val_bleu(path: Path, sources: list[str], refs: list[str], beam: int, lenpen: float, precision: str) -> float:
    """sacreBLEU of the model's beam search on val, run as `nmt translate` runs it; against lowercased references
    for a model that translates into lowercased text (`nmt prepare --lowercase`)."""
    translator = Translator.from_checkpoint(path, precision=precision, workers=0)
    hyps = translator.translate(sources, beam=beam, lenpen=lenpen)
    if translator.segmenter.lowercase:
        refs = [ref.lower() for ref in refs]
    return score(hyps, [refs], metrics=("bleu",), lang=translator.target_lang)[0]["score"]


def read_pairs(src: Path, ref: Path) -> tuple[list[str], list[str]]:
    """The source and reference lines of a set, one line when their counts differ."""
    sources, refs = read_lines(src), read_lines(ref)
    if len(sources) != len(refs):
        raise NmtError(f"{src} has {len(sources)} lines but {ref} has {len(refs)}")
    return sources, refs


def select(ckpt_dir: Path, src: Path, ref: Path, windows: list[int], lenpens: list[float], beam: int,
           out: Path, record: Path, precision: str = "fp32", widen: int = 4, ema: bool = True) -> dict:
    """Score the candidates on val, write the chosen model to `out` and the scores to `record`; return the record."""
    if not lenpens:
        raise NmtError("--lenpens: give at least one length penalty")
    sources, refs = read_pairs(src, ref)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        paths = dict(candidates(ckpt_dir, windows, ema, Path(tmp)))
        pick, scores = choose(
            list(paths), lenpens, widen,
            lambda name, lenpen: val_bleu(paths[name], sources, refs, beam, lenpen, precision),
            lambda s: print(f"val BLEU {s['bleu']:6.2f}  {s['model']}, lenpen {s['lenpen']}", flush=True))
        name = pick["model"]
        result = {"model": name, "lenpen": pick["lenpen"], "val_bleu": pick["bleu"], "candidates": scores}
        with atomic_path(record) as staged:
            staged.write_text(json.dumps(result, indent=2) + "\n")
        # The model last: make takes its presence as "this step is done".
        # Without the optimizer state (a third the size), with the settings chosen here, which translate, serve
        # and the exports then use unless told otherwise.
        chosen = f"chosen on val: BLEU {pick['bleu']:.2f}"
        save_checkpoint(with_decoding(model_only(load_checkpoint(paths[name])), beam, pick["lenpen"], chosen), out)
    print(f"chosen on val: {name}, lenpen {pick['lenpen']} (val BLEU {pick['bleu']:.2f})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--windows", default="3,5,8,10", help="average the last N checkpoints, for each N")
    parser.add_argument("--lenpens", default="0.6,1.0,1.4,2.0", help="length penalties; the first picks the model")
    parser.add_argument("--widen", type=int, default=4,
                        help="length penalties tried beyond the grid at most, while the best is on its edge")
    parser.add_argument("--no-ema", dest="ema", action="store_false",
                        help="leave the moving average of the weights out of the candidates")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()
    try:
        select(args.ckpt_dir, args.src, args.ref, numbers(args.windows, int), numbers(args.lenpens, float), args.beam,
               args.out, args.record, args.precision, args.widen, args.ema)
    except NmtError as e:
        print(f"select_on_val: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
