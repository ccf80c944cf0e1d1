"""The model's pieces: incremental decoding, the learning-rate schedule, and the fast ops."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nmt_cli.model import ops
from nmt_cli.model.ops import dropout, linear_cross_entropy, linear_log_softmax_topk, relu_dropout
from nmt_cli.model.transformer import (
    Transformer,
    count_parameters,
    explicit_attention,
    make_config,
    sinusoidal_positions,
)
from nmt_cli.training.trainer import cooldown_factor, inverse_sqrt_lr

from .conftest import threshold


def _model(pre_norm: bool = False, vocab: int = 40) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(make_config("tiny", vocab, pre_norm=pre_norm))
    return model.eval()


@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("onednn_min_macs", [0, ops.ONEDNN_MIN_MACS])
def test_cached_decoding_equals_full_recomputation(pre_norm, onednn_min_macs, monkeypatch):
    """Also with every float32 product on oneDNN (`ops.linear`), as the large products of real decoding are."""
    monkeypatch.setattr(ops, "ONEDNN_MIN_MACS", onednn_min_macs)
    model = _model(pre_norm)
    src = torch.randint(4, 40, (3, 9))
    src[1, 6:] = 0  # padding
    src[:, -1] = 2
    prev = torch.randint(4, 40, (3, 7))
    prev[:, 0] = 1
    with torch.no_grad():
        memory, mask = model.encode(src)
        full = torch.log_softmax(model.logits(model.decode(prev, memory, mask)), -1)  # (B, T, V)
        state = model.start_decoding(memory, mask, beam=1, max_len=10)
        steps = [torch.log_softmax(model.logits(model.decode_step(prev[:, t], state)), -1) for t in range(7)]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_cached_decoding_with_beam_reorder():
    """Rows reordered mid-sequence (beam backpointers, dropped sentences) keep matching recomputation."""
    model = _model()
    src = torch.randint(4, 40, (2, 6))
    beam = 3
    prev = torch.randint(4, 40, (2 * beam, 6))
    prev[:, 0] = 1
    with torch.no_grad():
        memory, mask = model.encode(src)
        state = model.start_decoding(memory, mask, beam=beam, max_len=8)
        for t in range(3):
            model.decode_step(prev[:, t], state)
        # reorder: row r takes the history of rows `order`, and sentence 0 is dropped
        order = torch.tensor([5, 3, 3])
        state.reorder(order, sentences=torch.tensor([1]))
        history = prev[order]
        cached = [torch.log_softmax(model.logits(model.decode_step(history[:, 3], state)), -1)]
        # a second reorder (the cache's buffers swap back), then the remaining steps
        again = torch.tensor([2, 0, 1])
        state.reorder(again)
        history = history[again]
        cached = [c[again] for c in cached]
        cached += [torch.log_softmax(model.logits(model.decode_step(history[:, t], state)), -1) for t in range(4, 6)]
        mem1, mask1 = memory[1:], mask[1:]
        hidden = model.decode(history, mem1.expand(3, -1, -1), mask1.expand(3, -1, -1, -1))
        full = torch.log_softmax(model.logits(hidden), -1)
    torch.testing.assert_close(torch.stack(cached, 1), full[:, 3:6], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ops._ONEDNN_LINEAR, reason="this PyTorch build has no oneDNN")
def test_linear_runs_large_float32_inference_products_on_onednn():
    """ops.linear: oneDNN for float32 and bfloat16 without gradients from ONEDNN_MIN_MACS multiply-adds up;
    F.linear otherwise (small products, gradients, autocast), so training and its gradients never change."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 150, 256), torch.randn(1024, 256), torch.randn(1024)
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    with torch.no_grad():
        out = ops.linear(x, w, b)
        assert torch.equal(out, onednn)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        assert torch.equal(ops.linear(x[:, :1, :16], w[:, :16]), F.linear(x[:, :1, :16], w[:, :16]))  # small
        # ReLU fused into the product (the FFN at inference), or applied after F.linear
        relu = ops.linear(x, w, b, relu=True)
        assert torch.equal(relu, torch.ops.mkldnn._linear_pointwise(x, w, b, "relu", [], ""))
        torch.testing.assert_close(relu, F.relu(F.linear(x, w, b)), atol=1e-4, rtol=1e-5)
        assert torch.equal(ops.linear(x[:, :1, :16], w[:, :16], relu=True), F.relu(F.linear(x[:, :1, :16], w[:, :16])))
        assert torch.equal(ops.linear(x[:, 10:20].transpose(0, 1), w, b),  # a non-contiguous input
                           torch.ops.mkldnn._linear_pointwise(x[:, 10:20].transpose(0, 1).contiguous(), w, b,
                                                              "none", [], ""))
        bf16 = ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    w.requires_grad_(True)
    out = ops.linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(-1, 256).sum(0).expand(1024, -1), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not ops._ONEDNN_LINEAR, reason="this PyTorch build has no oneDNN")
def test_servers_keep_float32_products_off_onednn_on_their_own_thread_only():
    """Under serving_products (what `nmt serve`'s batches run under), float32 products are F.linear's, bit for
    bit, and no packed weight is made for them; bfloat16 ones still run on oneDNN with the packed weight.
    Another thread meanwhile, and this one afterwards, keep oneDNN."""
    import threading

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 150, 256), torch.randn(1024, 256), torch.randn(1024)

    def packs() -> bool:
        packed = ops.PackedWeight()
        with torch.no_grad():
            ops.linear(x, w, b, packed=packed)
        return packed.packed is not None

    assert packs()  # on oneDNN until now
    with ops.serving_products(), torch.no_grad():
        elsewhere: list[bool] = []
        thread = threading.Thread(target=lambda: elsewhere.append(packs()))
        thread.start()
        thread.join()
        assert elsewhere == [True]
        packed = ops.PackedWeight()
        assert torch.equal(ops.linear(x, w, b, packed=packed), F.linear(x, w, b))
        assert torch.equal(ops.linear(x, w, b, relu=True, packed=packed), F.relu(F.linear(x, w, b)))
        assert packed.packed is None
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        if not ops.ONEDNN_BF16:  # a CPU without AVX-512: bfloat16 stays on F.linear
            assert torch.equal(ops.linear(xb, wb, bb, packed=packed), F.linear(xb, wb, bb))
            return
        assert torch.equal(ops.linear(xb, wb, bb, packed=packed), ops.linear(xb, wb, bb))
        assert packed.packed is not None
    assert packs()


def test_row_buckets_are_few_and_pad_little():
    """`bucket_rows`: never fewer rows, at most 7 more up to 64 and under 1/8 more above, and 72 counts for
    1-16,384 rows."""
    assert [ops.bucket_rows(n) for n in (1, 8, 9, 64, 65, 72, 73, 128, 129, 16_384)] == [
        8, 8, 16, 64, 72, 72, 80, 128, 144, 16_384]
    assert all(0 <= ops.bucket_rows(n) - n <= (7 if n <= 64 else n / 8) for n in range(1, 16_385))
    assert len({ops.bucket_rows(n) for n in range(1, 16_385)}) == 72


@pytest.mark.skipif(not ops._ONEDNN_LINEAR, reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ops.ONEDNN_BF16, reason="oneDNN has no bfloat16 kernels for this CPU (no AVX-512)"))])
def test_bounded_row_counts_give_the_unpadded_products(dtype, monkeypatch):
    """Under serving_products (what `nmt serve`'s batches run under), oneDNN products are computed on rows
    padded to a bucket, and give what the unpadded product gives, bit for bit, with and without the packed
    weight and ReLU."""
    torch.manual_seed(0)
    w, b = torch.randn(1024, 256, dtype=dtype), torch.randn(1024, dtype=dtype)
    inputs = [torch.randn(rows, 256, dtype=dtype) for rows in (1, 5, 8, 63, 65, 130, 700)]
    inputs.append(torch.randn(3, 47, 256, dtype=dtype).transpose(0, 1))  # not contiguous, 3-D
    cases = [(x, relu) for x in inputs for relu in (False, True)]
    with torch.no_grad():
        expected = {kind: [ops.linear(x, w, b, relu=relu, packed=packed) for x, relu in cases]
                    for kind, packed in (("plain", None), ("packed", ops.PackedWeight()))}
        monkeypatch.setattr(ops._PRODUCTS, "bounded_rows", True)
        monkeypatch.setattr(ops._PRODUCTS, "float32_on_onednn", True)  # float32 too, to see its padding
        seen = []
        real_pointwise = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda x, *args: seen.append(x.shape[0]) or real_pointwise(x, *args))
        for kind, packed in (("plain", None), ("packed", ops.PackedWeight())):
            got = [ops.linear(x, w, b, relu=relu, packed=packed) for x, relu in cases]
            for e, g in zip(expected[kind], got):
                assert g.shape == e.shape and torch.equal(g, e)
    assert seen and set(seen) <= {ops.bucket_rows(n) for n in range(1, 2000)}
    assert 64 * 9 // 8 < max(seen)  # the products ran on oneDNN, padded


@pytest.mark.skipif(not ops._ONEDNN_LINEAR, reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ops.ONEDNN_BF16, reason="oneDNN has no bfloat16 kernels for this CPU (no AVX-512)"))])
def test_packed_weights_follow_their_weight(dtype, monkeypatch):
    """`linear` with a PackedWeight gives what it gives without one, for any row count and input layout; the
    packed copy is remade when the weight is written in place or replaced, a copied model packs its own, and
    a model set to train again drops them."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 40, 256, dtype=dtype), torch.randn(1024, 256, dtype=dtype), torch.randn(1024, dtype=dtype)
    packed = ops.PackedWeight()
    with torch.no_grad():
        for rows in (x, x[0], x[0, :5], x[:, 7:9].transpose(0, 1), x[0, :1]):
            if rows.shape[-2] > 1:  # one row is below ONEDNN_MIN_MACS: F.linear without a packed weight
                assert torch.equal(ops.linear(rows, w, b, relu=True, packed=packed), ops.linear(rows, w, b, relu=True))
            torch.testing.assert_close(ops.linear(rows, w, b, packed=packed), F.linear(rows, w, b),
                                       atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)
        w.mul_(-1)  # in place: the same storage, a new version
        assert torch.equal(ops.linear(x, w, b, packed=packed), ops.linear(x, w, b))
        other = torch.randn(1024, 256, dtype=dtype)
        assert torch.equal(ops.linear(x, other, b, packed=packed), ops.linear(x, other, b))

    monkeypatch.setattr(ops, "PACKED_MIN_MACS", {torch.float32: 0, torch.bfloat16: 0})  # the tiny model's too
    model = _model(vocab=5000).to(dtype).pack_weights()
    tokens, hidden = torch.randint(4, 5000, (2, 6)), torch.randn(300, 64, dtype=dtype)
    with torch.no_grad():
        before = model(tokens, tokens), model.logits(hidden)
        assert model.packed_output.packed is not None and model.decoder[0].feed_forward.w1.packed.packed is not None
        model.load_state_dict({k: -v for k, v in model.state_dict().items()})
        after = model(tokens, tokens), model.logits(hidden)
        assert torch.equal(after[1], -before[1])
        twin = copy.deepcopy(model)
        assert twin.packed_output.packed is None
        assert torch.equal(twin.logits(hidden), after[1]) and torch.equal(twin(tokens, tokens), after[0])
        model.train()  # training again (fused optimizers write weights unseen): the packed copies are gone
        assert model.packed_output is None and model.decoder[0].cross_attn.packed_q is None
        assert model.decoder[0].feed_forward.w1.packed is None


def test_shared_embeddings_and_presets():
    model = _model()
    assert model.logits(torch.zeros(1, 64)).shape == (1, 40)
    assert sum(p.data_ptr() == model.embed.weight.data_ptr() for p in model.parameters()) == 1
    base = make_config("base", 37000)
    big = make_config("big", 37000)
    assert (base.layers, base.d_model, base.ffn, base.heads, base.dropout) == (6, 512, 2048, 8, 0.1)
    assert (big.d_model, big.ffn, big.heads, big.dropout) == (1024, 4096, 16, 0.3)
    assert make_config("small", 100, d_model=512, heads=8).d_model == 512
    pe = sinusoidal_positions(50, 16)
    assert pe[3, 0] == pytest.approx(math.sin(3)) and pe[3, 1] == pytest.approx(math.cos(3))
    assert pe[7, 4] == pytest.approx(math.sin(7 / 10000 ** (4 / 16)), rel=1e-5)


def test_learning_rate_follows_equation_3():
    d, warmup = 512, 4000
    for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
        expected = d**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert inverse_sqrt_lr(step, d, warmup) == pytest.approx(expected)
    assert inverse_sqrt_lr(4000, d, warmup, scale=2.0) == pytest.approx(2 * 512**-0.5 * 4000**-0.5)
    # peak at the end of warmup, then decay as step^-0.5
    assert inverse_sqrt_lr(4000, d, warmup) > inverse_sqrt_lr(3000, d, warmup)
    assert inverse_sqrt_lr(16000, d, warmup) == pytest.approx(inverse_sqrt_lr(4000, d, warmup) / 2)


def test_cooldown_falls_linearly_to_zero_over_the_final_share():
    assert [cooldown_factor(used, 0.25) for used in (0.0, 0.5, 0.75)] == [1.0, 1.0, 1.0]
    assert cooldown_factor(0.875, 0.25) == pytest.approx(0.5)
    assert cooldown_factor(1.0, 0.25) == 0.0 and cooldown_factor(1.2, 0.25) == 0.0  # a budget overrun stays at 0
    assert cooldown_factor(0.99, 0.0) == 1.0  # off


def test_activation_dropout_acts_in_training_only():
    torch.manual_seed(0)
    plain = Transformer(make_config("tiny", 40))
    config = make_config("tiny", 40, dropout=0.0, activation_dropout=0.5)
    with_dropout = Transformer(config)
    with_dropout.load_state_dict(plain.state_dict())  # the rate adds no weights
    plain.eval(), with_dropout.eval()
    src = torch.randint(4, 40, (2, 7))
    prev = torch.randint(4, 40, (2, 5))

    def hidden(model):
        return model.decode(prev, *model.encode(src))

    torch.testing.assert_close(hidden(with_dropout), hidden(plain), atol=0, rtol=0)
    ffn = with_dropout.encoder[0].feed_forward
    x = torch.randn(3, 64)
    ffn.train()
    inner = []
    handle = ffn.w2.register_forward_pre_hook(lambda module, args: inner.append(args[0]))
    ffn(x)
    handle.remove()
    relu = F.relu(ffn.w1(x))
    kept = inner[0] != 0
    threshold("share of active units dropped", float(1 - kept[relu > 0].float().mean()), low=0.3, high=0.7)
    torch.testing.assert_close(inner[0][kept], 2 * relu[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_dropout_equals_dropout_of_relu(dtype):
    """Same mask, same output, same gradient as dropout(relu(x)), but only the output is kept for backward."""
    x = torch.randn(64, 48).to(dtype)
    grad = torch.randn(64, 48).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    fused = relu_dropout(a, 0.25, training=True)
    torch.manual_seed(3)
    reference = dropout(F.relu(b), 0.25, training=True)
    assert torch.equal(fused, reference)
    assert [t.data_ptr() for t in fused.grad_fn.saved_tensors] == [fused.data_ptr()]
    fused.backward(grad)
    reference.backward(grad)
    assert torch.equal(a.grad, b.grad)
    assert torch.equal(relu_dropout(x, 0.25, training=False), F.relu(x))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [256, 4096])  # the CPU and the CUDA chunk (ops.LOSS_CHUNK_ROWS)
def test_linear_cross_entropy_matches_reference(smoothing, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(700, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(90, 24, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 90, (700,))
    fused = linear_cross_entropy(hidden, weight, target, smoothing, chunk=chunk)
    fused.backward(torch.tensor(0.5, dtype=torch.float64))
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = F.cross_entropy(hidden @ weight.t(), target, label_smoothing=smoothing, reduction="sum")
    (0.5 * reference).backward()
    assert float(fused.detach()) == pytest.approx(float(reference.detach()), rel=1e-6)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        no_grad_loss = float(linear_cross_entropy(hidden, weight, target, smoothing))
        assert no_grad_loss == pytest.approx(float(reference.detach()), rel=1e-6)


def test_linear_cross_entropy_target_underflow_stays_finite():
    """A target whose probability underflows (logit 200 below the best) costs -log(tiny) instead of inf;
    the gradient is still exact."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.tensor([[200.0, 0.0], [0.0, 0.0], [0.0, 1.0]], requires_grad=True)
    target = torch.tensor([1, 2])
    loss = linear_cross_entropy(hidden, weight, target, 0.1)
    assert torch.isfinite(loss) and float(loss.detach()) > 80
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    F.cross_entropy(hidden @ weight.t(), target, label_smoothing=0.1, reduction="sum").backward()
    torch.testing.assert_close(grads, (hidden.grad, weight.grad))


def test_fp16_loss_is_not_capped_at_fp16s_smallest_probability():
    """In fp16 a token whose probability is below 6e-5 (every token of an untrained 37k-vocabulary model) costs
    its real -log p, not -log(6e-5) = 9.7: the logged loss of an untrained model is ln |V| = 10.5, not 9.7."""
    torch.manual_seed(0)
    vocab, d, n = 37_000, 64, 32
    weight, hidden, target = torch.randn(vocab, d) * 0.5, torch.randn(n, d) * 0.5, torch.randint(0, vocab, (n,))
    reference = F.cross_entropy(hidden @ weight.t(), target, label_smoothing=0.1, reduction="sum") / n
    assert reference > 11
    loss = linear_cross_entropy(hidden.half().requires_grad_(), weight.half().requires_grad_(), target, 0.1) / n
    assert abs(float(loss.detach()) - float(reference)) < 0.01


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_attention_equals_fused_attention(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 7, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False
    for m in (None, mask):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
        torch.testing.assert_close(explicit_attention(q, k, v, m, causal), expected)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # in bf16: within bf16's rounding
            low = explicit_attention(q.float(), k.float(), v.float(), m, causal)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.double(), expected, atol=0.05, rtol=0.05)


def test_bf16_training_step_agrees_with_fp32():
    """Training under bf16 autocast (explicit attention, the fused loss in bf16) gives the fp32 loss and
    gradients up to bf16 rounding."""
    torch.manual_seed(0)
    model = Transformer(make_config("tiny", 50, dropout=0.0)).train()
    src, prev = torch.randint(4, 50, (6, 9)), torch.randint(4, 50, (6, 8))
    src[2, 6:] = 0
    target = torch.randint(4, 50, (48,))

    def loss_and_grads(precision: str):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = linear_cross_entropy(model(src, prev).flatten(0, 1), model.embed.weight, target, 0.1)
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss32, grad32 = loss_and_grads("fp32")
    loss16, grad16 = loss_and_grads("bf16")
    threshold("relative loss difference, bf16 vs fp32", abs(loss16 - loss32) / loss32, high=0.01)
    threshold("1 - gradient cosine, bf16 vs fp32", 1 - float(F.cosine_similarity(grad16, grad32, dim=0)), high=0.01)


def test_dropout_rate_and_expectation():
    torch.manual_seed(0)
    x = torch.ones(400_000)
    y = dropout(x, 0.3, training=True)
    threshold("share dropped at p=0.3", float((y == 0).float().mean()), low=0.295, high=0.305)
    threshold("mean after dropout", float(y.mean()), low=0.99, high=1.01)
    assert dropout(x, 0.3, training=False) is x
    x.requires_grad_()
    y = dropout(x, 0.5, training=True)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)


@pytest.mark.parametrize("vocab,group", [(100, 8), (100, 7), (5000, 64), (5003, 64), (100, 64), (61, 2)])
@pytest.mark.parametrize("k", [1, 8])
def test_linear_log_softmax_topk_matches_log_softmax_then_topk(vocab, group, k, monkeypatch):
    """Through group maxima (groups that divide the vocabulary, that leave a tail) and, for rows too narrow
    for groups, plain top-k; excluded columns stay in the normalization."""
    monkeypatch.setattr(ops, "GROUPED_TOPK_MIN", 0)
    monkeypatch.setattr(ops, "TOPK_GROUP", group)
    torch.manual_seed(0)
    hidden, weight = torch.randn(13, 16), torch.randn(vocab, 16)
    values, columns, log_probs = linear_log_softmax_topk(hidden, weight, k, exclude=(0, 1, 50))
    expected_log_probs = torch.log_softmax(hidden @ weight.t(), -1)
    expected_log_probs[:, [0, 1, 50]] = -math.inf
    torch.testing.assert_close(log_probs, expected_log_probs)
    expected = expected_log_probs.topk(k, -1)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(columns, expected.indices)


def test_topk_rows_with_ties_and_infinities(monkeypatch):
    monkeypatch.setattr(ops, "GROUPED_TOPK_MIN", 0)
    torch.manual_seed(0)
    x = torch.randint(0, 5, (6, 203)).float()  # many exact ties
    x[0] = -math.inf  # a row with nothing to choose
    x[1, 150:] = math.inf
    values, columns = ops.topk_rows(x, 8, group=4)
    expected = x.topk(8, -1)
    assert torch.equal(values, expected.values)
    assert torch.equal(x.gather(1, columns), values) and all(len(set(row)) == 8 for row in columns.tolist())


def test_finished_sentences_leave_by_moving_only_the_last_staying_ones():
    from nmt_cli.decode.search import staying_order
    from nmt_cli.model.transformer import keep_rows

    done = [False, True, False, True, False, False, True, False]
    order = staying_order(done, torch.device("cpu"))
    assert order.tolist() == [0, 5, 2, 7, 4]  # places 1 and 3 go to 5 and 7, the staying ones beyond 5
    x = torch.arange(8 * 6, dtype=torch.float32).view(8, 2, 3)[:, :, :2]  # a strided view, as the cache's
    expected = x[order].clone()
    kept = keep_rows(x, order)
    assert torch.equal(kept, expected) and kept.data_ptr() == x.data_ptr()
    shuffled = torch.randperm(8)[:5]  # any order works, moving every row not already in place
    y = torch.randn(8, 3)
    assert torch.equal(keep_rows(y.clone(), shuffled), y[shuffled])


@pytest.mark.parametrize("pre_norm", [False, True])
def test_reordering_moves_only_ancestry_and_matches_recomputation(pre_norm):
    """Random backpointers at every step, from a one-row first step: each row's cached output equals the
    teacher-forced decoder on its own history, and beam reordering never copies the key/value cache."""
    model = _model(pre_norm)
    torch.manual_seed(3)
    sentences, beam, steps = 3, 4, 7
    src = torch.randint(4, 40, (sentences, 8))
    src[2, 5:] = 0
    with torch.no_grad():
        memory, mask = model.encode(src)
        state = model.start_decoding(memory, mask, beam=beam, max_len=steps)
        history = torch.full((sentences, 1), 1)
        outputs = [model.decode_step(history[:, 0], state)]  # one row per sentence
        width = 1
        for t in range(1, steps):
            parents = (torch.arange(sentences)[:, None] * width + torch.randint(0, width, (sentences, beam))).view(-1)
            buffer = state.cache.buffer.data_ptr()
            state.reorder(parents)
            assert state.cache.buffer.data_ptr() == buffer
            history = torch.cat([history[parents], torch.randint(4, 40, (sentences * beam, 1))], 1)
            outputs = [o[parents] for o in outputs]
            outputs.append(model.decode_step(history[:, t], state))
            width = beam
        rows = sentences * beam
        full = model.decode(history, memory.repeat_interleave(beam, 0), mask.repeat_interleave(beam, 0))
    assert len(outputs) == steps and outputs[-1].shape[0] == rows
    torch.testing.assert_close(torch.stack(outputs, 1), full, atol=1e-5, rtol=1e-5)


def test_first_step_on_one_row_per_sentence_then_fanned_out():
    """Beam search's first step decodes one row per sentence; reordering fans it out to `beam` rows."""
    model = _model()
    src = torch.randint(4, 40, (2, 6))
    beam = 3
    prev = torch.randint(4, 40, (2 * beam, 4))
    prev[:, 0] = 1
    with torch.no_grad():
        memory, mask = model.encode(src)
        wide = model.start_decoding(memory, mask, beam=beam, max_len=6)
        expected = [model.logits(model.decode_step(prev[:, t], wide)) for t in range(4)]
        narrow = model.start_decoding(memory, mask, beam=beam, max_len=6)
        first = model.logits(model.decode_step(prev[::beam, 0], narrow))
        narrow.reorder(torch.arange(2).repeat_interleave(beam))
        rest = [model.logits(model.decode_step(prev[:, t], narrow)) for t in range(1, 4)]
    torch.testing.assert_close(first.repeat_interleave(beam, 0), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(rest), torch.stack(expected[1:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_and_nll_in_one_pass_match_cross_entropy(smoothing):
    """Validation's single pass gives the label-smoothed loss and the NLL of the same logits."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(300, 16), torch.randn(50, 16)
    target = torch.randint(0, 50, (300,))
    loss, nll = ops.linear_cross_entropy_and_nll(hidden, weight, target, smoothing, chunk=64)
    logits = hidden @ weight.t()
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="sum"))
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, reduction="sum"))


def test_a_padded_vocabulary_trains_and_decodes_as_the_unpadded_one():
    """37 symbols padded to 40 rows (multiple of 8) or 64: the same initial weights on the real rows, zero
    padding rows, the same loss, validation loss and gradients, zero gradient on the padding rows (so they stay
    zero under Adam), and the same greedy and beam output and scores as the unpadded model."""
    from nmt_cli.decode.search import EnsembleModel, beam_search, greedy_search
    from nmt_cli.training.update import TranslationLoss

    torch.manual_seed(0)
    plain = Transformer(make_config("tiny", 37, vocab_multiple=1, dropout=0.0))
    src = torch.randint(4, 37, (3, 7))
    src[:, -1] = 2
    prev = torch.randint(4, 37, (3, 5))
    prev[:, 0] = 1
    target_index, target = torch.arange(15), torch.randint(3, 37, (15,))
    plain_loss = TranslationLoss(plain, 0.1)(src, prev, target_index, target)
    plain_loss.backward()
    with torch.no_grad():
        plain_valid = TranslationLoss(plain, 0.1)(src, prev, target_index, target, with_nll=True)
    plain.eval()
    plain_greedy = [[h] for h in greedy_search(EnsembleModel([plain]), src, bos=1, eos=2)]
    plain_beam = beam_search(EnsembleModel([plain]), src, bos=1, eos=2, beam=3, nbest=3)
    for multiple, rows in ((8, 40), (64, 64)):
        torch.manual_seed(0)
        padded = Transformer(make_config("tiny", 37, vocab_multiple=multiple, dropout=0.0))
        assert padded.embed.weight.shape == (rows, 64) and padded.config.rows == rows
        assert count_parameters(padded) == count_parameters(plain)  # the zero rows are not parameters of the model
        assert not padded.embed.weight[37:].any()
        for (name, a), b in zip(plain.state_dict().items(), padded.state_dict().values()):
            assert torch.equal(a, b[:37] if name == "embed.weight" else b), name
        loss = TranslationLoss(padded, 0.1)(src, prev, target_index, target)
        loss.backward()
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-5)
        for (name, a), b in zip(plain.named_parameters(), padded.parameters()):
            grad = b.grad[:37] if name == "embed.weight" else b.grad
            torch.testing.assert_close(grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert not padded.embed.weight.grad[37:].any()
        with torch.no_grad():
            valid = TranslationLoss(padded, 0.1)(src, prev, target_index, target, with_nll=True)
        torch.testing.assert_close(torch.stack(valid), torch.stack(plain_valid), rtol=1e-6, atol=1e-5)
        padded.eval()
        assert padded.logits(torch.zeros(2, 64)).shape == (2, 37)
        greedy = [[h] for h in greedy_search(EnsembleModel([padded]), src, bos=1, eos=2)]
        for found, expected in ((greedy, plain_greedy),
                                (beam_search(EnsembleModel([padded]), src, bos=1, eos=2, beam=3, nbest=3), plain_beam)):
            assert [[h.tokens for h in s] for s in found] == [[h.tokens for h in s] for s in expected]
            for s, t in zip(found, expected):
                assert [h.score for h in s] == pytest.approx([h.score for h in t], abs=1e-5)
