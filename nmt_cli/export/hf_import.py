"""`nmt import transformers`: a MarianMT (OPUS-MT) or FSMT (fairseq's WMT19) folder as an nmt model file, to
translate, fine-tune, average and export again.

The result computes the same function as the folder's model. Three things are rearranged on the way, each exact:
- Vocabulary ids: nmt's <pad> <s> </s> <unk> are ids 0-3 (`text.vocab`), so the rows of every embedding, output
  projection and logit bias are reordered: the specials first, then the folder's symbols in its own order.
  nmt starts decoding with <s>; that row of the decoder's input embedding holds the folder's decoder-start
  token's (Marian starts with <pad>, FSMT with </s>). Where the folder has no <s> of its own (Marian), the
  output column of nmt's <s> gets a logit bias of -inf: it is no token, and takes no probability.
- Marian's model dimension: its sinusoids put every sine first where the paper interleaves them (section 3.5);
  the inverse of `hf.marian_permutation` reorders the dimension, so nmt's own position table applies.
- Marian's BPE-like pieces and FSMT's ``w</w>`` spelling: FSMT's vocabulary is spelled as nmt's BPE spells it
  (``ne@@ w``) and its merges are subword-nmt codes; its tokenization (XML escaping, unicode punctuation) is
  recorded as the "fsmt" Moses pipeline (`segment.MosesBpe`).
What nmt cannot hold (pre-norm layers, encoder and decoder of different sizes, layer norms on the embeddings,
an unknown activation) is refused in one line naming the config field.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import torch

from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import save_checkpoint
from nmt_cli.model.transformer import ACTIVATIONS, ModelConfig
from nmt_cli.text.segment import one_line
from nmt_cli.text.vocab import SPECIALS
from nmt_cli.textio import EXPORT_MARKER

from .hf import INSTALL_HINT, marian_permutation

KINDS = ("marian", "fsmt")
# Transformers' activation names -> nmt's (`transformer.ACTIVATIONS`)
ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
LANGUAGE_TOKEN = re.compile(r">>.+<<")  # MarianTokenizer's target-language tokens (">>fra<<")


def local_folder(name: str) -> Path:
    """`name` as a local folder; a Hugging Face hub id ("Helsinki-NLP/opus-mt-en-de") that is no local path is
    downloaded first with huggingface_hub (one line where it cannot be)."""
    path = Path(name)
    if path.exists() or name.count("/") != 1 or name.startswith((".", "/")):
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise NmtError(f"{name}: no such folder (to download it from the hub: pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id=name))
    except Exception as e:  # offline, unknown id, gated: huggingface_hub raises many kinds
        raise NmtError(f"{name}: no such folder, and the hub did not give it ({one_line(e)})") from None


def read_json(path: Path) -> dict:
    """A JSON object from a folder's file; one line naming the file when it is missing or not JSON."""
    if not path.is_file():
        raise NmtError(f"{path}: missing (the folder's tokenizer or config needs it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NmtError(f"{path}: not valid JSON ({one_line(e)})") from None
    if not isinstance(data, dict):
        raise NmtError(f"{path}: not a JSON object")
    return data


def optional_json(path: Path) -> dict:
    """`read_json` of a file a folder may lack ({} then)."""
    return read_json(path) if path.exists() else {}


def model_kind(folder: Path) -> str:
    """"marian" or "fsmt": the folder's config.json model_type; one line for any other."""
    if not folder.is_dir():
        raise NmtError(f"{folder}: no such folder (give a Transformers model folder: config.json, weights, "
                       "tokenizer files)")
    config = read_json(folder / "config.json")
    kind = config.get("model_type")
    if kind not in KINDS:
        raise NmtError(f"{folder / 'config.json'}: model_type {kind!r} is not one nmt reads (it reads "
                       f"{', '.join(KINDS)}: OPUS-MT and fairseq WMT19 models)")
    return kind


def _require(config: dict, path: Path, checks: dict[str, object]) -> None:
    """One line naming the first config field whose value nmt cannot represent."""
    for field, wanted in checks.items():
        value = config.get(field, wanted)
        if value != wanted:
            raise NmtError(f"{path}: {field} {value!r}: nmt holds only {wanted!r} here")


def _same(config: dict, path: Path, pairs: list[tuple[str, str]]) -> None:
    for a, b in pairs:
        if a in config and b in config and config[a] != config[b]:
            raise NmtError(f"{path}: {a} {config[a]} and {b} {config[b]} differ: nmt's encoder and decoder have one "
                           "number of layers, one width and one number of heads")


def _activation(config: dict, path: Path) -> str:
    name = config.get("activation_function", "relu")
    if name not in ACTIVATION_NAMES:
        raise NmtError(f"{path}: activation_function {name!r} is not one nmt has (it has "
                       f"{', '.join(ACTIVATION_NAMES)})")
    assert ACTIVATION_NAMES[name] in ACTIVATIONS
    return ACTIVATION_NAMES[name]


def reordered(symbols: list[str], pad: int, eos: int, unk: int, bos: int | None) -> tuple[list[str], list[int]]:
    """nmt's vocabulary for a folder's `symbols` (by id) and, for each nmt id, the folder's id it reads: the
    specials first (nmt's <s> reads the folder's `bos`, or -1 where it has none), then every other symbol in
    the folder's order."""
    special = {pad, eos, unk} | ({bos} if bos is not None else set())
    order = [pad, -1 if bos is None else bos, eos, unk]
    rest = [i for i in range(len(symbols)) if i not in special]
    names = list(SPECIALS) + [symbols[i] for i in rest]
    if len(set(names)) != len(names):
        clash = next(s for s in names[4:] if s in SPECIALS)
        raise NmtError(f"the vocabulary holds {clash!r} as an ordinary symbol: nmt keeps it for its own special")
    return names, order + rest


def _rows(matrix: torch.Tensor, order: list[int], fill: int) -> torch.Tensor:
    """matrix's rows in nmt's order; row -1 (a symbol the folder lacks) is a copy of row `fill`."""
    index = torch.tensor([fill if i < 0 else i for i in order])
    return matrix.index_select(0, index).contiguous()


def nmt_layers(w: dict[str, torch.Tensor], layers: int, inverse: torch.Tensor) -> dict[str, torch.Tensor]:
    """The encoder and decoder layers of a BART-style state dict (Marian's, FSMT's) under nmt's names, the model
    dimension taken back to nmt's order by `inverse` (the inverse of `hf.bart_layers`' permutation)."""
    out: dict[str, torch.Tensor] = {}

    def reads(name: str) -> torch.Tensor:
        return w[name][:, inverse].contiguous()

    def writes(name: str) -> torch.Tensor:
        return w[name][inverse].contiguous()

    def attention(target: str, source: str) -> None:
        out[f"{target}.in_proj.weight"] = torch.cat([reads(f"{source}.{p}_proj.weight") for p in "qkv"])
        out[f"{target}.in_proj.bias"] = torch.cat([w[f"{source}.{p}_proj.bias"] for p in "qkv"])
        out[f"{target}.out_proj.weight"] = writes(f"{source}.out_proj.weight")
        out[f"{target}.out_proj.bias"] = writes(f"{source}.out_proj.bias")

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"], out[f"{target}.bias"] = writes(f"{source}.weight"), writes(f"{source}.bias")

    def feed_forward(target: str, source: str) -> None:
        out[f"{target}.w1.weight"], out[f"{target}.w1.bias"] = reads(f"{source}.fc1.weight"), w[f"{source}.fc1.bias"]
        out[f"{target}.w2.weight"] = writes(f"{source}.fc2.weight")
        out[f"{target}.w2.bias"] = writes(f"{source}.fc2.bias")

    for i in range(layers):
        e, p = f"model.encoder.layers.{i}", f"encoder.{i}"
        attention(f"{p}.self_attn", f"{e}.self_attn")
        norm(f"{p}.sublayer.0.norm", f"{e}.self_attn_layer_norm")
        feed_forward(f"{p}.feed_forward", e)
        norm(f"{p}.sublayer.1.norm", f"{e}.final_layer_norm")
        e, p = f"model.decoder.layers.{i}", f"decoder.{i}"
        attention(f"{p}.self_attn", f"{e}.self_attn")
        norm(f"{p}.sublayer.0.norm", f"{e}.self_attn_layer_norm")
        attention(f"{p}.cross_attn", f"{e}.encoder_attn")
        norm(f"{p}.sublayer.1.norm", f"{e}.encoder_attn_layer_norm")
        feed_forward(f"{p}.feed_forward", e)
        norm(f"{p}.sublayer.2.norm", f"{e}.final_layer_norm")
    return out


def _load_weights(folder: Path, kind: str) -> tuple[dict[str, torch.Tensor], object]:
    """The folder's weights as its own Transformers class loads them (safetensors or .bin, tied weights
    filled in, position tables computed), and that model's generation config; one line when they do not fit."""
    try:
        import transformers
    except ImportError:
        raise NmtError(INSTALL_HINT.replace("export", "import")) from None
    cls = transformers.MarianMTModel if kind == "marian" else transformers.FSMTForConditionalGeneration
    if not any((folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin",
                                                       "model.safetensors.index.json", "pytorch_model.bin.index.json")):
        raise NmtError(f"{folder}: holds no weights (model.safetensors or pytorch_model.bin)")
    from .hf import quiet_transformers

    try:
        # Transformers' loading bar and report stay out of nmt's output; what they say comes back as one line
        with quiet_transformers(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model, info = cls.from_pretrained(folder, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:  # Transformers raises many kinds for a file that does not fit its config
        raise NmtError(f"{folder}: the weights do not load into config.json's model ({one_line(e)})") from None
    missing = [k for k in info.get("missing_keys", []) if "embed_positions" not in k]
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        first = sorted(mismatched, key=str)[0]  # (name, found, wanted) or the name, by Transformers' release
        name, found, wanted = (list(first) + [None, None])[:3] if isinstance(first, (tuple, list)) else (first, None,
                                                                                                            None)
        shapes = f" holds {tuple(found)}, config.json wants {tuple(wanted)}" if found is not None else ""
        raise NmtError(f"{folder}: the weights do not fit config.json (weight {name}{shapes})")
    if missing:
        raise NmtError(f"{folder}: the weights do not fit config.json (missing {', '.join(missing[:3])})")
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return weights, model.generation_config


def _marian_tokenizer(folder: Path, config: dict) -> dict:
    """Marian's tokenizer files: the vocabularies (by id), the SentencePiece models, the languages."""
    tokenizer_config = optional_json(folder / "tokenizer_config.json")
    separate = bool(tokenizer_config.get("separate_vocabs", False))
    vocab = read_json(folder / "vocab.json")
    target = read_json(folder / "target_vocab.json") if separate else vocab
    files = {}
    for name in ("source.spm", "target.spm"):
        if not (folder / name).is_file():
            raise NmtError(f"{folder / name}: missing (MarianTokenizer's SentencePiece model)")
        files[name] = (folder / name).read_bytes()
    return {"vocab": by_id(vocab, folder / "vocab.json"),
            "target_vocab": by_id(target, folder / ("target_vocab.json" if separate else "vocab.json")),
            "source_spm": files["source.spm"], "target_spm": files["target.spm"], "separate": separate,
            "source_lang": tokenizer_config.get("source_lang"), "target_lang": tokenizer_config.get("target_lang")}


def by_id(vocab: dict, path: Path) -> list[str]:
    """A {symbol: id} vocabulary as a list by id; one line naming the file where ids are not 0..n-1."""
    symbols: list[str | None] = [None] * len(vocab)
    for symbol, i in vocab.items():
        if not isinstance(i, int) or not 0 <= i < len(vocab) or symbols[i] is not None:
            raise NmtError(f"{path}: symbol {symbol!r} has id {i!r}: the ids must be 0..{len(vocab) - 1}, each once")
        symbols[i] = symbol
    return symbols  # type: ignore[return-value]


def _special_id(symbols: list[str], token: str, path: Path) -> int:
    try:
        return symbols.index(token)
    except ValueError:
        raise NmtError(f"{path}: the vocabulary has no {token} symbol") from None


def fsmt_pieces(symbols: list[str]) -> list[str]:
    """FSMT's ``ne`` (a word goes on) / ``w</w>`` (a word ends) as nmt's BPE spells them (``ne@@``, ``w``);
    the inverse of `hf.fsmt_symbols`."""
    return [s if s in SPECIALS else s[: -len("</w>")] if s.endswith("</w>") else s + "@@" for s in symbols]


def _fsmt_tokenizer(folder: Path, config: dict) -> dict:
    tokenizer_config = optional_json(folder / "tokenizer_config.json")
    merges_path = folder / "merges.txt"
    if not merges_path.is_file():
        raise NmtError(f"{merges_path}: missing (FSMTTokenizer's BPE merges)")
    merges = []
    for number, line in enumerate(merges_path.read_text(encoding="utf-8").splitlines(), start=1):
        parts = line.split()
        if not parts or line.startswith("#version"):
            continue
        if len(parts) not in (2, 3):
            raise NmtError(f"{merges_path}:{number}: not a BPE merge (two symbols and an optional count)")
        merges.append(f"{parts[0]} {parts[1]}")
    langs = config.get("langs") or tokenizer_config.get("langs") or [None, None]
    return {"vocab": fsmt_pieces(by_id(read_json(folder / "vocab-src.json"), folder / "vocab-src.json")),
            "target_vocab": fsmt_pieces(by_id(read_json(folder / "vocab-tgt.json"), folder / "vocab-tgt.json")),
            "codes": "#version: 0.2\n" + "".join(m + "\n" for m in merges), "separate": True,
            "lowercase": bool(tokenizer_config.get("do_lower_case", False)),
            "source_lang": langs[0], "target_lang": langs[1]}


def import_transformers(folder: str | Path, out: str | Path, target_token: str | None = None,
                        source_lang: str | None = None, target_lang: str | None = None) -> dict:
    """Read a local MarianMT or FSMT folder and write it as a self-contained nmt model file `out`; returns a
    summary (kind, layers, vocabularies, parameters)."""
    folder = Path(folder)
    kind = model_kind(folder)
    config_path = folder / "config.json"
    config = read_json(config_path)
    # BART's variants that Marian and FSMT configs may carry: nmt's layers are post-norm, without extra norms
    _require(config, config_path, {"normalize_before": False, "normalize_embedding": False,
                                   "add_final_layer_norm": False, "layernorm_embedding": False})
    _same(config, config_path, [("encoder_layers", "decoder_layers"), ("encoder_ffn_dim", "decoder_ffn_dim"),
                                ("encoder_attention_heads", "decoder_attention_heads")])
    activation = _activation(config, config_path)
    d_model = int(config.get("d_model", 512))
    if kind == "marian" and d_model % 2:
        raise NmtError(f"{config_path}: d_model {d_model} is odd: Marian's sinusoids then differ from nmt's")
    files = _marian_tokenizer(folder, config) if kind == "marian" else _fsmt_tokenizer(folder, config)
    source_lang = source_lang or files["source_lang"]
    target_lang = target_lang or files["target_lang"]
    if not source_lang or not target_lang:
        raise NmtError(f"{folder}: its files name no languages: give --source-lang and --target-lang")
    weights, generation = _load_weights(folder, kind)

    src_symbols, tgt_symbols = files["vocab"], files["target_vocab"]
    vocab_path = folder / ("vocab.json" if kind == "marian" else "vocab-src.json")
    target_path = folder / ("target_vocab.json" if kind == "marian" and files["separate"] else
                            "vocab.json" if kind == "marian" else "vocab-tgt.json")
    pad, eos, unk = (_special_id(src_symbols, s, vocab_path) for s in ("<pad>", "</s>", "<unk>"))
    target_pad, target_eos, target_unk = (_special_id(tgt_symbols, s, target_path) for s in ("<pad>", "</s>", "<unk>"))
    # the decoder's first input: Marian's <pad>, FSMT's </s>
    start = int(config.get("decoder_start_token_id", target_pad if kind == "marian" else target_eos))
    if not 0 <= start < len(tgt_symbols):
        raise NmtError(f"{config_path}: decoder_start_token_id {start} is outside the target vocabulary of "
                       f"{len(tgt_symbols)}")
    bos = src_symbols.index("<s>") if "<s>" in src_symbols else None
    target_bos = tgt_symbols.index("<s>") if "<s>" in tgt_symbols else None
    src_names, src_order = reordered(src_symbols, pad, eos, unk, bos)
    tgt_names, tgt_order = reordered(tgt_symbols, target_pad, target_eos, target_unk, target_bos)
    separate = src_names != tgt_names

    d = d_model
    inverse = torch.argsort(marian_permutation(d)) if kind == "marian" else torch.arange(d)
    layers = int(config.get("encoder_layers", 6))
    state = nmt_layers(weights, layers, inverse)
    if kind == "marian":
        source_embed = weights["model.encoder.embed_tokens.weight"]
        decoder_embed = weights["model.decoder.embed_tokens.weight"]
        output = weights["lm_head.weight"]
        logit_bias = weights["final_logits_bias"].reshape(-1)
    else:
        source_embed = weights["model.encoder.embed_tokens.weight"]
        decoder_embed = weights["model.decoder.embed_tokens.weight"]
        output = weights["model.decoder.output_projection.weight"]
        logit_bias = None
    # The decoder reads the folder's decoder-start row where nmt reads <s>; the output column of nmt's <s> is the
    # folder's <s> where it has one, else no token at all (bias -inf).
    decoder_order = [tgt_order[0], start] + tgt_order[2:]
    embed = _rows(source_embed, src_order, pad)[:, inverse].contiguous()
    target_embed = _rows(decoder_embed, decoder_order, target_pad)[:, inverse].contiguous()
    output_matrix = _rows(output, tgt_order, target_pad)[:, inverse].contiguous()
    bias = None
    if logit_bias is not None or target_bos is None:
        bias = (torch.zeros(len(tgt_names)) if logit_bias is None else
                _rows(logit_bias[:, None], tgt_order, target_pad)[:, 0])
        if target_bos is None:
            bias[1] = -torch.inf
    # One matrix where the folder's encoder and decoder read the same rows (the source never reads <s>: that
    # row is the decoder's)
    shared = not separate and torch.equal(embed[2:], target_embed[2:]) and torch.equal(embed[0], target_embed[0])
    tied = torch.equal(target_embed, output_matrix) or (
        target_bos is None and torch.equal(target_embed[2:], output_matrix[2:]) and torch.equal(target_embed[0],
                                                                                              output_matrix[0]))
    state["embed.weight"] = target_embed if shared else embed
    if not shared:
        state["target_embed.weight"] = target_embed
    if not tied:
        state["output_weight"] = output_matrix
    if bias is not None:
        state["logit_bias"] = bias
    max_positions = int(config.get("max_position_embeddings", 1024))
    if kind == "fsmt":  # fairseq's table numbers positions from padding_idx + 1, and keeps them among the weights
        table = weights["model.decoder.embed_positions.weight"]
        state["position_embed"] = table[pad + 1 : pad + 1 + max_positions].contiguous()
        max_positions = state["position_embed"].shape[0]
    model_config = ModelConfig(
        vocab_size=len(src_names), layers=layers, d_model=d, ffn=int(config.get("encoder_ffn_dim", 2048)),
        heads=int(config.get("encoder_attention_heads", 8)), dropout=float(config.get("dropout", 0.1)),
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        activation_dropout=float(config.get("activation_dropout", 0.0)), max_positions=max_positions, pad=0,
        learned_positions=kind == "fsmt", vocab_multiple=1,
        target_vocab_size=len(tgt_names) if separate else None, shared_embeddings=shared, tied_output=tied,
        output_bias=bias is not None, activation=activation, scale_embedding=bool(config.get("scale_embedding",
                                                                                             kind == "marian")))
    tags = sorted(s for s in src_names if LANGUAGE_TOKEN.fullmatch(s)) if kind == "marian" else []
    if tags and not target_token:
        shown = ", ".join(tags[:4]) + (", ..." if len(tags) > 4 else "")
        raise NmtError(f"{vocab_path}: the model translates into several languages ({shown}): give --target-token")
    if target_token and target_token not in src_names:
        raise NmtError(f"--target-token {target_token!r} is not in {vocab_path}"
                       + (f" (it has {', '.join(tags[:6])})" if tags else ""))
    tokenizer: dict = ({"name": "sentencepiece", "normalize_punctuation": False, "tags": tags, "imported": "marian"}
                       if kind == "marian" else
                       {"name": "moses", "pipeline": "fsmt", "escape": True, "aggressive_dash_splits": True,
                        "normalize_punctuation": False, "lowercase": files["lowercase"], "imported": "fsmt"})
    made_by_nmt = optional_json(folder / EXPORT_MARKER).get("tokenizer")
    if isinstance(made_by_nmt, dict) and made_by_nmt.get("name") == tokenizer["name"]:
        tokenizer = made_by_nmt  # an nmt export: its text is read as nmt trained it
    checkpoint = {
        "model": state, "config": model_config.to_dict(), "vocab": src_names,
        **({"target_vocab": tgt_names} if separate else {}),
        "bpe_codes": files.get("codes", ""),
        "sentencepiece": files.get("source_spm"),
        **({"target_sentencepiece": files["target_spm"]}
           if kind == "marian" and files["target_spm"] != files["source_spm"] else {}),
        "source_lang": source_lang, "target_lang": target_lang, "tokenizer": tokenizer,
        **({"target_token": target_token} if target_token else {}),
        "updates": 0,
        "decoding": {"beam": int(getattr(generation, "num_beams", None) or 4), "lenpen": 0.6,
                     "chosen": f"the beam of {folder.name}'s generation config; nmt's length penalty"},
        "imported_from": {"folder": str(folder), "kind": kind},
    }
    _check_loads(checkpoint, folder)
    save_checkpoint(checkpoint, out)
    from nmt_cli.model.transformer import count_parameters

    model = _model(checkpoint)
    return {"kind": kind, "layers": layers, "d_model": d, "vocab": len(src_names), "target_vocab": len(tgt_names),
            "shared_embeddings": shared, "tied_output": tied, "parameters": count_parameters(model),
            "activation": activation}


def _model(checkpoint: dict):
    from nmt_cli.model.checkpoint import model_from_checkpoint

    return model_from_checkpoint(checkpoint)[0]


def _check_loads(checkpoint: dict, folder: Path) -> None:
    """The nmt model built from the mapped weights, strictly: a name or shape the mapping got wrong is one line
    before anything is written."""
    try:
        _model(checkpoint)
    except (RuntimeError, KeyError) as e:
        raise NmtError(f"{folder}: its weights do not map onto nmt's model ({one_line(e)})") from None
