"""Small MarianMT and FSMT folders built with Transformers' own classes (random weights, tokenizers learned on
Multi30k lines), and Transformers' generation under nmt's search rules, for tests/test_import.py."""

from __future__ import annotations

import gzip
import io
import json
import math
from collections import Counter
from pathlib import Path

import torch

# A randomly initialized model repeats one token whatever the input: with the residual branches' output
# weights scaled up, the embeddings larger than the position table and (untied) a larger output projection,
# its outputs depend on the source, so a wrong mapping shows.
BRANCH_SCALE, EMBED_SCALE, OUTPUT_SCALE = 30.0, 3.0, 20.0
SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
             encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=128, dropout=0.1,
             forced_eos_token_id=None)
LANGUAGE_TOKENS = [">>deu<<", ">>fra<<"]


def multi30k_lines(data: Path, split: str, lang: str, n: int) -> list[str]:
    with gzip.open(data / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def learn_sentencepiece(lines: list[str], size: int) -> bytes:
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=size,
                                             model_type="unigram", minloglevel=2)
    return out.getvalue()


def spm_pieces(model: bytes) -> list[str]:
    import sentencepiece

    p = sentencepiece.SentencePieceProcessor(model_proto=model)
    return [p.id_to_piece(i) for i in range(3, p.get_piece_size())]  # without <unk> <s> </s>


def scale_up(model) -> None:
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("fc2.weight", "out_proj.weight")):
                w.mul_(BRANCH_SCALE)
            if "embed_tokens" in name or name.endswith("shared.weight"):
                w.mul_(EMBED_SCALE)
            if "output_projection" in name or "lm_head" in name:
                w.mul_(OUTPUT_SCALE)


def build_marian(folder: Path, data: Path, tied: bool, seed: int = 0) -> Path:
    """An OPUS-MT-shaped folder: source.spm (en) and target.spm (de), and one vocabulary of both with two
    target-language tokens (tied: shared embeddings, the output tied to them) or a vocabulary per side
    (untied: separate embeddings, output projection of its own); swish activation, a random logit bias."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    torch.manual_seed(seed)
    folder.mkdir(parents=True)
    src = learn_sentencepiece(multi30k_lines(data, "train", "en", 2000), 400)
    tgt = learn_sentencepiece(multi30k_lines(data, "train", "de", 2000), 500)
    (folder / "source.spm").write_bytes(src)
    (folder / "target.spm").write_bytes(tgt)
    files = [str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json")]
    if tied:
        symbols = ["</s>", "<unk>", *LANGUAGE_TOKENS, *dict.fromkeys(spm_pieces(src) + spm_pieces(tgt)), "<pad>"]
        (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}), encoding="utf-8")
        tokenizer = MarianTokenizer(*files, source_lang="en", target_lang="de")
        sizes, pad = (len(symbols), len(symbols)), len(symbols) - 1
    else:
        source_symbols = ["</s>", "<unk>", "<pad>", *spm_pieces(src)]
        target_symbols = ["</s>", "<unk>", "<pad>", *spm_pieces(tgt)]
        (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(source_symbols)}), encoding="utf-8")
        (folder / "target_vocab.json").write_text(json.dumps({s: i for i, s in enumerate(target_symbols)}),
                                                  encoding="utf-8")
        tokenizer = MarianTokenizer(*files, target_vocab_file=str(folder / "target_vocab.json"), separate_vocabs=True,
                                    source_lang="en", target_lang="de")
        sizes, pad = (len(source_symbols), len(target_symbols)), 2
    config = MarianConfig(vocab_size=sizes[0], decoder_vocab_size=sizes[1], pad_token_id=pad, eos_token_id=0,
                          decoder_start_token_id=pad, activation_function="swish", scale_embedding=True,
                          share_encoder_decoder_embeddings=tied, tie_word_embeddings=tied, **SIZES)
    model = MarianMTModel(config)
    scale_up(model)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_fsmt(folder: Path, data: Path, tied: bool, seed: int = 0) -> Path:
    """A fairseq-WMT19-shaped folder: joint BPE merges learned with subword-nmt on FSMTTokenizer's own
    tokenization, a vocabulary per side (tied: one vocabulary, the embeddings and output projection tied)."""
    from subword_nmt.learn_bpe import learn_bpe
    from transformers import FSMTConfig, FSMTForConditionalGeneration, FSMTTokenizer

    torch.manual_seed(seed)
    folder.mkdir(parents=True)
    en, de = multi30k_lines(data, "train", "en", 2000), multi30k_lines(data, "train", "de", 2000)
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}

    def tokenizer() -> FSMTTokenizer:
        return FSMTTokenizer(langs=["en", "de"], src_vocab_file=str(folder / "vocab-src.json"),
                             tgt_vocab_file=str(folder / "vocab-tgt.json"), merges_file=str(folder / "merges.txt"))

    for name in ("vocab-src.json", "vocab-tgt.json"):
        (folder / name).write_text(json.dumps(specials), encoding="utf-8")
    (folder / "merges.txt").write_text("a b 1\n", encoding="utf-8")
    tok = tokenizer()
    words = "\n".join(" ".join(tok.moses_tokenize(tok.moses_pipeline(x, lang), lang))
                      for lines, lang in ((en, "en"), (de, "de")) for x in lines)
    codes = io.StringIO()
    learn_bpe(io.StringIO(words), codes, 600, min_frequency=2)
    merges = [m for m in codes.getvalue().splitlines() if m and not m.startswith("#")]
    (folder / "merges.txt").write_text("".join(f"{m} 1\n" for m in merges), encoding="utf-8")
    tok = tokenizer()

    def vocab(lines: list[str], lang: str) -> dict[str, int]:
        tok.src_lang = lang
        counts = Counter(t for x in lines for t in tok._tokenize(x))
        ordered = sorted(counts, key=lambda t: (-counts[t], t))
        return {**specials, **{t: 4 + i for i, t in enumerate(ordered)}}

    src_vocab, tgt_vocab = vocab(en[:1500], "en"), vocab(de[:1500], "de")
    if tied:
        extra = [t for t in tgt_vocab if t not in src_vocab]
        src_vocab = tgt_vocab = {**src_vocab, **{t: len(src_vocab) + i for i, t in enumerate(extra)}}
    (folder / "vocab-src.json").write_text(json.dumps(src_vocab), encoding="utf-8")
    (folder / "vocab-tgt.json").write_text(json.dumps(tgt_vocab), encoding="utf-8")
    config = FSMTConfig(langs=["en", "de"], src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab),
                        activation_function="relu", scale_embedding=True, tie_word_embeddings=tied, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **SIZES)
    model = FSMTForConditionalGeneration(config)
    scale_up(model)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def nmt_rules(never: list[int], eos: int, limit: int):
    """Transformers logits processors that search as nmt does: the ids in `never` (<pad>, and the folder's <s>)
    are never proposed (-inf after the log-softmax, as nmt's search sets them), and after `limit` tokens only
    </s> may follow, at its own probability (`decode.lengths`)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Never(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()  # generate may keep the tensor it passes as its raw logits
            scores[:, never] = -math.inf
            return scores

    class EndAtLimit(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - 1 >= limit:  # the decoder-start token is no output token
                end = scores[:, eos].clone()
                scores[:] = -math.inf
                scores[:, eos] = end
            return scores

    return LogitsProcessorList([Never(), EndAtLimit()])


def transformers_generate(folder: Path, sources: list[str], beam: int, limit: int,
                          target_token: str = "") -> tuple[list[list[int]], list[str]]:
    """Transformers' own output ids (without the decoder-start token and </s>) and text for `sources`: greedy or
    beam search, no length penalty (nmt's GNMT penalty and Transformers' |Y|^a agree only at 0), at most `limit`
    tokens before </s>, under `nmt_rules`."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    c = model.config
    never = [c.pad_token_id] + ([c.bos_token_id] if c.model_type == "fsmt" else [])
    batch = tokenizer([f"{target_token} {s}" if target_token else s for s in sources], return_tensors="pt",
                      padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=beam, do_sample=False, length_penalty=0.0, early_stopping=True,
                             max_new_tokens=limit + 1, logits_processor=nmt_rules(never, c.eos_token_id, limit))
    ids = [[int(i) for i in row[1:] if i not in (c.pad_token_id, c.eos_token_id)] for row in out]
    return ids, tokenizer.batch_decode(out, skip_special_tokens=True)


def transformers_greedy_log_probs(folder: Path, source: str, limit: int,
                                  target_token: str = "") -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy output ids for `source` (as `transformers_generate`) and the log-probability of each
    of them and of </s>, from the logits its generate computed (its incremental decoder: FSMT's teacher-forced
    forward gives other figures than its own generate)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    c = model.config
    never = [c.pad_token_id] + ([c.bos_token_id] if c.model_type == "fsmt" else [])
    batch = tokenizer([f"{target_token} {source}" if target_token else source], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=limit + 1, output_logits=True,
                             return_dict_in_generate=True, logits_processor=nmt_rules(never, c.eos_token_id, limit))
    tokens = out.sequences[0, 1:].tolist()
    log_probs = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, tokens)])
    return tokens[:-1], log_probs


def target_ids_of(folder: Path) -> dict[str, int]:
    """The folder's target vocabulary {symbol: id}, its symbols spelled as nmt spells them."""
    kind = json.loads((folder / "config.json").read_text(encoding="utf-8"))["model_type"]
    if kind == "marian":
        name = "target_vocab.json" if (folder / "target_vocab.json").exists() else "vocab.json"
        return json.loads((folder / name).read_text(encoding="utf-8"))
    from nmt_cli.export.hf_import import fsmt_pieces

    vocab = json.loads((folder / "vocab-tgt.json").read_text(encoding="utf-8"))
    return dict(zip(fsmt_pieces(list(vocab)), vocab.values()))
