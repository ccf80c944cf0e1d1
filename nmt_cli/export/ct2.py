"""CTranslate2: export an nmt checkpoint to a self-contained model folder, and translate with it.

The folder holds CTranslate2's `model.bin` and vocabulary, and `nmt.json`, `vocab.txt` and `bpe.codes` (or
`spm.model`) for exactly nmt's pre- and post-processing. Translating with it imports neither torch nor the model code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nmt_cli.decode.pipeline import Hyp, TextTranslator, default_workers, stored_decoding
from nmt_cli.decode.sampling import Sampling
from nmt_cli.errors import NmtError
from nmt_cli.text.segment import segmenter_from, segmenter_of
from nmt_cli.text.vocab import Vocabulary
from nmt_cli.textio import check_replaceable, export_kind, mark_export, publish_directory, staging_directory

FORMAT = "nmt-ctranslate2/1"
CONSTRAINTS_REFUSED = ("--constraints needs nmt's own beam search (CTranslate2 has no lexical constraints): give "
                       "the checkpoint (.pt), not an exported folder or --engine ctranslate2")
INSTALL_HINT = "CTranslate2 is not installed; install it with: pip install -e '.[ct2]' (or pip install ctranslate2)"
# Weight types in the words `--precision` uses (fp32, bf16, fp16), int8 for the quantized ones -> CTranslate2's names
# (accepted too).
QUANTIZATIONS = {"fp32": "float32", "int8": "int8", "int8_fp32": "int8_float32", "bf16": "bfloat16",
                 "int8_bf16": "int8_bfloat16", "fp16": "float16", "int8_fp16": "int8_float16"}


def quantization_name(name: str) -> str:
    """The nmt name of a weight type given in either vocabulary ('float32' -> 'fp32'); one line for others."""
    if name in QUANTIZATIONS:
        return name
    for nmt_name, ct2_name in QUANTIZATIONS.items():
        if name == ct2_name:
            return nmt_name
    raise NmtError(f"unknown --quantization {name!r} (choose from {', '.join(QUANTIZATIONS)})")


def _ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    return ctranslate2


def ct2_tokens(vocab: Vocabulary) -> list[str]:
    """The vocabulary as CTranslate2 names it: "<blank>" for the padding entry (as its fairseq converter does;
    CTranslate2 pads internally)."""
    return ["<blank>" if i == vocab.pad else s for i, s in enumerate(vocab.symbols)]


def build_spec(state: dict) -> Any:
    """A `ctranslate2.specs.TransformerSpec` holding the weights of an nmt checkpoint's model."""
    _ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    from nmt_cli.model.checkpoint import model_from_checkpoint, target_vocabulary
    from nmt_cli.model.transformer import sinusoidal_positions

    from .hf import output_layer

    model, vocab = model_from_checkpoint(state)
    target_vocab = target_vocabulary(state)
    c = model.config
    if c.dk * c.heads != c.d_model:
        raise NmtError(f"heads of {c.dk} x {c.heads} do not make up d_model {c.d_model} (--head-dim): CTranslate2's "
                       "Transformer cannot hold this model")
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "silu": common_spec.Activation.SWISH}[c.activation]
    spec = transformer_spec.TransformerSpec.from_config(c.layers, c.heads, pre_norm=c.pre_norm, activation=activation)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    # without padding rows (`ModelConfig.rows`); a model imported from elsewhere may have a target embedding, an
    # output projection and a logit bias of its own
    source, target, output, bias = (None if t is None else t.numpy() for t in output_layer(model, c.rows))
    d = c.d_model
    # The paper's sinusoids interleave sin and cos (section 3.5); CTranslate2's built-in ones are concatenated,
    # so the exact table is stored (or the learned one). Row 0 is the first token's position, as in nmt.
    positions = (weights["position_embed"] if c.learned_positions
                 else sinusoidal_positions(c.max_positions, d).numpy())

    def linear(target: Any, prefix: str, rows: slice = slice(None)) -> None:
        target.weight = weights[f"{prefix}.weight"][rows]
        target.bias = weights[f"{prefix}.bias"][rows]

    def norm(target: Any, prefix: str) -> None:
        target.gamma, target.beta = weights[f"{prefix}.weight"], weights[f"{prefix}.bias"]

    for side, stack, table in (("encoder", spec.encoder, source), ("decoder", spec.decoder, target)):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = table
        stack.scale_embeddings = c.scale_embedding  # x sqrt(d_model), section 3.4
        stack.position_encodings.encodings = positions
        if c.pre_norm:
            norm(stack.layer_norm, f"{side}_norm")
    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.in_proj")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.sublayer.0.norm")
        linear(layer.ffn.linear_0, f"{p}.feed_forward.w1")
        linear(layer.ffn.linear_1, f"{p}.feed_forward.w2")
        norm(layer.ffn.layer_norm, f"{p}.sublayer.1.norm")
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.in_proj")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.sublayer.0.norm")
        linear(layer.attention.linear[0], f"{p}.cross_attn.in_proj", slice(0, d))  # queries
        linear(layer.attention.linear[1], f"{p}.cross_attn.in_proj", slice(d, 3 * d))  # keys and values
        linear(layer.attention.linear[2], f"{p}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{p}.sublayer.1.norm")
        linear(layer.ffn.linear_0, f"{p}.feed_forward.w1")
        linear(layer.ffn.linear_1, f"{p}.feed_forward.w2")
        norm(layer.ffn.layer_norm, f"{p}.sublayer.2.norm")
    spec.decoder.projection.weight = output  # nmt's: the tied embedding matrix, no bias
    if bias is not None:  # -inf (a column that is no token) as a large finite number, for every compute type
        spec.decoder.projection.bias = bias.clip(min=-1e30)
    spec.register_source_vocabulary(ct2_tokens(vocab))
    spec.register_target_vocabulary(ct2_tokens(target_vocab))
    spec.config.add_source_eos = True  # nmt's sources end in </s>; decoding starts from <s>
    spec.config.decoder_start_token = "<s>"
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    return spec


def parameter_count(weights: dict) -> int:
    """The model's parameters in a state dict, each tensor counted once however many names share it."""
    seen: dict[int, int] = {}
    for tensor in weights.values():
        if tensor.is_floating_point():
            seen[tensor.data_ptr()] = tensor.numel()
    return sum(seen.values())


def export_ctranslate2(checkpoint: str | Path, out: str | Path, quantization: str = "fp32",
                       force: bool = False) -> Path:
    """Write an nmt checkpoint as a self-contained CTranslate2 model folder; returns the folder."""
    ctranslate2 = _ctranslate2()
    from ctranslate2.converters.converter import Converter

    from nmt_cli.model.checkpoint import load_checkpoint, require_keys
    from nmt_cli.model.transformer import ModelConfig, padding_parameters

    quantization = quantization_name(quantization)
    out = Path(out)
    check_replaceable(out, force, "an nmt export for ctranslate2", lambda f: export_kind(f) == "ctranslate2")
    state = require_keys(load_checkpoint(checkpoint), checkpoint)
    segmenter_of(state, checkpoint)  # a tokenizer it cannot rebuild is refused before anything is written
    spec = build_spec(state)

    class _Spec(Converter):
        def _load(self) -> Any:
            return spec

    padding = padding_parameters(ModelConfig.from_dict(state["config"]))  # the export leaves those rows out
    with staging_directory(out) as staging:
        model_dir = staging / "model"  # CTranslate2 writes a folder of its own
        _Spec().convert(str(model_dir), quantization=None if quantization == "fp32" else QUANTIZATIONS[quantization])
        meta = {"format": FORMAT, "source_lang": state["source_lang"], "target_lang": state["target_lang"],
                "tokenizer": state.get("tokenizer") or {}, "max_positions": state["config"]["max_positions"],
                "quantization": quantization, "exported_from": str(checkpoint),
                "parameters": parameter_count(state["model"]) - padding,
                "layers": state["config"]["layers"],
                "d_model": state["config"]["d_model"],
                "decoding": stored_decoding(state, checkpoint),
                **({"target_token": state["target_token"]} if state.get("target_token") else {}),
                "ctranslate2_version": ctranslate2.__version__}
        (model_dir / "nmt.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (model_dir / "vocab.txt").write_text("".join(s + "\n" for s in state["vocab"]), encoding="utf-8")
        if state.get("target_vocab"):
            (model_dir / "target-vocab.txt").write_text("".join(s + "\n" for s in state["target_vocab"]),
                                                        encoding="utf-8")
        if state.get("target_sentencepiece"):
            (model_dir / "target-spm.model").write_bytes(state["target_sentencepiece"])
        if state.get("sentencepiece"):
            (model_dir / "spm.model").write_bytes(state["sentencepiece"])
        else:
            (model_dir / "bpe.codes").write_text(state["bpe_codes"], encoding="utf-8")
        mark_export(model_dir, "ctranslate2")
        publish_directory(model_dir, out)
    return out


class CTranslate2Translator(TextTranslator):
    """Translates with an exported CTranslate2 folder, with nmt's tokenization, BPE, batching and length rule.

    The length penalty is CTranslate2's own (score / |Y|^alpha), not nmt's GNMT penalty; with --lenpen 0 both
    rank hypotheses by plain log-probability.

    nmt's length limit is per sentence and CTranslate2's per call. A batch runs as one call under its largest
    limit, and the few sentences whose search may have reached their own limit run again under it (see
    `search`); without a length penalty (where that check does not hold) as one call per distinct limit,
    which costs CTranslate2 ~20% of its speed on Multi30k's sorted batches of 64 (45 calls instead of 16 for
    the 1,000 test sentences). `per_sentence_limits = False` runs one call per batch under the batch's largest
    limit and nothing again, as CTranslate2's own users would (benchmarks use it for CTranslate2's native
    speed): the same output unless a sentence's search reaches its own limit.
    """

    constraints_refusal = CONSTRAINTS_REFUSED

    per_sentence_limits = True

    def __init__(self, translator: Any, vocab: Vocabulary, segmenter: Any, meta: dict, workers: int = 1,
                 target_vocab: Vocabulary | None = None) -> None:
        super().__init__(vocab, segmenter, meta["source_lang"], meta["target_lang"], int(meta["max_positions"]),
                         workers, target_vocab)
        self.translator = translator
        self.pieces, self.target_pieces = ct2_tokens(vocab), ct2_tokens(self.target_vocab)
        self.target_token = meta.get("target_token", "")
        self.meta = meta

    def describe(self) -> dict:
        return {**super().describe(), **{k: self.meta.get(k) for k in ("parameters", "layers", "d_model")},
                "precision": self.meta.get("quantization")}

    @classmethod
    def from_dir(cls, path: str | Path, device: str | None = None, threads: int = 0,
                 workers: int = 1) -> CTranslate2Translator:
        """Load a folder written by `export_ctranslate2`, to search `workers` batches at once (0: chosen by
        `pipeline.default_workers`) on `threads` CPU threads in all (0: up to 4)."""
        path = Path(path)
        try:
            meta = json.loads((path / "nmt.json").read_text(encoding="utf-8"))
            symbols = (path / "vocab.txt").read_text(encoding="utf-8").splitlines()
            tokenizer = meta.get("tokenizer") or {}
            own_target = path / "target-vocab.txt"
            target_symbols = own_target.read_text(encoding="utf-8").splitlines() if own_target.exists() else None
            target_spm = path / "target-spm.model"
            if tokenizer.get("name") == "sentencepiece":
                segmenter = segmenter_from(tokenizer, "", (path / "spm.model").read_bytes(),
                                           target_spm.read_bytes() if target_spm.exists() else None)
            else:
                segmenter = segmenter_from(tokenizer, (path / "bpe.codes").read_text(encoding="utf-8"), None)
        except FileNotFoundError as e:
            raise NmtError(f"{e.filename}: missing; {path} is not a folder written by `nmt export`") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise NmtError(f"{path / 'nmt.json'}: not valid JSON ({e})") from None
        if meta.get("format") != FORMAT:
            raise NmtError(f"{path / 'nmt.json'}: format {meta.get('format')!r}, expected {FORMAT!r}")
        device = device or "cpu"
        if device not in ("cpu", "cuda"):
            raise NmtError(f"--device {device}: an exported model runs on cpu or cuda")
        ctranslate2 = _ctranslate2()
        if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
            raise NmtError("--device cuda, but CTranslate2 sees no CUDA device")
        if threads < 0:
            raise NmtError(f"--threads must be 0 (up to 4) or more (got {threads})")
        threads = threads or min(4, os.cpu_count() or 1)
        workers = workers or default_workers(device, threads)
        # Each of CTranslate2's `inter_threads` workers runs one batch at a time, on `intra_threads` threads.
        translator = ctranslate2.Translator(str(path), device=device, compute_type="default", inter_threads=workers,
                                            intra_threads=max(1, threads // workers))
        loaded = cls(translator, Vocabulary(symbols), segmenter, meta, workers,
                     Vocabulary(target_symbols) if target_symbols else None)
        loaded.decoding = stored_decoding(meta, path / "nmt.json")
        return loaded

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | None = None, threads: int = 0,
                        workers: int = 1) -> CTranslate2Translator:
        """Run an nmt checkpoint with CTranslate2: exported (float32) to a temporary folder, loaded, removed."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="nmt-ct2-") as tmp:
            return cls.from_dir(export_ctranslate2(path, Path(tmp) / "model"), device=device, threads=threads,
                                workers=workers)

    def search(self, sources: list[list[int]], beam: int, lenpen: float, max_len_a: float, max_len_b: int,
               greedy: bool, nbest: int, sampling: Sampling | None = None, no_repeat_ngram: int = 0,
               prefixes: list[list[int]] | None = None, constraints: list[list[list[int]]] | None = None,
               unmet: list[int] | None = None) -> list[list[Hyp]]:
        if constraints is not None and any(constraints):
            raise NmtError(CONSTRAINTS_REFUSED)
        limits = [self.max_output_tokens(len(ids), max_len_a, max_len_b) for ids in sources]
        if prefixes:  # a prefix is always whole, as nmt's own search keeps it
            limits = [max(limit, len(p)) for limit, p in zip(limits, prefixes)]
        extra = {"no_repeat_ngram_size": no_repeat_ngram, "prefixes": prefixes}
        out: list[list[Hyp]] = [[] for _ in sources]
        todo = list(range(len(sources)))
        longest = max(limits)
        if sampling is not None:
            # CTranslate2 draws from generators of its own threads, which a seed set from Python does not reach:
            # its samples do not repeat (nmt's own engine's do).
            extra["sampling"] = sampling
        if not self.per_sentence_limits:
            self._translate(sources, todo, longest, beam, lenpen, greedy, nbest, out, **extra)
            return out
        if len(set(limits)) > 1 and (greedy or lenpen != 0) and sampling is None:
            # One call under the batch's largest limit, and again under its own limit for each sentence whose
            # search may have reached that limit. CTranslate2 ends a sentence's search at the first step where
            # it holds `beam` finished hypotheses (with a length penalty; greedy: at </s>), registering at least
            # one then, and of all it registered returns the best `beam`, which always include one of that last
            # step's. So when every returned hypothesis is at least 2 tokens shorter than the sentence's own
            # limit, its search ended before that limit's last step, exactly as a call under its own limit would.
            # (Without a length penalty it may stop once its top hypothesis finishes: no such guarantee.)
            self._translate(sources, todo, longest, beam, lenpen, greedy, beam if not greedy else 1, out, **extra)
            todo = [r for r in todo if limits[r] < longest and max(len(t) for t, _ in out[r]) >= limits[r] - 1]
            for r in range(len(sources)):
                del out[r][nbest:]
        groups: dict[int, list[int]] = {}
        for r in todo:
            groups.setdefault(limits[r], []).append(r)
        for limit, rows in groups.items():
            self._translate(sources, rows, limit, beam, lenpen, greedy, nbest, out, **extra)
        return out

    def _translate(self, sources: list[list[int]], rows: list[int], limit: int, beam: int, lenpen: float,
                   greedy: bool, nbest: int, out: list[list[Hyp]], sampling: Sampling | None = None,
                   no_repeat_ngram_size: int = 0, prefixes: list[list[int]] | None = None) -> None:
        """CTranslate2's search over `rows` of sources under one length limit; hypotheses into `out`. With
        `sampling`, each source is repeated `nbest` times, one draw each."""
        batch = [[self.pieces[i] for i in sources[r]] for r in rows]
        prefix = [[self.target_pieces[i] for i in prefixes[r]] or None for r in rows] if prefixes else None
        options: dict = dict(beam_size=1 if greedy else beam, num_hypotheses=1 if greedy else nbest,
                             length_penalty=0.0 if greedy else lenpen)
        copies = 1
        if sampling is not None:
            copies = nbest
            batch = [s for s in batch for _ in range(copies)]
            prefix = [p for p in prefix for _ in range(copies)] if prefix else None
            options = dict(beam_size=1, num_hypotheses=1, length_penalty=0.0, sampling_topk=sampling.topk,
                           sampling_topp=sampling.topp, sampling_temperature=sampling.temperature)
        results = self.translator.translate_batch(
            batch, target_prefix=prefix, **options, no_repeat_ngram_size=no_repeat_ngram_size,
            max_decoding_length=limit,  # output tokens before </s>, as nmt counts them
            return_scores=True, suppress_sequences=[["<s>"], ["<blank>"]], return_end_token=False)
        index = self.target_vocab.index
        for j, r in enumerate(rows):
            out[r] = [([index[t] for t in tokens], score) for result in results[j * copies : (j + 1) * copies]
                      for tokens, score in zip(result.hypotheses, result.scores)]

    def token_log_probs(self, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each target (ids without </s>; the </s> is scored last)."""
        results = self.translator.score_batch([[self.pieces[i] for i in s] for s in sources],
                                              [[self.target_pieces[i] for i in t] for t in targets])
        return [list(r.log_probs) for r in results]
