"""The same model in two runtimes: nmt and its `nmt export transformers` folder (Marian or FSMT), on real lines.

    python benchmarks/hf_export.py --model exp/multi30k/model.pt --src test.en --ref test.de [--lines 200]

Prints, over the first N lines: lines whose Transformers tokenizer ids equal nmt's, the largest difference of
teacher-forced per-token log-probabilities (references, on the lines with equal ids), lines whose greedy
`generate` equals nmt's greedy output, and lines whose beam-4 output equals nmt's beam-4 output (nmt: GNMT
length penalty 0.6; Transformers: its length^alpha penalty with alpha 0.6, so some differ by design).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import REPO, machine, print_table

sys.path.insert(0, str(REPO))


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=200)
    args = parser.parse_args()
    import torch
    import transformers

    from nmt_cli.decode.translate import Translator
    from nmt_cli.export.hf import export_transformers
    from nmt_cli.textio import read_lines

    sources, refs = read_lines(args.src)[: args.lines], read_lines(args.ref)[: args.lines]
    nmt = Translator.from_checkpoint(args.model)
    vocab, net = nmt.vocab, nmt.ensemble.models[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_transformers(args.model, Path(tmp) / "hf")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    kind = type(model).__name__
    ids = nmt.encode(sources)
    equal = [i for i, s in enumerate(sources) if tokenizer(s)["input_ids"] == ids[i] + [vocab.eos]]
    worst = 0.0
    for i in equal:
        target = vocab.encode(nmt.segmenter.segment(refs[i], nmt.target_lang))
        src, prev = torch.tensor([ids[i] + [vocab.eos]]), torch.tensor([[vocab.bos] + target])
        with torch.no_grad():
            ours = torch.log_softmax(net.logits(net(src, prev)).float(), -1)[0]
            theirs = torch.log_softmax(model(input_ids=src, decoder_input_ids=prev, use_cache=False).logits.float(),
                                       -1)[0]
        gold = torch.tensor(target + [vocab.eos])
        worst = max(worst, (ours[range(len(gold)), gold] - theirs[range(len(gold)), gold]).abs().max().item())
    rows = [["tokenizer ids equal to nmt's", f"{len(equal)} / {len(sources)}"],
            ["largest per-token log-probability difference (those lines, references forced)", f"{worst:.2e}"]]
    for beam in (1, 4):
        ours = nmt.translate([sources[i] for i in equal], beam=beam, lenpen=0.6, greedy=beam == 1)
        same = 0
        for i, expected in zip(equal, ours):
            limit = nmt.max_output_tokens(len(ids[i]), 1.0, 50)
            out = model.generate(torch.tensor([ids[i] + [vocab.eos]]), num_beams=beam, do_sample=False,
                                 length_penalty=0.6, max_new_tokens=limit + 1, early_stopping=True)
            same += tokenizer.decode(out[0], skip_special_tokens=True).strip() == expected.strip()
        rows.append([f"{'greedy' if beam == 1 else 'beam 4'} outputs equal to nmt's", f"{same} / {len(equal)}"])
    print_table(f"export transformers ({kind}): {Path(args.model).name}, {len(sources)} lines of {args.src.name} "
                f"({machine()})", ["what", "figure"], rows)
    return rows


if __name__ == "__main__":
    main()
