"""What a model attends to: the attention weights of one sentence pair under teacher forcing, recorded by the
model's own attention modules (`MultiHeadAttention.record`), pictures of them (`nmt attention`), and word
alignments derived from the encoder-decoder attention (`nmt translate --alignments`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nmt_cli.errors import NmtError
from nmt_cli.text.languages import is_unspaced
from nmt_cli.textio import atomic_path

from .transformer import Transformer

KINDS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
         "cross": "encoder-decoder attention"}
FORMATS = ("png", "svg", "pdf")
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Zen Hei", "SimHei",
             "Microsoft YaHei", "PingFang SC")


@dataclass
class AttentionMaps:
    """Attention of one sentence pair: `weights[kind]` is (layers, heads, queries, keys) in float32."""

    source: list[str]  # source pieces and </s>: the encoder's positions
    target_in: list[str]  # <s> and the target pieces: the decoder's inputs (self-attention keys)
    target_out: list[str]  # the target pieces and </s>: what each decoder position predicts
    weights: dict[str, Tensor]
    log_probs: list[float]  # of each target_out token under teacher forcing

    def labels(self, kind: str) -> tuple[list[str], list[str]]:
        """(query labels, key labels) of one kind's maps."""
        return {"encoder": (self.source, self.source), "decoder": (self.target_out, self.target_in),
                "cross": (self.target_out, self.source)}[kind]

    def to_json(self) -> dict:
        """The raw weights (layer x head x query x key) and their labels, for people who plot their own."""
        return {"source": self.source, "target_in": self.target_in, "target_out": self.target_out,
                "log_probs": self.log_probs,
                "weights": {kind: [[[[round(x, 6) for x in row] for row in head] for head in layer]
                                   for layer in w.tolist()] for kind, w in self.weights.items()}}


@contextlib.contextmanager
def record_attention(model: Transformer) -> Iterator[dict[str, list[Tensor]]]:
    """While open, every attention module of `model` appends its weights (B, h, Lq, Lk) to the list of its
    kind, layer by layer, in the order the forward pass runs them."""
    records: dict[str, list[Tensor]] = {kind: [] for kind in KINDS}
    modules = ([(layer.self_attn, "encoder") for layer in model.encoder]
               + [(layer.self_attn, "decoder") for layer in model.decoder]
               + [(layer.cross_attn, "cross") for layer in model.decoder])
    for module, kind in modules:
        module.record = records[kind]
    try:
        yield records
    finally:
        for module, _ in modules:
            module.record = None


def attention_maps(model: Transformer, source: Sequence[int], target: Sequence[int], symbols: Sequence[str],
                   bos: int, eos: int, target_symbols: Sequence[str] | None = None) -> AttentionMaps:
    """Teacher-force `target` (ids without </s>) on `source` (ids without </s>) and keep every attention map;
    `target_symbols` names the target's ids where the model has a target vocabulary of its own."""
    device = next(model.parameters()).device
    src = torch.tensor([list(source) + [eos]], device=device)
    prev = torch.tensor([[bos] + list(target)], device=device)
    model.eval()
    with torch.no_grad(), record_attention(model) as records:
        hidden = model(src, prev)
        log_probs = torch.log_softmax(model.logits(hidden).float(), dim=-1)[0]
    gold = list(target) + [eos]
    # Each layer records one map of each of its kinds, in layer order.
    weights = {kind: torch.stack([w[0].cpu() for w in records[kind]]) for kind in KINDS}
    out = target_symbols or symbols
    return AttentionMaps(source=[symbols[i] for i in source] + [symbols[eos]],
                         target_in=[out[bos]] + [out[i] for i in target],
                         target_out=[out[i] for i in target] + [out[eos]], weights=weights,
                         log_probs=[log_probs[i, g].item() for i, g in enumerate(gold)])


# A picture's bounds: tick labels stay readable up to ~40 tokens, a map grows 0.16 inch a token, and drawing
# takes ~10 bytes of memory a pixel (a 46-megapixel PNG peaked at 0.7 GB in all): at most 50 megapixels keeps
# any picture drawn under 1 GB.
PICTURE_DPI = 120
MAX_PICTURE_TOKENS = 120
MAX_PICTURE_PIXELS = 50_000_000


def picture_layout(longest: int, rows: int, columns: int) -> tuple[float, int, int]:
    """(inches per map, width and height in pixels) of a picture of rows x columns maps of `longest` tokens."""
    cell = max(2.2, 0.16 * longest)
    return cell, round(cell * columns * PICTURE_DPI), round((cell * rows + 0.6) * PICTURE_DPI)


def check_picture_size(longest: int, rows: int, columns: int) -> None:
    """One-line refusal of a picture too long to read or too large to draw in bounded memory."""
    hint = "--json FILE alone writes the weights of any length without a picture"
    if longest > MAX_PICTURE_TOKENS:
        raise NmtError(f"the sentence pair has {longest} tokens on its longer side; pictures take at most "
                       f"{MAX_PICTURE_TOKENS} (readable up to ~40): draw a shorter one; {hint}")
    _, width, height = picture_layout(longest, rows, columns)
    if width * height > MAX_PICTURE_PIXELS:
        raise NmtError(f"{rows} x {columns} maps of {longest} tokens make a {width} x {height}-pixel picture, "
                       f"more than {MAX_PICTURE_PIXELS // 1_000_000} megapixels: draw fewer with --layer and "
                       f"--head, or a shorter sentence; {hint}")


def plot_attention(maps: AttentionMaps, out: str | Path, layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, fmt: str | None = None) -> Path:
    """Draw each kind's maps, one row per layer, one column per head plus their mean; returns the file.
    Refuses (`check_picture_size`) a picture longer or larger than its bounds before drawing anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fmt = fmt or out.suffix.lstrip(".").lower() or "png"
    if fmt not in FORMATS:
        raise NmtError(f"{out}: unknown picture format {fmt!r} (use --format png, svg or pdf)")
    import warnings

    from matplotlib import font_manager

    # Chinese or Japanese pieces as tick labels: a CJK font where the system has one (matplotlib falls back
    # through the list glyph by glyph); without one, those glyphs are drawn as boxes, silently.
    installed = {f.name for f in font_manager.fontManager.ttflist}
    fonts = [f for f in CJK_FONTS if f in installed]
    warnings.filterwarnings("ignore", message="Glyph .* missing from")
    n_layers, n_heads = maps.weights["encoder"].shape[:2]
    layers = list(layers) if layers else list(range(n_layers))
    heads = list(heads) if heads else list(range(n_heads))
    columns = len(heads) + (1 if len(heads) > 1 else 0)
    longest = max(len(maps.source), len(maps.target_out))
    rows = len(KINDS) * len(layers)
    check_picture_size(longest, rows, columns)
    cell = picture_layout(longest, rows, columns)[0]
    plt.rcParams["font.family"] = ["DejaVu Sans", *fonts]
    fig, axes = plt.subplots(rows, columns, figsize=(cell * columns, cell * rows + 0.6), squeeze=False)
    font = max(4.0, min(8.0, 220 / max(longest, 1)))
    for k, kind in enumerate(KINDS):
        queries, keys = maps.labels(kind)
        for r, layer in enumerate(layers):
            panels = [(f"head {h + 1}", maps.weights[kind][layer, h]) for h in heads]
            if len(heads) > 1:
                panels.append(("mean", maps.weights[kind][layer, heads].mean(0)))
            for c, (title, w) in enumerate(panels):
                ax = axes[k * len(layers) + r][c]
                ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
                ax.set_title(f"{KINDS[kind]}, layer {layer + 1}, {title}", fontsize=font + 1)
                ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=font)
                ax.set_yticks(range(len(queries)), queries, fontsize=font)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format=fmt, dpi=PICTURE_DPI)
    plt.close(fig)
    return out


def write_json(maps: AttentionMaps, out: str | Path) -> Path:
    """The raw weights as JSON (see `AttentionMaps.to_json`)."""
    out = Path(out)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(maps.to_json()) + "\n", encoding="utf-8")
    return out


# ----------------------------------------------------------------------------------------------- alignments
def by_character(lang: str) -> bool:
    """Whether alignments on a `lang` side count characters (spaces left out) rather than whitespace-separated
    words: for languages written without spaces."""
    return is_unspaced(lang)


def piece_words(pieces: Sequence[str], text: str, surface, characters: bool = False) -> list[int]:
    """For each piece, the index of the whitespace-separated word of `text` it came from (with `characters`,
    of its first character among the text's non-space characters). `surface(piece)` is the piece's characters
    as they appear in the text ('' for none); pieces are matched left to right, and one whose characters
    cannot be found goes with the word before it."""
    chars, words = [], []  # text without spaces, and each character's word
    for w, word in enumerate(text.split()):
        chars.extend(word)
        words.extend([w] * len(word))
    if characters:
        words = list(range(len(chars)))
    flat = "".join(chars)
    cursor, out = 0, []
    for piece in pieces:
        s = surface(piece)
        at = flat.find(s, cursor) if s else -1
        if at < 0:
            out.append(words[min(cursor, len(words)) - 1] if cursor else 0)  # the last matched character's word
            continue
        out.append(words[at])
        cursor = at + len(s)
    return out


def word_alignments(cross: Tensor, source_words: Sequence[int], target_words: Sequence[int]) -> list[tuple[int, int]]:
    """Source-target word pairs (i, j) from one layer's encoder-decoder attention (heads, T + 1, S + 1): each
    target piece is aligned to the source piece it attends to most (the </s> rows and columns left out), and
    pieces to their words. Sorted by target word, then source word."""
    weights = cross.mean(0)[: len(target_words), : len(source_words)]
    if weights.numel() == 0:
        return []
    best = weights.argmax(-1).tolist()
    return sorted({(source_words[s], target_words[t]) for t, s in enumerate(best)}, key=lambda p: (p[1], p[0]))


def format_alignments(pairs: Sequence[tuple[int, int]]) -> str:
    """`i-j` pairs, space-separated, as fast_align and fairseq's --print-alignment print them."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
