"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), section 3.

Shapes in comments: B batch, S source length, T target length, d model width, h heads,
dk = d / h, V vocabulary, N = B * beam rows during beam search.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_cli.errors import NmtError

from .ops import PackedWeight, dropout, linear, relu_dropout


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the model; saved inside every checkpoint."""

    vocab_size: int
    layers: int = 6
    d_model: int = 512
    ffn: int = 2048
    heads: int = 8
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0  # on the FFN's inner ReLU output (fairseq's --activation-dropout)
    pre_norm: bool = False
    max_positions: int = 1024
    pad: int = 0
    head_dim: int | None = None  # d_k = d_v; None: d_model / heads (the paper's, except Table 3 rows A and B)
    learned_positions: bool = False  # learned position embeddings instead of sinusoids (Table 3 row E)
    # Embedding rows padded to a multiple of this: the output layer's product then has aligned widths for
    # tensor cores and vector units (fairseq pads its dictionary to 8). Padding rows stay zero and are never
    # predicted (masked in the loss and the search); exports strip them. 1 for checkpoints from before.
    vocab_multiple: int = 1
    # What models made elsewhere need (`nmt import transformers`); the defaults are nmt's own (section 3.4).
    target_vocab_size: int | None = None  # a target vocabulary of its own; None: the source's
    shared_embeddings: bool = True  # encoder and decoder read one embedding matrix (needs one vocabulary)
    tied_output: bool = True  # the output projection is the decoder's embedding matrix
    output_bias: bool = False  # a fixed bias on the logits (Marian's final_logits_bias); -inf: never a token
    activation: str = "relu"  # the FFN's: relu (eq. 2), gelu or silu
    scale_embedding: bool = True  # embeddings x sqrt(d_model) (section 3.4)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise NmtError(f"unknown activation {self.activation!r} (this nmt knows {', '.join(ACTIVATIONS)})")
        if self.shared_embeddings and self.target_vocab_size not in (None, self.vocab_size):
            raise NmtError("shared source and target embeddings need one vocabulary")

    @property
    def rows(self) -> int:
        """Rows of the (source) embedding matrix: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def target_vocab(self) -> int:
        """Symbols of the target vocabulary, the columns of the logits."""
        return self.target_vocab_size or self.vocab_size

    @property
    def target_rows(self) -> int:
        """Rows of the target embedding and output matrices: target_vocab rounded up as `rows`."""
        return -(-self.target_vocab // self.vocab_multiple) * self.vocab_multiple

    @property
    def dk(self) -> int:
        """d_k = d_v, the width of one head."""
        return self.head_dim or self.d_model // self.heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


# Settings that act only while training: checkpoints that differ in them (a run resumed with another dropout)
# hold the same network, and can be averaged.
TRAINING_ONLY = ("dropout", "attention_dropout", "activation_dropout")


def architecture_differences(a: dict, b: dict) -> list[str]:
    """The fields of two saved configs (older ones read with today's defaults) that define different networks:
    every field but the training-only ones."""
    first, second = asdict(ModelConfig.from_dict(a)), asdict(ModelConfig.from_dict(b))
    return [k for k in first if k not in TRAINING_ONLY and first[k] != second[k]]


PRESETS: dict[str, dict] = {
    "tiny": dict(layers=2, d_model=64, ffn=128, heads=4, dropout=0.1),
    "small": dict(layers=3, d_model=256, ffn=1024, heads=4, dropout=0.3),
    "base": dict(layers=6, d_model=512, ffn=2048, heads=8, dropout=0.1),
    "big": dict(layers=6, d_model=1024, ffn=4096, heads=16, dropout=0.3),
}


# Embedding rows come in multiples of this (`ModelConfig.vocab_multiple`): CUDA's tensor-core tiles fill best
# at 64 (fairseq pads to 8), and on CPU 64 measured as fast as 8 or faster (docs/benchmarks.md); one value for
# every device keeps a checkpoint's shape the same wherever it was trained.
VOCAB_MULTIPLE = 64


def make_config(arch: str, vocab_size: int, pad: int = 0, vocab_multiple: int = VOCAB_MULTIPLE,
                **overrides) -> ModelConfig:
    """A preset's config with the overrides that are not None applied."""
    if arch not in PRESETS:
        raise NmtError(f"unknown --arch {arch!r} (choose from {', '.join(PRESETS)})")
    config = ModelConfig(vocab_size=vocab_size, pad=pad, vocab_multiple=vocab_multiple, **PRESETS[arch])
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if config.head_dim is None and config.d_model % config.heads:
        raise NmtError(f"--d-model {config.d_model} is not divisible by --heads {config.heads} (or give --head-dim)")
    if config.head_dim is not None and config.head_dim < 1:
        raise NmtError(f"--head-dim must be at least 1 (got {config.head_dim})")
    return config


def sinusoidal_positions(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (section 3.5). Shape (length, d)."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return pe


def _fp32_attention_on_cpu(x: Tensor) -> bool:
    """Whether attention over inputs like x runs in fp32: bf16 (or bf16 autocast) on CPU, see `attend`."""
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or torch.is_autocast_enabled("cpu"))


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                       dropout_p: float = 0.0) -> Tensor:
    """softmax(QK^T / sqrt(dk)) V (eq. 1) as matmul, softmax and matmul in q's dtype, or the autocast dtype.

    q (B, h, Lq, dk), k and v (B, h, Lk, dk); `mask` broadcasts to (B, h, Lq, Lk), True where attending;
    `causal` lets query i see keys 0..i. Equals F.scaled_dot_product_attention (up to the random stream of
    its dropout)."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    with torch.autocast(device, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, h, Lq, Lk)
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, -math.inf)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        weights = dropout(torch.softmax(scores, dim=-1), dropout_p, dropout_p > 0)
        return torch.matmul(weights, v)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """softmax(QK^T / sqrt(dk)) in float32 (B, h, Lq, Lk), masked as `explicit_attention` masks it."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1)


class Linear(nn.Linear):
    """nn.Linear through `ops.linear` (oneDNN, with its packed weight, for large inference products on CPU)."""

    packed: PackedWeight | None = None  # see Transformer.pack_weights

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        return linear(x, self.weight, self.bias, relu, self.packed)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..h) W^O (section 3.2.2), via scaled_dot_product_attention; heads of
    `head_dim` (d_k = d_v, default d_model / heads)."""

    def __init__(self, d_model: int, heads: int, dropout: float, head_dim: int | None = None) -> None:
        super().__init__()
        self.heads, self.dk, self.dropout = heads, head_dim or d_model // heads, dropout
        inner = heads * self.dk
        self.in_proj = Linear(d_model, 3 * inner)  # W^Q, W^K, W^V stacked
        self.out_proj = Linear(inner, d_model)
        self.packed_q: PackedWeight | None = None  # W^Q alone (cross-attention), see Transformer.pack_weights
        self.packed_kv: PackedWeight | None = None  # W^K and W^V together
        self.record: list[Tensor] | None = None  # set by attention.record_attention: weights are appended here

    def _split(self, x: Tensor) -> Tensor:  # (B, L, d) -> (B, h, L, dk)
        return x.unflatten(-1, (self.heads, self.dk)).transpose(1, 2)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of self-attention, each (B, h, L, dk)."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        return self._split(q), self._split(k), self._split(v)

    def project_q_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Self-attention queries (B, h, L, dk), and keys and values still stacked as in_proj makes them,
        (B, L, 2d), the layout `KVCache.append` stores."""
        d = self.heads * self.dk
        qkv = self.in_proj(x)
        return self._split(qkv[..., :d]), qkv[..., d:]

    def project_q(self, x: Tensor) -> Tensor:
        d = self.heads * self.dk
        return self._split(linear(x, self.in_proj.weight[:d], self.in_proj.bias[:d], packed=self.packed_q))

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of cross-attention over the encoder output, each (B, h, S, dk)."""
        d = self.heads * self.dk
        k, v = linear(memory, self.in_proj.weight[d:], self.in_proj.bias[d:], packed=self.packed_kv).chunk(2, dim=-1)
        return self._split(k), self._split(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attention(Q, K, V) = softmax(QK^T / sqrt(dk)) V (eq. 1), heads merged and projected. (B, Lq, d)."""
        p = self.dropout if self.training else 0.0
        if self.record is not None:
            # The same product, with its weights kept (B, h, Lq, Lk): `explicit_attention` equals the kernels'
            # attention (tests/test_model.py), and tests/test_attention.py checks the output is unchanged.
            weights = attention_weights(q, k, mask, causal)
            self.record.append(weights)
            out = torch.matmul(weights, v.float()).to(v.dtype)
        elif self.training and _fp32_attention_on_cpu(q):
            # Training in bf16 on CPU: the three ops in bf16 (softmax with float32 arithmetic inside, as
            # fairseq's half-precision attention does) run forward + backward ~2x faster than the fused
            # float32 kernel at translation's short lengths.
            out = explicit_attention(q, k, v, mask, causal, p)
        elif _fp32_attention_on_cpu(q):
            # PyTorch's CPU attention kernels are several times slower in bf16 than in fp32 (forward and
            # backward); the attention itself is cheap next to the projections, so run it in fp32.
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=p,
                                                     is_causal=causal).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (eq. 2)."""

    def __init__(self, d_model: int, ffn: int, activation_dropout: float = 0.0, activation: str = "relu") -> None:
        super().__init__()
        self.w1, self.w2 = Linear(d_model, ffn), Linear(ffn, d_model)
        self.activation_dropout, self.activation = activation_dropout, activation

    def forward(self, x: Tensor) -> Tensor:
        if self.activation != "relu":  # GELU or SiLU, for models made elsewhere: no fused kernel
            inner = ACTIVATIONS[self.activation](self.w1(x))
            return self.w2(dropout(inner, self.activation_dropout, self.training))
        if self.training and self.activation_dropout > 0:
            return self.w2(relu_dropout(self.w1(x), self.activation_dropout, self.training))
        return self.w2(self.w1(x, relu=True))  # ReLU fused into oneDNN's product


class SublayerConnection(nn.Module):
    """LayerNorm(x + Dropout(Sublayer(x))) (section 5.4), or x + Dropout(Sublayer(LayerNorm(x))) pre-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm, self.dropout, self.pre_norm = nn.LayerNorm(d_model), dropout, pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        # Under autocast the sublayer returns bf16/fp16 while the residual stream stays fp32; cast before the
        # add, because mixed-dtype elementwise kernels are several times slower on CPU.
        if self.pre_norm:
            return x + dropout(sublayer(self.norm(x)), self.dropout, self.training).to(x.dtype)
        return self.norm(x + dropout(sublayer(x), self.dropout, self.training).to(x.dtype))


class EncoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout, c.dk)
        self.feed_forward = PositionwiseFeedForward(c.d_model, c.ffn, c.activation_dropout, c.activation)
        self.sublayer = nn.ModuleList(SublayerConnection(c.d_model, c.dropout, c.pre_norm) for _ in range(2))

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn.attend(*self.self_attn.project_qkv(y), mask=src_mask))
        return self.sublayer[1](x, self.feed_forward)


def attention_dtype(x: Tensor) -> torch.dtype:
    """The dtype `MultiHeadAttention.attend` computes in for inputs like x (fp32 for bf16 on CPU)."""
    device = x.device.type
    if _fp32_attention_on_cpu(x):
        return torch.float32
    if device != "cpu" and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class CachePool:
    """Flat CPU buffers that `KVCache` reuses from one search to the next.

    A fresh buffer of 50-200 MB is mapped page by page as a search first writes it, one page fault per 4 KB;
    reused ones are mapped already (beam search at batch 64: ~240k faults per 1,000 sentences fewer, ~5%
    faster, measured on the 2-core AMD EPYC). Keeps at most `keep` buffers, the largest; other devices
    allocate as usual (CUDA's caching allocator already reuses memory).
    """

    def __init__(self, keep: int = 2, max_bytes: int | None = None) -> None:
        self.keep = keep
        self.max_bytes = max_bytes  # kept buffers' bytes at most (a server's ceiling); None: no ceiling
        self.free: list[Tensor] = []  # largest first
        self._lock = threading.Lock()  # one translator may search on several threads at once

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer of at least `numel` elements: the smallest kept one that fits, else a new one."""
        if device.type == "cpu":
            with self._lock:
                for i in reversed(range(len(self.free))):
                    if self.free[i].dtype == dtype and self.free[i].numel() >= numel:
                        return self.free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffers: list[Tensor]) -> None:
        """Keep `buffers` for later searches (CPU only, at most `keep` in all, the largest that fit within
        `max_bytes` together); the others are released."""
        with self._lock:
            candidates = sorted(self.free + [b for b in buffers if b.device.type == "cpu"],
                                key=lambda b: b.numel() * b.element_size(), reverse=True)
            kept, total = [], 0
            for b in candidates:
                size = b.numel() * b.element_size()
                if len(kept) < self.keep and (self.max_bytes is None or total + size <= self.max_bytes):
                    kept.append(b)
                    total += size
            self.free = kept

    def kept_bytes(self) -> int:
        """Bytes of the buffers kept for later searches."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self.free)


def keep_rows(x: Tensor, order: Tensor) -> Tensor:
    """x[order] along dim 0, in place: only the rows not already at their place are copied (the rows that
    stay are read before any is written). Returns the view x[:len(order)]."""
    n = order.shape[0]
    moved = (order != torch.arange(n, device=order.device)).nonzero().squeeze(1)
    if moved.numel():
        x.index_copy_(0, moved, x.index_select(0, order[moved]))
    return x[:n]


class KVCache:
    """Self-attention keys and values of every decoder layer for B sentences of up to `beam` hypotheses each,
    preallocated: (B, max_len * beam, layers, 2, h, dk), the `beam` slots of step 0, then those of step 1, ...

    A hypothesis writes its keys and values into its own slot of the current step, and they stay there: beam
    reordering does not copy the cache. Instead each row keeps an ancestry mask over its sentence's slots
    (the slots of the hypotheses it descends from, one per step), and self-attention runs per sentence: its
    `beam` queries over all its slots, each query masked to its own ancestry. The same keys as a per-row
    cache, read once per sentence and step; only the (N, max_len * beam) mask is reordered. When sentences
    finish, the ones that take their places are copied there (`keep_rows`). With a `pool`, the buffer comes
    from it, and `release` gives it back.
    """

    def __init__(self, sentences: int, beam: int, layers: int, heads: int, max_len: int, dk: int,
                 dtype: torch.dtype, device: torch.device, pool: CachePool | None = None) -> None:
        shape = (sentences, max_len * beam, layers, 2, heads, dk)
        self.pool, numel = pool, math.prod(shape)
        self.flat = pool.take(numel, dtype, device) if pool else torch.empty(numel, dtype=dtype, device=device)
        self.buffer = self.flat[:numel].view(shape)
        # Row r's slots: the first (length + 1) * beam columns are in use.
        self.ancestry = torch.zeros(sentences * beam if beam > 1 else 0, max_len * beam, dtype=torch.bool,
                                    device=device)
        self.sentences, self.beam, self.width = sentences, beam, beam  # width: rows (hypotheses) per sentence
        self.length = 0  # steps filled
        self._eye: dict[int, Tensor] = {}  # width -> (width, width): a sentence's row j owns its slot j

    def release(self) -> None:
        """Give the buffer back to the pool (the cache is unusable afterwards)."""
        if self.pool:
            self.pool.give([self.flat])
        self.flat = self.buffer = None  # type: ignore[assignment]

    def start_step(self, rows: int) -> None:
        """Begin a step of `rows` rows, `rows / sentences` per sentence (beam search's first step may decode one
        row per sentence; `reorder` fans out): each row's slot of this step joins its ancestry."""
        if rows % self.sentences or rows // self.sentences > self.beam:
            raise ValueError(f"decoding {rows} rows with a cache of {self.sentences} sentences x {self.beam}; "
                             "reorder it first")
        width, t = rows // self.sentences, self.length
        if t == 0 and width < self.beam:  # slots never written must still hold finite numbers (masked, x 0)
            self.buffer[:, width : self.beam].zero_()
        self.width = width
        if self.beam == 1:  # one hypothesis per sentence: it attends to every slot, no ancestry to keep
            return
        if width not in self._eye:
            self._eye[width] = torch.eye(width, dtype=torch.bool, device=self.ancestry.device)
        own = self.ancestry[:rows, t * self.beam : t * self.beam + width].view(self.sentences, width, width)
        own.copy_(self._eye[width])

    def append(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store one layer's keys and values of the current step, kv (B, width, 2 * d) as in_proj stacks them.

        Returns that layer's keys and values of every slot so far, each (B, h, slots, dk), and the attention
        mask (B, 1, width, slots), True where a row may attend (None with one hypothesis per sentence).
        """
        b, t, beam = self.sentences, self.length, self.beam
        slots = (t + 1) * beam
        cache = self.buffer[:b, :slots, layer]  # (B, slots, 2, h, dk)
        cache[:, t * beam : t * beam + self.width] = kv.view(b, self.width, *cache.shape[2:])
        mask = None if beam == 1 else self.ancestry[: b * self.width, :slots].view(b, 1, self.width, slots)
        return cache[:, :, 0].transpose(1, 2), cache[:, :, 1].transpose(1, 2), mask

    def advance(self) -> None:
        """Mark the current step as filled (after every layer appended)."""
        self.length += 1

    def reorder(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Row i continues the hypothesis of row `rows[i]` (beam search's backpointers, always within one
        sentence); with `sentences`, only those sentences (B',) remain, in that order."""
        if self.beam > 1:
            self.ancestry = self.ancestry.index_select(0, rows)
        if sentences is not None:
            keep_rows(self.buffer[: self.sentences, : self.length * self.beam], sentences)
            self.sentences = sentences.shape[0]


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout, c.dk)
        self.cross_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout, c.dk)
        self.feed_forward = PositionwiseFeedForward(c.d_model, c.ffn, c.activation_dropout, c.activation)
        self.sublayer = nn.ModuleList(SublayerConnection(c.d_model, c.dropout, c.pre_norm) for _ in range(3))

    def forward(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor, cache: KVCache | None = None,
                layer: int = 0) -> Tensor:
        """x (N, T, d); memory_kv (B, h, S, dk) each with N = B * beam. With a cache, T == 1 and `layer` is
        this layer's index in it."""

        def self_attention(y: Tensor) -> Tensor:
            if cache is None:
                return self.self_attn.attend(*self.self_attn.project_qkv(y), causal=True)
            # Per sentence: its hypotheses' queries over its cached slots, each masked to its own ancestry.
            q, kv = self.self_attn.project_q_kv(y.view(cache.sentences, -1, y.shape[-1]))  # q (B, h, width, dk)
            k, v, mask = cache.append(layer, kv)
            return self.self_attn.attend(q, k, v, mask=mask).view(y.shape)

        def cross_attention(y: Tensor) -> Tensor:
            k, v = memory_kv
            beam = y.shape[0] // k.shape[0]
            if beam == 1:
                return self.cross_attn.attend(self.cross_attn.project_q(y), k, v, mask=src_mask)
            # Beam search: the `beam` single-step queries of a sentence become that sentence's query
            # sequence, so the encoder keys/values are never copied per hypothesis.
            q = self.cross_attn.project_q(y.reshape(k.shape[0], beam, -1))  # (B, h, beam, dk)
            return self.cross_attn.attend(q, k, v, mask=src_mask).reshape(y.shape)

        x = self.sublayer[0](x, self_attention)
        x = self.sublayer[1](x, cross_attention)
        return self.sublayer[2](x, self.feed_forward)


class DecoderState:
    """Everything incremental decoding keeps between steps: cross-attention keys/values and self-attention caches."""

    def __init__(self, memory_kv: list[tuple[Tensor, Tensor]], src_mask: Tensor, cache: KVCache) -> None:
        self.memory_kv, self.src_mask, self.cache = memory_kv, src_mask, cache
        self.step = 0

    def release(self) -> None:
        """Return the cache's buffers to its pool; the state is unusable afterwards."""
        self.cache.release()

    def reorder(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Reorder hypotheses to `rows` (N',); when sentences finished, keep only `sentences` (B',)."""
        self.cache.reorder(rows, sentences)
        if sentences is not None:
            self.memory_kv = [(keep_rows(k, sentences), keep_rows(v, sentences)) for k, v in self.memory_kv]
            self.src_mask = self.src_mask.index_select(0, sentences)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with one embedding matrix for source, target and output (section 3.4), or, for
    models made elsewhere, a target embedding and an output projection of their own (`ModelConfig`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed = _padded_embedding(c.vocab_size, c.rows, c.d_model, c.pad)
        # Models made elsewhere may keep a target embedding, an output projection and a logit bias of their
        # own; nmt's share one matrix (section 3.4) and have none of these.
        self.target_embed = (None if c.shared_embeddings else
                             _padded_embedding(c.target_vocab, c.target_rows, c.d_model, c.pad))
        self.output_weight = None if c.tied_output else nn.Parameter(torch.empty(c.target_rows, c.d_model))
        self.register_buffer("logit_bias", torch.zeros(c.target_rows) if c.output_bias else None)
        self.packed_output: PackedWeight | None = None  # the embedding matrix as the output layer's weight
        # Sinusoids (section 3.5), or learned position embeddings (Table 3 row E: "nearly identical results").
        self.register_buffer("positions", sinusoidal_positions(c.max_positions, c.d_model), persistent=False)
        self.position_embed = nn.Parameter(torch.empty(c.max_positions, c.d_model)) if c.learned_positions else None
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.layers))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        # Pre-norm stacks end in a LayerNorm of their own; post-norm ones are already normalized.
        self.encoder_norm = nn.LayerNorm(c.d_model) if c.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.d_model) if c.pre_norm else nn.Identity()
        self.compiled_layers: tuple[Callable, Callable] | None = None  # see compile_layers
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, N(0, d^-1/2) embeddings (so scaled embeddings have unit variance)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        c = self.config
        with torch.no_grad():
            nn.init.normal_(self.embed.weight[: c.vocab_size], mean=0.0, std=c.d_model**-0.5)
            self.embed.weight[c.vocab_size :].zero_()  # padding rows (`ModelConfig.rows`)
            self.embed.weight[c.pad].zero_()
            for matrix in (self.target_embed.weight if self.target_embed is not None else None, self.output_weight):
                if matrix is not None:
                    nn.init.normal_(matrix[: c.target_vocab], mean=0.0, std=c.d_model**-0.5)
                    matrix[c.target_vocab :].zero_()
                    matrix[c.pad].zero_()
        if self.position_embed is not None:  # as fairseq's learned positions: N(0, d^-1/2)
            nn.init.normal_(self.position_embed, mean=0.0, std=self.config.d_model**-0.5)

    def compile_layers(self, backend: str = "inductor") -> Transformer:
        """Run training's encoder and decoder layers through torch.compile (dynamic shapes, for the varying
        sentence lengths): each sublayer's dropout, cast, residual add and LayerNorm become one fused kernel and
        the element-wise operations of attention and the FFN fewer. One compiled function per layer type serves
        every layer of the stack; compilation happens at the first update. Decoding and evaluation stay eager.
        `backend`: torch.compile's (inductor generates the fused kernels; aot_eager only traces, for tests)."""
        self.compiled_layers = (torch.compile(EncoderLayer.forward, dynamic=True, backend=backend),
                                torch.compile(DecoderLayer.forward, dynamic=True, backend=backend))
        return self

    def pack_weights(self) -> Transformer:
        """Keep oneDNN's packed copies of the weights for CPU inference products (`ops.PackedWeight`: 5-10%
        faster beam search at 64 sentences, more on few rows), for a model whose weights no longer change;
        each copy is made on first use and follows in-place writes that PyTorch counts (`load_state_dict`).
        Fused optimizers' updates are not counted: `train()` drops the copies."""
        self._set_packing(True)
        return self

    def train(self, mode: bool = True) -> Transformer:
        if mode:
            self._set_packing(False)
        return super().train(mode)

    def _set_packing(self, on: bool) -> None:
        def make() -> PackedWeight | None:
            return PackedWeight() if on else None

        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = make()
            elif isinstance(module, MultiHeadAttention):
                module.packed_q, module.packed_kv = make(), make()
        self.packed_output = make()

    @property
    def output_matrix(self) -> Tensor:
        """The output projection's weight (target_rows, d): the decoder's embedding matrix unless untied."""
        if self.output_weight is not None:
            return self.output_weight
        return (self.target_embed if self.target_embed is not None else self.embed).weight

    def _embed(self, tokens: Tensor, offset: int = 0, target: bool = False) -> Tensor:
        c = self.config
        length = tokens.shape[1]
        if offset + length > c.max_positions:
            raise NmtError(f"sequence of {offset + length} tokens exceeds the model's {c.max_positions} positions")
        positions = self.position_embed if self.position_embed is not None else self.positions
        table = self.target_embed if target and self.target_embed is not None else self.embed
        x = table(tokens)
        if c.scale_embedding:
            x = x * math.sqrt(c.d_model)
        x = x + positions[offset : offset + length]
        return dropout(x, c.dropout, self.training)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> encoder output (B, S, d) and key mask (B, 1, 1, S), True where not padding."""
        src_mask = (src != self.config.pad)[:, None, None, :]
        x = self._embed(src)
        compiled = self.compiled_layers is not None and self.training
        for layer in self.encoder:
            x = self.compiled_layers[0](layer, x, src_mask) if compiled else layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def memory_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Cross-attention keys and values of every decoder layer, computed once per sentence."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    def decode(self, prev_output: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced decoder: prev_output (B, T) -> hidden states (B, T, d)."""
        x = self._embed(prev_output, target=True)
        compiled = self.compiled_layers is not None and self.training
        for layer, kv in zip(self.decoder, self.memory_kv(memory)):
            x = self.compiled_layers[1](layer, x, kv, src_mask) if compiled else layer(x, kv, src_mask)
        return self.decoder_norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Output projection (the shared embedding matrix, unless untied): (..., d) -> (..., V), the padding rows
        left out."""
        logits = linear(hidden, self.output_matrix, self.logit_bias, packed=self.packed_output)
        c = self.config
        return logits[..., : c.target_vocab] if c.target_rows > c.target_vocab else logits

    def forward(self, src: Tensor, prev_output: Tensor) -> Tensor:
        """Decoder hidden states (B, T, d) for teacher forcing; apply `logits` to the positions you need."""
        memory, src_mask = self.encode(src)
        return self.decode(prev_output, memory, src_mask)

    def start_decoding(self, memory: Tensor, src_mask: Tensor, beam: int, max_len: int,
                       pool: CachePool | None = None) -> DecoderState:
        """Incremental decoding state for B sentences with up to `beam` hypotheses each and `max_len` steps;
        its cache's buffers come from `pool` when given (see `DecoderState.release`).

        The first step decodes B * beam rows, or B (one per sentence) for `reorder` to fan out to B * beam.
        """
        c = self.config
        # Keys and values are stored in the dtype attention computes in, so no step converts them again.
        dtype = attention_dtype(memory)
        cache = KVCache(memory.shape[0], beam, c.layers, c.heads, max_len, c.dk, dtype, memory.device, pool)
        memory_kv = [(k.to(dtype), v.to(dtype)) for k, v in self.memory_kv(memory)]
        return DecoderState(memory_kv, src_mask, cache)

    def decode_step(self, tokens: Tensor, state: DecoderState) -> Tensor:
        """One decoder step: tokens (N,) of the current position -> decoder output (N, d); `logits` of it
        scores the next token."""
        x = self._embed(tokens[:, None], offset=state.step, target=True)  # (N, 1, d)
        state.cache.start_step(tokens.shape[0])
        for i, (layer, kv) in enumerate(zip(self.decoder, state.memory_kv)):
            x = layer(x, kv, state.src_mask, state.cache, i)
        state.cache.advance()
        state.step += 1
        return self.decoder_norm(x[:, 0])


def _padded_embedding(symbols: int, rows: int, d_model: int, pad: int) -> nn.Embedding:
    """An embedding of `symbols` rows grown to `rows` (`ModelConfig.rows`): growing it after construction
    draws the same random numbers as an unpadded one."""
    embed = nn.Embedding(symbols, d_model, padding_idx=pad)
    if rows > symbols:
        embed.weight = nn.Parameter(torch.cat([embed.weight.data, torch.zeros(rows - symbols, d_model)]))
        embed.num_embeddings = rows
    return embed


def padding_parameters(config: ModelConfig) -> int:
    """The weights of the embeddings' padding rows (`ModelConfig.rows`): zero, never used, left out by exports."""
    c = config
    target = (0 if c.shared_embeddings else 1) + (0 if c.tied_output else 1)
    return (c.rows - c.vocab_size) * c.d_model + target * (c.target_rows - c.target_vocab) * c.d_model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (the shared embedding counted once), the padding rows left out:
    the count of the same model without them, as its exports hold it."""
    config = getattr(model, "config", None)
    return sum(p.numel() for p in model.parameters()) - (padding_parameters(config) if config else 0)
