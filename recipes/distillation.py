"""Sequence-level knowledge distillation (Kim & Rush, 2016) into a small, fast student (`make multi30k-distill`).

    python recipes/distillation.py --raw EXP/raw --teacher EXP/model.pt --out EXP/distill [--src en] [--tgt de]
        [--student tiny] [--minutes 10] [--max-updates 0] [--bpe-merges 10000] [--train-flags "..."]

The teacher (`make multi30k`'s model, or any checkpoint of the pair) translates the training sources with its
own search settings (the beam and length penalty its model file carries) into distilled targets. Two students
of the `--student` preset train for the same minutes (or updates) with seed 1, one on the real targets, one on
the distilled ones, each with BPE learned on its own training pairs, chosen on val (recipes/select_on_val.py)
and scored on test_2016_flickr (sacreBLEU, chrF2). For each of teacher and students the table gives the
parameters and the sentences per second of translating the test set (batch 64, beam 4, in-process after a
warm-up batch) through nmt (bf16 where the CPU multiplies it, else fp32) and through CTranslate2 int8 after
`nmt export ctranslate2 --quantization int8`. Every step is skipped when its output exists. Writes
OUT/distillation.md and .json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backtranslation import Steps, evaluate, model, raw_file, translate, write_lines  # noqa: E402

from nmt_cli.errors import NmtError  # noqa: E402
from nmt_cli.textio import atomic_path, read_lines  # noqa: E402

# A teacher whose vocabulary leaves more of the data's pieces unknown than this was trained on other data.
MAX_UNKNOWN_SHARE = 0.05


def check_teacher(teacher: Path, src: str, tgt: str, sources: list[str], targets: list[str],
                  sample: int = 1000) -> None:
    """One-line NmtError for a teacher of another language pair, or whose vocabulary does not cover the data:
    more than MAX_UNKNOWN_SHARE of the pieces of the first `sample` training pairs (either side, as the
    teacher's own tokenizer segments them) unknown to it, or (SentencePiece) spelled in byte pieces."""
    from nmt_cli.model.checkpoint import load_checkpoint, require_keys
    from nmt_cli.text.segment import segmenter_of
    from nmt_cli.text.vocab import Vocabulary

    state = require_keys(load_checkpoint(teacher), teacher)
    pair = (state["source_lang"], state["target_lang"])
    if pair != (src, tgt):
        raise NmtError(f"{teacher}: the teacher translates {pair[0]}->{pair[1]}, the data is {src}->{tgt} "
                       "(give TEACHER= a model of this pair, or SRC= and TGT=)")
    segmenter, vocab = segmenter_of(state, teacher), Vocabulary(state["vocab"])
    for side, lang, lines in (("source", src, sources), ("target", tgt, targets)):
        pieces = [p for line in lines[:sample] for p in segmenter.segment(line, lang).split()]
        unknown = sum(p not in vocab.index or (p.startswith("<0x") and p.endswith(">")) for p in pieces)
        if pieces and unknown / len(pieces) > MAX_UNKNOWN_SHARE:
            raise NmtError(f"{teacher}: its vocabulary does not cover the training {side}s ({lang}): "
                           f"{unknown / len(pieces):.0%} of their pieces unknown on the first "
                           f"{min(sample, len(lines)):,} lines (at most {MAX_UNKNOWN_SHARE:.0%}); a teacher "
                           "trained on other data?")


def speeds(model_path: Path, folder: Path, sources: list[str], nmt: list[str], steps: Steps) -> dict:
    """Parameters, and test sentences/s through nmt (bf16 where the CPU has it) and CTranslate2 int8; kept in
    FOLDER/speed.json, which a second run reads back while the model file and the machine's kind are the ones
    measured."""
    from nmt_cli.hardware import cpu_has_bf16, cpu_kind

    record = folder / "speed.json"
    measured = {"model": str(model_path), "model_mtime_ns": model_path.stat().st_mtime_ns, "sentences": len(sources),
                "machine": cpu_kind()}
    if record.exists():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if all(saved.get(k) == v for k, v in measured.items()):
            return {k: v for k, v in saved.items() if k not in measured}
    from nmt_cli.decode.translate import Translator
    from nmt_cli.export.ct2 import CTranslate2Translator
    from nmt_cli.model.transformer import count_parameters

    precision = "bf16" if cpu_has_bf16() else "fp32"
    translator = Translator.from_checkpoint(model_path, precision=precision)
    parameters = count_parameters(translator.ensemble.models[0])
    exported = folder / "ct2-int8"
    if not (exported / "model.bin").exists():
        steps.run([*nmt, "export", "ctranslate2", "-m", model_path, "-o", exported, "--quantization", "int8",
                   "--force"], f"{folder.name}: export")
    out = {"parameters": parameters, "nmt_precision": precision}
    for name, engine in (("nmt", translator), ("ct2_int8", CTranslate2Translator.from_dir(exported))):
        engine.translate(sources[:8], beam=4)  # warm-up
        start = time.perf_counter()
        engine.translate(sources, beam=4, batch_size=64)
        out[f"{name}_sent_per_s"] = round(len(sources) / (time.perf_counter() - start), 1)
    with atomic_path(record) as tmp:
        tmp.write_text(json.dumps({**measured, **out}, indent=2) + "\n", encoding="utf-8")
    return out


def markdown(rows: list[dict], note: str) -> str:
    lines = [note, "", "| model | trained on | BLEU | chrF2 | parameters | sent/s nmt | sent/s CTranslate2 int8 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['data']} | {r['bleu']:.1f} | {r['chrf']:.1f} | {r['parameters'] / 1e6:.1f}M "
                     f"| {r['nmt_sent_per_s']:.1f} ({r['nmt_precision']}) | {r['ct2_int8_sent_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", type=Path, required=True, help="train, val, test_2016_flickr .SRC/.TGT(.gz)")
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--student", default="tiny", help="the students' preset")
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes per student (0: no limit)")
    parser.add_argument("--max-updates", type=int, default=0, help="updates per student (0: no limit)")
    parser.add_argument("--bpe-merges", type=int, default=10000)
    parser.add_argument("--precision", default="auto", help="of the students' training")
    parser.add_argument("--train-flags", default="", help="more nmt train flags, the same for both students")
    parser.add_argument("--nmt", default="nmt", help="the nmt command")
    args = parser.parse_args()
    args.arch = args.student  # what `backtranslation.model` trains
    src, tgt, nmt = args.src, args.tgt, shlex.split(args.nmt)
    steps = Steps()  # one step at a time, on torch's default threads
    start = time.monotonic()
    try:
        if args.minutes <= 0 and args.max_updates <= 0:
            raise NmtError("give --minutes or --max-updates: each student trains for the same budget")
        if not args.teacher.is_file():
            raise NmtError(f"{args.teacher}: no such teacher model (run `make multi30k`, or give TEACHER=)")
        raw_train = raw_file(args.raw, f"train.{src}")
        check_teacher(args.teacher, src, tgt, read_lines(raw_train), read_lines(raw_file(args.raw, f"train.{tgt}")))
        corpora = args.out / "corpora"
        if not (corpora / f"distilled.{src}").exists():
            write_lines(corpora / f"sources.{src}", read_lines(raw_train))
            translate(args.teacher, corpora / f"sources.{src}", corpora / f"distilled.{tgt}", "teacher translates "
                      "the training sources (its own beam and length penalty)", args, steps)
            (corpora / f"sources.{src}").rename(corpora / f"distilled.{src}")  # the pair is complete
        rows = []
        teacher_dir = args.out / "teacher"
        teacher_dir.mkdir(parents=True, exist_ok=True)
        test = args.out / "teacher" / "data"
        for side in (src, tgt):
            write_lines(test / f"test.raw.{side}", read_lines(raw_file(args.raw, f"test_2016_flickr.{side}")))
        sources = read_lines(test / f"test.raw.{src}")
        rows.append({"model": "teacher", "data": "real targets",
                     **evaluate(args.teacher, teacher_dir, src, tgt, args, steps),
                     **speeds(args.teacher, teacher_dir, sources, nmt, steps)})
        for name, prefix in (("real", args.raw / "train"), ("distilled", corpora / "distilled")):
            folder = args.out / f"student-{name}"
            student = model(f"student ({name} targets)", folder, prefix, src, tgt, args.raw, args, steps)
            rows.append({"model": f"student ({args.student})", "data": f"{name} targets",
                         **evaluate(student, folder, src, tgt, args, steps),
                         **speeds(student, folder, sources, nmt, steps)})
    except NmtError as e:
        print(f"distillation: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from nmt_cli.hardware import cpu_kind

    budget = " or ".join(x for x in ((f"{args.minutes:g} minutes" if args.minutes > 0 else ""),
                                     (f"{args.max_updates} updates" if args.max_updates > 0 else "")) if x)
    note = (f"Sequence-level distillation on Multi30k {src}->{tgt}: teacher {args.teacher}; `{args.student}` students, "
            f"{budget} of training each, seed 1, chosen on val, scored on test_2016_flickr (sacreBLEU, chrF2); "
            f"speed on the {len(sources):,} test sentences, batch 64, beam 4, {cpu_kind()}; "
            f"{(time.monotonic() - start) / 60:.0f} minutes for this run.")
    with atomic_path(args.out / "distillation.json") as tmp:
        tmp.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    with atomic_path(args.out / "distillation.md") as tmp:
        tmp.write_text(markdown(rows, note), encoding="utf-8")
    print(markdown(rows, note))


if __name__ == "__main__":
    main()
