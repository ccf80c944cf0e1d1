"""Issue 25's measurement before an option: do separate source/target vocabularies help zh<->en?

    python benchmarks/separate_vocab.py --raw exp/tatoeba/raw -s zh -t en --vocab-sizes 4000,4000 \
        --minutes 20 --work /tmp/sepvocab [--joint EXP/tatoeba/zh-en-sentencepiece]

`make tatoeba-zh-en` learns one SentencePiece model on both sides (8,000 pieces). Here each side gets its own
model, learned on that side only (`--vocab-sizes SRC,TGT`), and the data dir's dictionary is the union of the
pieces the two produce on the training text (fairseq's --joined-dictionary over separate BPE; Chinese and
English pieces barely overlap, so each side's embeddings are in effect its own; a byte piece never seen in
training is <unk>). Everything else is the
recipe's: the split under --raw (the recipe's `EXP/raw`), `nmt train` with its flags and time budget, the
choice on valid (best single or average of the last 3/5/8/10, then the length penalty), test scored with the
target language's tokenizer. Prints one table row per run, and the recipe's joint run beside it (--joint: its
EXP dir, whose selection.json and score.json it reads).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import REPO, machine, print_table

sys.path.insert(0, str(REPO))

from nmt_cli.data.prepare import PrepareOptions, binarize_segmented  # noqa: E402
from nmt_cli.text.segment import Segmenter, SentencePiece, train_sentencepiece  # noqa: E402

RECIPE_TRAIN_FLAGS = ["--arch", "small", "--precision", "bf16", "--max-tokens", "4096", "--lr-scale", "0.5",
                      "--warmup", "1000", "--cooldown", "0.3", "--attention-dropout", "0.1",
                      "--activation-dropout", "0.1", "--keep-last", "10", "--seed", "1", "--device", "cpu"]
SPLITS = ("train", "valid", "test")


class PerLanguageSentencePiece(Segmenter):
    """One SentencePiece model per language: the source side's pieces from its model, the target's from its own."""

    name = "sentencepiece"

    def __init__(self, models: dict[str, bytes]) -> None:
        super().__init__(False)
        self.models = {lang: SentencePiece(model) for lang, model in models.items()}

    def _segment(self, line: str, lang: str) -> str:
        return self.models[lang].segment(line, lang)

    def desegment(self, pieces: str, lang: str) -> str:
        return self.models[lang].desegment(pieces, lang)

    def surface(self, piece: str) -> str:
        return next(iter(self.models.values())).surface(piece)


def build_data(raw: Path, src: str, tgt: str, sizes: tuple[int, int], work: Path) -> PerLanguageSentencePiece:
    """One SentencePiece model per side, the splits segmented with them, and a data dir at work/data."""
    models = {}
    for lang, size in zip((src, tgt), sizes):
        path = work / f"spm.{lang}.model"
        if not path.exists():
            path.write_bytes(train_sentencepiece([raw / f"train.{lang}"], size))
        models[lang] = path.read_bytes()
    segmenter = PerLanguageSentencePiece(models)
    if not (work / "data" / "meta.json").exists():
        pieces = work / "pieces"
        pieces.mkdir(exist_ok=True)
        for split in SPLITS:
            for lang in (src, tgt):
                lines = (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
                (pieces / f"{split}.{lang}").write_text("".join(segmenter.segment(x, lang) + "\n" for x in lines),
                                                        encoding="utf-8")
        binarize_segmented(PrepareOptions(src, tgt, str(pieces / "train"), str(pieces / "valid"), work / "data",
                                          test=[str(pieces / "test")], force=True, quiet=True, workers=1), "")
    return segmenter


def train(work: Path, minutes: float) -> None:
    """`nmt train` with the recipe's flags (resumes, like the recipe, when interrupted)."""
    if (work / "ckpt" / ".done").exists():
        return
    subprocess.run([sys.executable, "-m", "nmt_cli", "train", str(work / "data"), "--save-dir", str(work / "ckpt"),
                    "--max-time", str(minutes), *RECIPE_TRAIN_FLAGS], check=True)
    (work / "ckpt" / ".done").touch()


def choose_and_score(raw: Path, src: str, tgt: str, work: Path, segmenter: Segmenter) -> dict:
    """The recipe's choice on valid, then test BLEU/chrF of the chosen model, through `segmenter`."""
    import nmt_cli.decode.translate as translate_module

    translate_module.segmenter_of = lambda state, path: segmenter  # the checkpoint records no SentencePiece model
    sys.path.insert(0, str(REPO / "recipes"))
    from select_on_val import select

    from nmt_cli.decode.score import score

    record = select(work / "ckpt", raw / f"valid.{src}", raw / f"valid.{tgt}", [3, 5, 8, 10], [0.6, 1.0, 1.4], 4,
                    work / "model.pt", work / "selection.json")
    translator = translate_module.Translator.from_checkpoint(work / "model.pt", workers=0)
    hyps = translator.translate((raw / f"test.{src}").read_text(encoding="utf-8").splitlines(), beam=4,
                                lenpen=record["lenpen"])
    refs = (raw / f"test.{tgt}").read_text(encoding="utf-8").splitlines()
    bleu, chrf = score(hyps, [refs], metrics=("bleu", "chrf"), lang=tgt)
    result = {**record, "test_bleu": bleu["score"], "test_chrf": chrf["score"]}
    (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def row(label: str, data: Path, ckpt: Path, result: dict) -> list[str]:
    meta = json.loads((data / "meta.json").read_text())
    train_split = meta["splits"]["train"]
    langs = [meta["source_lang"], meta["target_lang"]]
    end = [json.loads(x) for x in (ckpt / "train.jsonl").read_text().splitlines() if '"end"' in x][-1]
    return [label, f"{meta['vocab_size']:,}", " / ".join(f"{train_split[x]['tokens']:,}" for x in langs),
            f"{end['updates']:,}", f"{end['best']:.3f}", f"{result['model']}, lenpen {result['lenpen']}",
            f"{result['val_bleu']:.2f}", f"{result['test_bleu']:.2f}", f"{result['test_chrf']:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", type=Path, required=True, help="the recipe's split: EXP/raw (train/valid/test)")
    parser.add_argument("-s", "--source-lang", default="zh")
    parser.add_argument("-t", "--target-lang", default="en")
    parser.add_argument("--vocab-sizes", default="4000,4000", help="SentencePiece pieces: SOURCE,TARGET")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--joint", type=Path, help="the recipe's EXP dir of the same direction, for its row")
    args = parser.parse_args()
    src, tgt = args.source_lang, args.target_lang
    missing = [str(args.raw / f"{split}.{lang}") for split in SPLITS for lang in (src, tgt)
               if not (args.raw / f"{split}.{lang}").is_file()]
    if missing:
        sys.exit(f"separate_vocab: {missing[0]}: no such file (--raw is the recipe's EXP/raw split)")
    try:
        sizes = tuple(int(x) for x in args.vocab_sizes.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 2 or min(sizes) < 1:
        sys.exit(f"separate_vocab: --vocab-sizes must be SOURCE,TARGET, e.g. 4000,4000 (got {args.vocab_sizes!r})")
    args.work.mkdir(parents=True, exist_ok=True)
    segmenter = build_data(args.raw, src, tgt, sizes, args.work)
    train(args.work, args.minutes)
    result = choose_and_score(args.raw, src, tgt, args.work, segmenter)
    rows = []
    if args.joint is not None:
        joint = json.loads((args.joint / "selection.json").read_text())
        scores = {x["metric"]: x["score"] for x in json.loads((args.joint / "score.json").read_text())}
        joint["test_bleu"], joint["test_chrf"] = scores["bleu"], scores["chrf"]
        rows.append(row("joint (the recipe)", args.joint / "data", args.joint / "ckpt", joint))
    rows.append(row(f"separate {sizes[0]:,} + {sizes[1]:,}", args.work / "data", args.work / "ckpt", result))
    columns = ["vocabulary", "dictionary", f"train pieces {src} / {tgt}", "updates", "best valid loss",
               "chosen on valid", "val BLEU", "test BLEU", "test chrF"]
    print_table(f"{src}->{tgt}, {args.minutes:g} min, {machine()}", columns, rows)


if __name__ == "__main__":
    main()
