"""How well attention-derived word alignments match hand-made ones, layer by layer: `nmt translate
--alignments` on a small gold set (benchmarks/alignment_gold.json: 20 short Multi30k val pairs, links made by
hand). Each reference is teacher-forced through the model, so the figures do not depend on its translations.

    python benchmarks/alignments.py --model exp/multi30k/model.pt

Prints precision, recall and alignment error rate (AER, all links taken as sure: 1 - 2|A & G| / (|A| + |G|))
per decoder layer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from common import REPO, machine, print_table

sys.path.insert(0, str(REPO))

GOLD = Path(__file__).with_name("alignment_gold.json")


def links(text: str) -> set[tuple[int, int]]:
    return {tuple(map(int, pair.split("-"))) for pair in text.split()}  # type: ignore[misc]


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "exp" / "multi30k" / "model.pt"))
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "multi30k")
    args = parser.parse_args()
    from nmt_cli.decode.translate import Translator

    gold = json.loads(GOLD.read_text(encoding="utf-8"))["pairs"]
    en = gzip.open(args.data / "val.en.gz", "rt", encoding="utf-8").read().splitlines()
    de = gzip.open(args.data / "val.de.gz", "rt", encoding="utf-8").read().splitlines()
    translator = Translator.from_checkpoint(args.model)
    sources = [en[g["line"]] for g in gold]
    references = [de[g["line"]] for g in gold]
    for g, s, r in zip(gold, sources, references):
        if [len(s.split()), len(r.split())] != g["words"]:
            sys.exit(f"alignments: val line {g['line']} is not the one the gold links were made for")
    ids = [(translator.encode([s])[0], translator.vocab.encode(translator.segmenter.segment(r, "de")))
           for s, r in zip(sources, references)]
    rows = []
    for layer in range(1, translator.ensemble.models[0].config.layers + 1):
        found = right = total = 0
        for g, pairs in zip(gold, translator.align(sources, references, ids, layer)):
            truth = links(g["links"])
            found, right, total = found + len(pairs), right + len(set(pairs) & truth), total + len(truth)
        default = " (default)" if layer - 1 == translator.alignment_layer(None) else ""
        rows.append([f"{layer}{default}", found, f"{right / found:.3f}", f"{right / total:.3f}",
                     f"{1 - 2 * right / (found + total):.3f}"])
    print_table(f"alignments: {len(gold)} hand-aligned Multi30k val pairs, {Path(args.model).name} ({machine()})",
                ["layer", "links", "precision", "recall", "AER"], rows)
    return rows


if __name__ == "__main__":
    main()
