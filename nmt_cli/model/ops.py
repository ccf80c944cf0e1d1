"""Hot-path building blocks, written for speed: dropout, the fused output-projection loss, the output
layer of a decoding step (log-softmax + a top-k that ranks group maxima first), and inference matrix
products on oneDNN with packed weights (`linear`, `PackedWeight`).

Profiling a CPU training step showed dropout's `bernoulli_` and the (tokens x vocabulary) logits
(allocation, log-softmax, their backward) each costing about as much as all the matrix products; in beam
search, log-softmax and top-k over the (hypotheses x vocabulary) logits cost about as much as the output
projection itself, until top-k ranked group maxima first (`topk_rows`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

# Float32 products through oneDNN instead of MKL, for inference on CPU. Measured on the 2-core AMD EPYC (Zen 5,
# AVX-512) for decoding's shapes: 2-2.5x MKL's speed for large products, but ~15 us of fixed cost per call that
# makes it slower for small ones. From 1M multiply-adds (rather than 4M) greedy search at batch 1 ran 1.46x
# faster (the output projection of one row), beam 4 at batch 64 the same. NMT_ONEDNN=0 turns it off.
ONEDNN_MIN_MACS = 1 << 20
# With a packed weight (`PackedWeight`) the fixed cost is lower: float32 from 768k multiply-adds (4 rows x 256 x
# 768: 17 instead of 34 us), bfloat16 always (1 row x 256 x 256: 13 instead of 18 us through F.linear).
PACKED_MIN_MACS = {torch.float32: 3 << 18, torch.bfloat16: 0}
_ONEDNN_LINEAR = os.environ.get("NMT_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()


def _onednn_runs_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 or AMX); without them its bf16 products fail
    ("could not create a primitive descriptor") and bfloat16 stays on F.linear."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


ONEDNN_BF16 = _ONEDNN_LINEAR and _onednn_runs_bf16()
_ONEDNN_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16) if ONEDNN_BF16 else (torch.float32,)


class _Products(threading.local):
    float32_on_onednn = True
    bounded_rows = False


_PRODUCTS = _Products()  # per thread: a server's translator thread sets its own (`serving_products`)


@contextmanager
def serving_products() -> Iterator[None]:
    """Products for a server, on this thread while the block runs (`nmt serve`'s batches run in one).

    Float32 products run through MKL (F.linear) instead of oneDNN: oneDNN compiles a kernel per (rows x in x
    out) shape and keeps memory for every one it made, beyond its cache's eviction (measured: ~530 MB more
    after 200 random batches, still rising after 600, with a 64-kernel cache too); MKL keeps none. A file's
    batches repeat a few shapes; a server's requests bring new ones for as long as it runs. bfloat16 stays on
    oneDNN (F.linear takes it there anyway) with the rows of every product padded to a bucket (`bucket_rows`:
    72 up to 16,384), so that the shapes a weight meets are bounded (under 1/8 more work above 64 rows), and
    so is that memory."""
    saved = _PRODUCTS.float32_on_onednn, _PRODUCTS.bounded_rows
    _PRODUCTS.float32_on_onednn, _PRODUCTS.bounded_rows = False, True
    try:
        yield
    finally:
        _PRODUCTS.float32_on_onednn, _PRODUCTS.bounded_rows = saved


def bucket_rows(rows: int) -> int:
    """The row count a bounded product pads `rows` to: a multiple of 8 up to 64, then 8 steps per doubling
    (72, 80, ... 128, 144, ...): above 64 rows under 1/8 of them are padding, and 1-16,384 rows need 72 counts."""
    if rows <= 64:
        return max(8, -(-rows // 8) * 8)
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
    attr = "relu" if relu else "none"
    if not _PRODUCTS.bounded_rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], "")
    rows = x.numel() // x.shape[-1]
    padded = bucket_rows(rows)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))  # one copy, zero rows below
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, attr, [], "")
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


PACK_ROWS = 64  # the row count oneDNN lays packed weights out for; 16-256 measured the same for 1-300 rows


class PackedWeight:
    """oneDNN's blocked copy of one (out, in) weight for inference products (`linear`), made on first use
    and remade whenever the weight changes (another tensor, or written in place).

    Without it oneDNN reorders the weight into its blocked layout on every call. Measured on the 2-core AMD
    EPYC, float32 (256 x 9,806 output layer): 3.0 -> 2.8 ms at 256 rows, 0.82 -> 0.71 ms at 64, 0.30 -> 0.19 ms
    at 16; bfloat16 1.48 -> 1.42, 0.43 -> 0.35, 0.17 -> 0.11 ms. Copies of a module start without it.
    A change is seen through the weight's version counter, which fused optimizers (Adam(fused=True)) do not
    advance: keep packed weights for models that no longer train (`Transformer.pack_weights`).
    """

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.dtype] | None = None
        self.packed: Tensor | None = None

    def of(self, weight: Tensor) -> Tensor:
        """The packed copy of `weight` (a float32 or bfloat16 CPU tensor made outside inference mode)."""
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        assert self.packed is not None
        return self.packed

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return PackedWeight()  # oneDNN's opaque tensors cannot be copied; the copy packs its own weight


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False,
           packed: PackedWeight | None = None) -> Tensor:
    """F.linear(x, weight, bias), then ReLU if `relu`. Float32 and bfloat16 on CPU without gradients run on
    oneDNN (the ReLU fused into the product, the weight from `packed` when given) when the product is large
    enough to gain (`ONEDNN_MIN_MACS`, `PACKED_MIN_MACS`). Results equal F.linear's up to rounding."""
    if (_ONEDNN_LINEAR and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype and x.device.type == "cpu"
            and (x.dtype != torch.float32 or _PRODUCTS.float32_on_onednn)
            and x.numel() * weight.shape[0] >= (ONEDNN_MIN_MACS if packed is None else PACKED_MIN_MACS[x.dtype])
            and not torch.is_autocast_enabled("cpu")
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        if packed is not None and not weight.is_inference():
            weight = packed.of(weight)
        return _onednn_linear(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


def _keep_mask(x: Tensor, p: float) -> tuple[Tensor, float]:
    """A boolean keep mask shaped like x (P(keep) = 1 - p rounded to a multiple of 1/65536) and the scale
    1 / P(keep) of the survivors. The mask comes from 16-bit slices of 64-bit random integers, a quarter of
    the random draws `bernoulli_` makes."""
    dropped = round(p * 65536)
    n = x.numel()
    bits = torch.randint(torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, ((n + 3) // 4,),
                         dtype=torch.int64, device=x.device).view(torch.int16)[:n].view(x.shape)
    return bits >= dropped - 32768, 65536.0 / (65536 - dropped)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout (Srivastava et al., 2014) with a cheaper mask than F.dropout (see `_keep_mask`); the
    survivors are scaled by exactly 1 / P(keep), so the expectation is unchanged."""
    if not training or p <= 0.0:
        return x
    if x.device.type != "cpu":  # GPUs: PyTorch's fused dropout kernel (one pass, mask from Philox) is faster
        return F.dropout(x, p, training=True)
    if p >= 1.0:
        return x * 0.0
    keep, scale = _keep_mask(x, p)
    return x * (keep.to(x.dtype) * scale)


class _ReluDropout(torch.autograd.Function):
    """dropout(relu(x)) that keeps only its output for the backward pass: the output is positive exactly
    where the gradient flows (x > 0 and kept), and the next linear layer saves that output anyway."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        keep, scale = _keep_mask(x, p)
        out = torch.relu(x) * (keep.to(x.dtype) * scale)
        ctx.save_for_backward(out)
        ctx.scale = float(torch.tensor(scale, dtype=x.dtype))  # the scale the forward multiplied by, as rounded
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad * ctx.scale, out, 0), None  # relu's own backward kernel


def relu_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """dropout(relu(x), p): the feed-forward sublayer's activation dropout. On CPU it holds no more memory for
    the backward pass than relu alone (`_ReluDropout`); it draws the same mask `dropout` would."""
    if not training or p <= 0.0:
        return F.relu(x)
    if x.device.type != "cpu" or p >= 1.0:
        return dropout(F.relu(x), p, training)
    return _ReluDropout.apply(x, p)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i label-smoothed CE(hidden_i @ weight^T, target_i), gradients computed during the forward pass."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float, chunk: int,
                compute_dtype: torch.dtype, vocab: int, bias: Tensor | None = None) -> Tensor:
        padded = vocab < weight.shape[0]  # rows past `vocab` are padding: their logits are masked
        real = real_columns(vocab, bias)  # the columns label smoothing spreads over
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            w_mean = (weight[:vocab] if real is None else weight[:vocab][real]).float().mean(0)  # (d,)
            b_mean = 0.0 if bias is None else bias[:vocab][real].float().mean()  # the mean logit: h . w_mean + b_mean
            grad_hidden = torch.empty_like(h)  # (N, d)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, d)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            hidden_sum = torch.zeros(h.shape[1], dtype=torch.float32, device=hidden.device)
            tiny = torch.finfo(compute_dtype).tiny  # a target whose probability underflows costs -log(tiny)
            for start in range(0, h.shape[0], chunk):
                hc, tc = h[start : start + chunk], target[start : start + chunk]
                rows = hc.shape[0]
                hc_real = hc.float()  # (rows, d)
                if rows < chunk and hc.device.type == "cpu":
                    # Pad the last chunk with zero rows: every matmul then has the same shape, and oneDNN does
                    # not build and cache new kernels for each batch. Zero rows add nothing to grad_weight.
                    hc = torch.cat([hc, hc.new_zeros(chunk - rows, hc.shape[1])])
                logits = hc @ w.t()  # (chunk, V) in the compute dtype
                if b is not None:
                    logits += b
                if padded:
                    logits[:, vocab:] = -math.inf  # never predicted; their gradients come out zero
                # One fused kernel (float32 arithmetic inside, even for bf16 logits) instead of the casts,
                # logsumexp, subtraction and exp it replaces: d loss / d logits = softmax - eps / V
                # - (1 - eps) * onehot(target); the other two terms are folded into the products below.
                p = torch.softmax(logits, dim=-1)
                # The loss from the same probabilities: nll = -log p[target], lse = logit[target] + nll.
                target_logit = logits[:rows].gather(1, tc[:, None]).squeeze(1).float()
                if compute_dtype == torch.float16:
                    # fp16's smallest normal (6e-5) would cap a token's loss at 9.7, below ln |V| for a 37k
                    # vocabulary: the log-sum-exp in float32 instead (CUDA only, where the pass is cheap)
                    lse = torch.logsumexp(logits[:rows].float(), dim=-1)
                    nll = lse - target_logit
                else:
                    target_p = p[:rows].gather(1, tc[:, None]).squeeze(1).float()
                    nll = -target_p.clamp_min(tiny).log()
                    lse = target_logit + nll
                uniform = lse - hc_real @ w_mean - b_mean  # cross-entropy against the uniform distribution
                total += ((1 - smoothing) * nll + smoothing * uniform).sum()
                grad_hidden[start : start + rows] = (
                    (p @ w)[:rows].float() - smoothing * w_mean - (1 - smoothing) * weight[tc].float()
                ).to(compute_dtype)
                grad_weight += (p.t() @ hc).float()
                hidden_sum += hc_real.sum(0)
                grad_weight.index_add_(0, tc, hc_real, alpha=-(1 - smoothing))
            if real is None:
                grad_weight[:vocab] -= (smoothing / vocab) * hidden_sum  # the eps / V term, once for all rows
            else:
                columns = real.nonzero().squeeze(1)
                grad_weight.index_add_(0, columns, (-smoothing / len(columns)) * hidden_sum.expand(len(columns), -1))
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return ((grad_hidden * grad_output).to(hidden_dtype), (grad_weight * grad_output).to(weight_dtype),
                None, None, None, None, None, None)


# Rows of the output projection per chunk of the fused loss. CPU: 256 keeps a (rows x V) chunk in cache and
# one kernel shape for oneDNN; CUDA: thousands, so a big model's (V x d) projection is read once or twice per
# micro-batch instead of once per 256 rows.
LOSS_CHUNK_ROWS = {"cpu": 256, "cuda": 4096}


def loss_chunk_rows(device: torch.device) -> int:
    """The fused loss's chunk of rows for a device (see LOSS_CHUNK_ROWS)."""
    return LOSS_CHUNK_ROWS.get(device.type, 256)


def real_columns(vocab: int, bias: Tensor | None) -> Tensor | None:
    """Which of the first `vocab` logit columns are tokens (bool (vocab,)): a column whose fixed bias is -inf
    is none (a row a model made elsewhere lacks); None when every column is."""
    if bias is None:
        return None
    real = torch.isfinite(bias[:vocab])
    return None if bool(real.all()) else real


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float = 0.0,
                         chunk: int = 256, vocab: int | None = None, bias: Tensor | None = None) -> Tensor:
    """Summed label-smoothed cross-entropy of logits `hidden @ weight^T` against `target`.

    hidden (N, d), weight (V, d), target (N,). Equals F.cross_entropy(hidden @ weight.T, target,
    label_smoothing=smoothing, reduction="sum") but never holds the (N, V) logits: rows are processed
    in chunks and, when gradients are needed, theirs are computed in the same pass (as the Liger
    kernel does), so the backward pass is two scalings. Under autocast the matmuls run in its dtype.
    With `vocab` < V, the rows from `vocab` on are padding: the loss is over the first `vocab` columns (the
    product still runs over all V, whose width is aligned) and the padding rows' gradient is zero. `bias`
    (V,), fixed: added to the logits; smoothing spreads over the columns where it is finite (`real_columns`).
    """
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    vocab = weight.shape[0] if vocab is None else vocab
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, target, smoothing, chunk, compute_dtype, vocab, bias)
    return linear_cross_entropy_and_nll(hidden, weight, target, smoothing, chunk, vocab, bias)[0]


@torch.no_grad()
def linear_cross_entropy_and_nll(hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float = 0.0,
                                 chunk: int = 256, vocab: int | None = None,
                                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed negative log-likelihood of the same logits, in one pass
    and without gradients (validation). Shapes and `vocab` as in `linear_cross_entropy`; both results float32
    scalars."""
    vocab = weight.shape[0] if vocab is None else vocab
    real = real_columns(vocab, bias)
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    loss = hidden.new_zeros((), dtype=torch.float32)
    nll = hidden.new_zeros((), dtype=torch.float32)
    with torch.autocast(device, enabled=False):
        w = weight.to(compute_dtype)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start : start + chunk].to(compute_dtype) @ w.t()).float()  # (chunk, V)
            if bias is not None:
                logits += bias.to(compute_dtype).float()
            logits[:, vocab:] = -math.inf  # padding rows, if any
            lse = torch.logsumexp(logits, dim=-1)
            token_nll = lse - logits.gather(1, target[start : start + chunk, None]).squeeze(1)
            tokens = logits[:, :vocab] if real is None else logits[:, :vocab][:, real]
            uniform = lse - tokens.mean(-1)  # cross-entropy against the uniform distribution
            nll += token_nll.sum()
            loss += ((1 - smoothing) * token_nll + smoothing * uniform).sum()
    return loss, nll


GROUPED_TOPK_MIN = 1 << 18  # entries (rows x columns) from which `topk_rows` ranks group maxima first
TOPK_GROUP = 64  # columns per group


def topk_rows(x: Tensor, k: int, group: int | None = None) -> tuple[Tensor, Tensor]:
    """x.topk(k, dim=-1) of a 2-D tensor (values and columns, largest first), fast for wide rows.

    A row's k largest entries lie in the k groups of `group` consecutive columns whose maxima are largest
    (any other group's maximum is at most the k-th of those maxima), so only those k * group columns, and
    the few after the last whole group, are ranked. Group maxima are one vectorized pass; PyTorch's CPU top-k
    ranks (value, index) pairs one element at a time: (256 x 9,806) 0.55 instead of 1.17 ms on the 2-core AMD
    EPYC. The same values as torch.topk; among exactly tied values the columns may differ.
    """
    n, v = x.shape
    group = group or TOPK_GROUP
    # Narrow rows have too few columns to skip; GPUs keep their own top-k kernel (not measured against this).
    if x.device.type != "cpu" or n * v < GROUPED_TOPK_MIN or v < 2 * k * group:
        return x.topk(k, dim=-1)
    whole = v - v % group
    groups = x[:, :whole].view(n, whole // group, group)
    best = groups.amax(-1).topk(k, dim=-1).indices  # (n, k) groups
    candidates = groups[torch.arange(n, device=x.device)[:, None], best].view(n, k * group)
    if whole < v:
        candidates = torch.cat([candidates, x[:, whole:]], 1)
    values, pick = candidates.topk(k, dim=-1)
    in_groups = pick < k * group
    columns = best.gather(1, (pick // group).clamp_(max=k - 1)) * group + pick % group
    return values, torch.where(in_groups, columns, pick + (whole - k * group))


def linear_log_softmax_topk(hidden: Tensor, weight: Tensor, k: int, exclude: tuple[int, ...] = (),
                            packed: PackedWeight | None = None, vocab: int | None = None,
                            bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The k largest entries per row of log_softmax(hidden @ weight^T), float32: a decoding step's output layer.

    hidden (N, d), weight (V, d). Returns values (N, k), their columns (N, k) and all log-probabilities
    (N, V) (`linear_log_softmax`); the top-k is `topk_rows`.
    """
    log_probs = linear_log_softmax(hidden, weight, exclude, packed, vocab, bias)
    values, columns = topk_rows(log_probs, k)
    return values, columns, log_probs


def linear_log_softmax(hidden: Tensor, weight: Tensor, exclude: tuple[int, ...] = (),
                       packed: PackedWeight | None = None, vocab: int | None = None,
                       bias: Tensor | None = None) -> Tensor:
    """log_softmax(hidden @ weight^T) in float32, (N, V): a decoding step's next-token distribution.

    Columns in `exclude` count in the normalization but are set to -inf, so they are never chosen; columns
    from `vocab` on (padding rows of the weight) are -inf before it, so they do not count; `bias` (V,) is added
    to the logits.
    PyTorch's log-softmax is one fused pass with a vectorized exp (torch.exp alone is slower here, and
    logsumexp slower still). `packed`: see `linear`.
    """
    logits = linear(hidden, weight, bias, packed=packed).float()
    if vocab is not None and vocab < logits.shape[-1]:
        logits[:, vocab:] = -math.inf
    if logits.device.type == "cpu":
        # In place: with a second (N, V) buffer per step, glibc handed the freed memory back to the kernel and
        # faulted it in again at the next step (beam 4, batch 64: ~760k page faults and 1.5 s of system time
        # per 1,000 sentences, ~15% slower).
        log_probs = torch.log_softmax(logits, dim=-1, out=logits)
    else:
        log_probs = torch.log_softmax(logits, dim=-1)
    if exclude:
        log_probs[:, list(exclude)] = -math.inf
    return log_probs
