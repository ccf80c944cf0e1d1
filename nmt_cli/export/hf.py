"""`nmt export transformers`: a trained model as a Hugging Face Transformers folder that
`AutoModelForSeq2SeqLM.from_pretrained` and `AutoTokenizer.from_pretrained` load without custom code.

Both targets are nmt's post-norm Transformer (ReLU, LayerNorm eps 1e-5, embeddings x sqrt(d_model), one
embedding matrix for source, target and output, no output bias); they differ in the position table.

- A model trained with `--tokenizer sentencepiece` becomes a Marian model (`MarianMTModel` + `MarianTokenizer`,
  the format of the OPUS-MT models). Marian computes its sinusoids with all the sines first, where the paper
  interleaves them (section 3.5). LayerNorm, the residual stream and the dot products are all unchanged by a
  fixed permutation of the model dimension, so the export permutes it: every weight that writes into the
  d_model-wide stream has its rows permuted, every one that reads from it its columns. The output is the same
  function, not an approximation (tests/test_sentencepiece.py checks the per-token log-probabilities).
- A model trained with Moses + BPE (the paper's pipeline) becomes an FSMT model (`FSMTForConditionalGeneration`
  + `FSMTTokenizer`, the format of fairseq's WMT19 models), which keeps its position table among its weights:
  nmt's own table goes there unchanged (tests/test_export.py).

What a target cannot hold (pre-norm, heads that do not make up d_model; learned positions for Marian) is
refused with one line.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from nmt_cli.decode.pipeline import stored_decoding
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import load_checkpoint, model_from_checkpoint, require_keys, target_vocabulary
from nmt_cli.text.segment import with_plain_spaces
from nmt_cli.textio import check_replaceable, export_kind, mark_export, publish_directory, staging_directory

HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "swish"}  # nmt's names -> Transformers'
INSTALL_HINT = ("nmt export transformers needs Hugging Face Transformers; install it with: pip install "
                "-e '.[hf]' (or pip install transformers)")


def marian_permutation(d_model: int) -> torch.Tensor:
    """Marian's dimension i is nmt's perm[i]: the paper's sines (even dimensions), then its cosines (odd)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def bart_layers(w: dict[str, torch.Tensor], layers: int, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """nmt's encoder and decoder layers under the names Marian and FSMT share (BART's: q/k/v/out_proj,
    self_attn_layer_norm, encoder_attn, fc1, fc2, final_layer_norm), the model dimension reordered by `perm`:
    every weight that writes into the d_model-wide residual stream has its rows permuted (biases and
    LayerNorms likewise), every one that reads from it its columns."""
    d, out = len(perm), {}

    def reads(name: str) -> torch.Tensor:
        return w[name][:, perm].contiguous()

    def writes(name: str) -> torch.Tensor:
        return w[name][perm].contiguous()

    def attention(prefix: str, source: str) -> None:
        weight, bias = w[f"{source}.in_proj.weight"], w[f"{source}.in_proj.bias"]
        for k, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}.{name}.weight"] = weight[k * d : (k + 1) * d][:, perm].contiguous()
            out[f"{prefix}.{name}.bias"] = bias[k * d : (k + 1) * d].clone()
        out[f"{prefix}.out_proj.weight"] = writes(f"{source}.out_proj.weight")
        out[f"{prefix}.out_proj.bias"] = writes(f"{source}.out_proj.bias")

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"], out[f"{target}.bias"] = writes(f"{source}.weight"), writes(f"{source}.bias")

    def feed_forward(prefix: str, source: str) -> None:
        out[f"{prefix}.fc1.weight"], out[f"{prefix}.fc1.bias"] = reads(f"{source}.w1.weight"), w[f"{source}.w1.bias"]
        out[f"{prefix}.fc2.weight"] = writes(f"{source}.w2.weight")
        out[f"{prefix}.fc2.bias"] = writes(f"{source}.w2.bias")

    for i in range(layers):
        e, p = f"model.encoder.layers.{i}", f"encoder.{i}"
        attention(f"{e}.self_attn", f"{p}.self_attn")
        norm(f"{e}.self_attn_layer_norm", f"{p}.sublayer.0.norm")
        feed_forward(e, f"{p}.feed_forward")
        norm(f"{e}.final_layer_norm", f"{p}.sublayer.1.norm")
        e, p = f"model.decoder.layers.{i}", f"decoder.{i}"
        attention(f"{e}.self_attn", f"{p}.self_attn")
        norm(f"{e}.self_attn_layer_norm", f"{p}.sublayer.0.norm")
        attention(f"{e}.encoder_attn", f"{p}.cross_attn")
        norm(f"{e}.encoder_attn_layer_norm", f"{p}.sublayer.1.norm")
        feed_forward(e, f"{p}.feed_forward")
        norm(f"{e}.final_layer_norm", f"{p}.sublayer.2.norm")
    return out


def output_layer(model, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A model's (source embedding, target embedding, output projection, logit bias or None), float32, without
    padding rows (`ModelConfig.rows`)."""
    c = model.config
    source = model.embed.weight.detach().float()[: c.vocab_size]
    target = (model.target_embed.weight if model.target_embed is not None else model.embed.weight).detach().float()
    output = model.output_matrix.detach().float()[: c.target_vocab]
    bias = None if model.logit_bias is None else model.logit_bias.detach().float()[: c.target_vocab]
    return source, target[: c.target_vocab], output, bias


def marian_state_dict(state: dict) -> tuple[dict, dict]:
    """(MarianConfig keyword arguments, MarianMTModel state dict) of an nmt checkpoint's model."""
    model, vocab = model_from_checkpoint(state)
    target_vocab = target_vocabulary(state)
    c = model.config
    why = ("pre-norm layers (Marian's are post-norm)" if c.pre_norm else
           "learned positions (Marian's are sinusoids)" if c.learned_positions else
           f"heads of {c.dk} x {c.heads} that do not make up d_model {c.d_model}" if c.dk * c.heads != c.d_model else
           f"an odd d_model ({c.d_model})" if c.d_model % 2 else None)
    if why:
        raise NmtError(f"the model has {why}: a Marian model cannot hold it exactly")
    d, perm = c.d_model, marian_permutation(c.d_model)
    w = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = bart_layers(w, c.layers, perm)
    source, target, output, bias = (t if t is None or t.dim() == 1 else t[:, perm].contiguous()
                                    for t in output_layer(model, c.rows))
    out["model.encoder.embed_tokens.weight"], out["model.decoder.embed_tokens.weight"] = source, target
    if c.shared_embeddings:
        out["model.shared.weight"] = source
    out["lm_head.weight"] = output
    # A logit bias of -inf (a row an imported model lacks, see hf_import) stays: that column is no token.
    out["final_logits_bias"] = (torch.zeros(len(target_vocab)) if bias is None else bias)[None]
    config = dict(
        vocab_size=len(vocab), decoder_vocab_size=len(target_vocab), d_model=d, encoder_layers=c.layers,
        decoder_layers=c.layers, encoder_ffn_dim=c.ffn, decoder_ffn_dim=c.ffn, encoder_attention_heads=c.heads,
        decoder_attention_heads=c.heads, max_position_embeddings=c.max_positions,
        activation_function=HF_ACTIVATIONS[c.activation], dropout=c.dropout, attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout, scale_embedding=c.scale_embedding, pad_token_id=vocab.pad,
        bos_token_id=vocab.bos, eos_token_id=vocab.eos, forced_eos_token_id=vocab.eos,
        decoder_start_token_id=vocab.bos, share_encoder_decoder_embeddings=c.shared_embeddings,
        tie_word_embeddings=c.tied_output)
    return config, out


def fsmt_state_dict(state: dict) -> tuple[dict, dict]:
    """(FSMTConfig keyword arguments, FSMTForConditionalGeneration state dict) of an nmt checkpoint's model.

    FSMT is fairseq's post-norm Transformer. It keeps its position table among the weights and numbers positions
    from padding_idx + 1 (fairseq's convention), so nmt's table, row for row, goes there from that row on: no
    permutation is needed, and learned positions export as they are."""
    model, vocab = model_from_checkpoint(state)
    target_vocab = target_vocabulary(state)
    c = model.config
    why = ("pre-norm layers (FSMT's are post-norm)" if c.pre_norm else
           "a logit bias (FSMT's output layer has none)" if c.output_bias else
           f"heads of {c.dk} x {c.heads} that do not make up d_model {c.d_model}" if c.dk * c.heads != c.d_model else
           None)
    if why:
        raise NmtError(f"the model has {why}: an FSMT model cannot hold it exactly")
    d = c.d_model
    w = {k: v.detach().float() for k, v in model.state_dict().items()}
    table = w["position_embed"] if c.learned_positions else model.positions.float()
    positions = torch.zeros(c.max_positions + vocab.pad + 1, d)
    positions[vocab.pad + 1 :] = table
    out = bart_layers(w, c.layers, torch.arange(d))  # FSMT keeps nmt's dimension order
    source, target, output, _ = output_layer(model, c.rows)
    out["model.encoder.embed_tokens.weight"], out["model.decoder.embed_tokens.weight"] = source, target
    out["model.decoder.output_projection.weight"] = output
    out["model.encoder.embed_positions.weight"] = out["model.decoder.embed_positions.weight"] = positions
    config = dict(
        langs=[state["source_lang"], state["target_lang"]], src_vocab_size=len(vocab),
        tgt_vocab_size=len(target_vocab), activation_function=HF_ACTIVATIONS[c.activation], d_model=d,
        max_length=min(512, c.max_positions),
        max_position_embeddings=c.max_positions, encoder_ffn_dim=c.ffn, encoder_layers=c.layers,
        encoder_attention_heads=c.heads, decoder_ffn_dim=c.ffn, decoder_layers=c.layers,
        decoder_attention_heads=c.heads, dropout=c.dropout, attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout, scale_embedding=c.scale_embedding,
        tie_word_embeddings=c.tied_output and c.shared_embeddings, num_beams=4,
        pad_token_id=vocab.pad, bos_token_id=vocab.bos, eos_token_id=vocab.eos, forced_eos_token_id=vocab.eos,
        decoder_start_token_id=vocab.bos)
    return config, out


def fsmt_symbols(symbols: list[str]) -> list[str]:
    """nmt's BPE pieces in FSMT's spelling: ``ne@@`` (a word goes on) is ``ne``, ``w`` (a word ends) ``w</w>``."""
    special = set(symbols[:4])
    return [s if s in special else s[: -len("@@")] if s.endswith("@@") else s + "</w>" for s in symbols]


def model_card(state: dict, checkpoint: str | Path, kind: str = "marian") -> str:
    """README.md of the exported folder: what the model is, what it was made from, how to use it."""
    from nmt_cli import __version__

    c, src, tgt = state["config"], state["source_lang"], state["target_lang"]
    tokenizer = state.get("tokenizer") or {}
    if kind == "fsmt":
        merges = len([x for x in state["bpe_codes"].splitlines() if x.strip() and not x.startswith("#version")])
        pieces = (f"Moses tokenization and joint BPE ({merges:,} merges, {len(state['vocab']):,} pieces for both "
                  "languages)")
        caveat = "" if tokenizer.get("pipeline") == "fsmt" else (  # a model imported from FSMT tokenizes as it
            "\nFSMTTokenizer always replaces Unicode punctuation, normalizes punctuation (Moses) and escapes "
            "`& < > ' \"` as `&amp;` etc.; this model was trained without escaping"
            + ("" if tokenizer.get("normalize_punctuation") else " and without normalization")
            + ", so input lines holding those characters are tokenized otherwise than in training (nmt "
            "translate reads them as trained).\n")
    else:
        pieces = (f"{len(state['vocab']):,} SentencePiece {tokenizer.get('model_type', 'unigram')} pieces for both "
                  "languages")
        caveat = ""
    averaged = state.get("averaged_from") or []
    made = f"{state.get('updates', 0):,} updates"
    if averaged:
        made += f", the average of {len(averaged)} checkpoints"
    return f"""---
language:
- {src}
- {tgt}
tags:
- translation
- {kind}
- nmt-cli
license:  # left for you to choose: the licence of the training data applies
---

# {src} -> {tgt} Transformer, exported from nmt

- Model: {c['layers']} + {c['layers']} layers, d_model {c['d_model']}, d_ff {c['ffn']}, {c['heads']} heads,
  post-norm, {'learned' if c.get('learned_positions') else 'sinusoidal'} positions, shared embeddings; {pieces};
  {made}.
- Made by nmt {__version__} (the Transformer of "Attention Is All You Need"): `nmt export transformers -m
  {Path(checkpoint).name}`. The data and the training command are those of the run that wrote the checkpoint
  (its save dir's `options.json` and `train.jsonl`); the checkpoint holds no score: score the model with
  `nmt score` on your test set and write the figure and its sacreBLEU signature here.

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")
model = AutoModelForSeq2SeqLM.from_pretrained("THIS_FOLDER")
batch = tokenizer(["..."], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch, num_beams=4), skip_special_tokens=True))
```

Per-token probabilities and greedy output are nmt's. With a beam, Transformers divides a hypothesis's score by
length^alpha and nmt by GNMT's ((5 + length) / 6)^alpha, so a few outputs may differ from `nmt translate`'s.
{caveat}"""


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Transformers' own progress bars ("Writing model shards") off while nmt writes a folder: nmt's commands
    print their own lines, and a bar from another library on stderr reads as part of nmt's output."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_transformers(checkpoint: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write an nmt checkpoint as a Transformers folder (Marian for SentencePiece models, FSMT for Moses + BPE
    ones); returns it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    out = Path(out)
    check_replaceable(out, force, "an nmt export for transformers", lambda f: export_kind(f) == "transformers")
    state = require_keys(load_checkpoint(checkpoint), checkpoint)
    if (state.get("tokenizer") or {}).get("name", "moses") == "moses":
        model, files, tokenizer_config = _fsmt(state, checkpoint)
        kind = "fsmt"
    else:
        model, files, tokenizer_config = _marian(state, checkpoint)
        kind = "marian"
    model.generation_config.num_beams = stored_decoding(state, checkpoint).get("beam", 4)
    tokenizer_config["model_max_length"] = state["config"]["max_positions"] - 1
    with staging_directory(out) as staging:
        folder = staging / "model"
        with quiet_transformers():
            model.save_pretrained(folder)
        for name, content in files.items():
            (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n",
                                                      encoding="utf-8")
        (folder / "README.md").write_text(model_card(state, checkpoint, kind), encoding="utf-8")
        # nmt's own tokenizer record: `nmt import transformers` reads the folder back as trained (FSMTTokenizer
        # escapes characters nmt's Moses tokenization does not)
        mark_export(folder, "transformers", tokenizer=state.get("tokenizer") or {})
        publish_directory(folder, out)
    return out


def _loaded(model, weights: dict, name: str, ignore: str | None = None):
    """`model` with `weights` loaded; one line when this Transformers release names its weights otherwise."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if ignore is None or ignore not in k]
    if missing or unexpected:
        raise NmtError(f"this Transformers' {name} model does not match the export (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]})")
    return model


def _marian(state: dict, checkpoint: str | Path) -> tuple:
    """A SentencePiece model as Marian: the model, its extra files, its tokenizer config."""
    from transformers import MarianConfig, MarianMTModel

    if not state.get("sentencepiece"):
        raise NmtError(f"{checkpoint}: checkpoint lacks sentencepiece (its tokenizer's model)")
    if (state.get("tokenizer") or {}).get("lowercase"):
        raise NmtError(f"{checkpoint}: the model reads lowercased text (nmt prepare --lowercase), which "
                       "MarianTokenizer cannot do; export it with nmt export ctranslate2")
    try:
        config_args, weights = marian_state_dict(state)
    except NmtError as e:
        raise NmtError(f"{checkpoint}: {e}") from None
    model = _loaded(MarianMTModel(MarianConfig(**config_args)), weights, "Marian", ignore="embed_positions")
    model.generation_config.max_length = min(512, state["config"]["max_positions"])
    spm = with_plain_spaces(state["sentencepiece"])  # MarianTokenizer gives it raw text: spaces as nmt's
    target_spm = with_plain_spaces(state["target_sentencepiece"]) if state.get("target_sentencepiece") else spm
    separate = bool(state.get("target_vocab"))
    files = {"source.spm": spm, "target.spm": target_spm,
             "vocab.json": json.dumps({s: i for i, s in enumerate(state["vocab"])}, ensure_ascii=False)}
    if separate:
        files["target_vocab.json"] = json.dumps({s: i for i, s in enumerate(state["target_vocab"])},
                                                ensure_ascii=False)
    return model, files, {"tokenizer_class": "MarianTokenizer", "source_lang": state["source_lang"],
                          "target_lang": state["target_lang"], "separate_vocabs": separate, "unk_token": "<unk>",
                          "eos_token": "</s>", "pad_token": "<pad>"}


def _fsmt(state: dict, checkpoint: str | Path) -> tuple:
    """A Moses + BPE model as FSMT: the model, its extra files, its tokenizer config."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    try:
        config_args, weights = fsmt_state_dict(state)
    except NmtError as e:
        raise NmtError(f"{checkpoint}: {e}") from None
    model = _loaded(FSMTForConditionalGeneration(FSMTConfig(**config_args)), weights, "FSMT")
    vocab = json.dumps({s: i for i, s in enumerate(fsmt_symbols(state["vocab"]))}, ensure_ascii=False)
    target_vocab = json.dumps({s: i for i, s in enumerate(fsmt_symbols(target_vocabulary(state).symbols))},
                              ensure_ascii=False)
    merges = [line for line in state["bpe_codes"].splitlines() if line.strip() and not line.startswith("#version")]
    files = {"vocab-src.json": vocab, "vocab-tgt.json": target_vocab, "merges.txt": "".join(m + "\n" for m in merges)}
    lowercase = bool((state.get("tokenizer") or {}).get("lowercase"))
    return model, files, {"tokenizer_class": "FSMTTokenizer", "langs": [state["source_lang"], state["target_lang"]],
                          "do_lower_case": lowercase, "unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<s>",
                          "sep_token": "</s>"}
