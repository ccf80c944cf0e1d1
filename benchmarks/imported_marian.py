"""An OPUS-MT-sized Marian model in four runtimes: nmt fp32 and bf16 after `nmt import transformers`, Transformers'
own `generate`, and CTranslate2 int8 after `nmt export ctranslate2`.

    python benchmarks/imported_marian.py [--lines 200] [--json]

The model is built with Transformers (MarianMTModel: 6 + 6 layers, d_model 512, FFN 2048, 8 heads, swish, a
vocabulary of 58,101 like opus-mt-en-de's; random weights, scaled as tests/hf_models.py scales them so outputs
depend on the input), with SentencePiece models learned on Multi30k. Every runtime translates the same first N
lines of test_2016_flickr (English) with beam 4, no length penalty, batches of 32, at most 64 output tokens
(Transformers under nmt's two search rules, tests/hf_models.nmt_rules, so that outputs compare), one after the
other in one process; sentences/s and output tokens/s over the whole set, and how many outputs equal nmt fp32's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, flickr_test_sources, machine, print_table, require_multi30k

sys.path.insert(0, str(REPO))

VOCAB = 58_101  # opus-mt-en-de's
LIMIT = 64
BATCH = 32


def build(folder: Path, data: Path) -> Path:
    """The OPUS-MT-sized folder (see the module's docstring)."""
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    from tests.hf_models import learn_sentencepiece, multi30k_lines, scale_up, spm_pieces

    torch.manual_seed(0)
    folder.mkdir(parents=True)
    src = learn_sentencepiece(multi30k_lines(data, "train", "en", 20_000), 5000)
    tgt = learn_sentencepiece(multi30k_lines(data, "train", "de", 20_000), 5000)
    (folder / "source.spm").write_bytes(src)
    (folder / "target.spm").write_bytes(tgt)
    pieces = list(dict.fromkeys(spm_pieces(src) + spm_pieces(tgt)))
    symbols = ["</s>", "<unk>", *pieces, *(f"\u2581unused{i}" for i in range(VOCAB - 3 - len(pieces))), "<pad>"]
    (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}), encoding="utf-8")
    tokenizer = MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"),
                                source_lang="en", target_lang="de")
    config = MarianConfig(vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=512, encoder_layers=6, decoder_layers=6,
                          encoder_ffn_dim=2048, decoder_ffn_dim=2048, encoder_attention_heads=8,
                          decoder_attention_heads=8, max_position_embeddings=512, pad_token_id=VOCAB - 1,
                          eos_token_id=0, decoder_start_token_id=VOCAB - 1, forced_eos_token_id=None,
                          activation_function="swish", scale_embedding=True)
    model = MarianMTModel(config)
    scale_up(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def timed(translate, sources: list[str]) -> tuple[float, list[str]]:
    start = time.perf_counter()
    out = translate(sources)
    return time.perf_counter() - start, out


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = parser.parse_args()
    import torch
    import transformers

    from nmt_cli.decode.translate import Translator
    from nmt_cli.export.ct2 import CTranslate2Translator, export_ctranslate2
    from nmt_cli.export.hf_import import import_transformers
    from tests.hf_models import nmt_rules

    data = require_multi30k()
    sources = flickr_test_sources()[: args.lines]
    options = dict(beam=4, lenpen=0.0, max_len_a=0, max_len_b=LIMIT, batch_size=BATCH)
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "marian", data)
        model_file = Path(tmp) / "model.pt"
        import_transformers(folder, model_file)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()

        rules = nmt_rules([hf.config.pad_token_id], hf.config.eos_token_id, LIMIT)  # nmt's search, so outputs compare

        def generate(lines: list[str]) -> list[str]:
            out = []
            for i in range(0, len(lines), BATCH):
                batch = tokenizer(lines[i : i + BATCH], return_tensors="pt", padding=True)
                with torch.inference_mode():
                    ids = hf.generate(**batch, num_beams=4, do_sample=False, length_penalty=0.0,
                                      early_stopping=True, max_new_tokens=LIMIT + 1, logits_processor=rules)
                out += tokenizer.batch_decode(ids, skip_special_tokens=True)
            return out

        runs = [("Transformers generate (fp32)", generate)]
        for precision in ("fp32", "bf16"):
            nmt = Translator.from_checkpoint(model_file, precision=precision)
            runs.append((f"nmt translate ({precision})", lambda lines, t=nmt: t.translate(lines, **options)))
        export_ctranslate2(model_file, Path(tmp) / "ct2", quantization="int8")
        ct2 = CTranslate2Translator.from_dir(Path(tmp) / "ct2")
        runs.append(("CTranslate2 int8 (nmt export ctranslate2)", lambda lines: ct2.translate(lines, **options)))
        for name, translate in runs:
            translate(sources[:BATCH])  # warm-up: kernels, packed weights
            seconds, out = timed(translate, sources)
            outputs[name] = out
            tokens = sum(len(tokenizer(x)["input_ids"]) for x in out)
            rows.append([name, len(sources) / seconds, tokens / seconds, seconds])
    reference = outputs["nmt translate (fp32)"]
    for row in rows:
        row.append(f"{sum(a == b for a, b in zip(outputs[row[0]], reference))} / {len(sources)}")
    print_table(f"OPUS-MT-sized Marian, {len(sources)} Multi30k lines, beam 4 ({machine()})",
                ["runtime", "sentences/s", "output tokens/s", "seconds", "outputs equal to nmt fp32"], rows)
    if args.json:
        print(json.dumps({"machine": machine(), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
