"""One update and one evaluation: the paper's learning rate (eq. 3), the training criterion, the update with
gradient accumulation (no host sync per micro-batch), and validation loss / BLEU."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nmt_cli.data.binarized import Batch, DataDir, collate
from nmt_cli.model.ops import linear_cross_entropy, linear_cross_entropy_and_nll, loss_chunk_rows
from nmt_cli.model.transformer import Transformer

from . import distributed as D

if TYPE_CHECKING:
    from .options import TrainOptions


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (paper eq. 3), times `scale`."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def lr_scale_for_peak(peak: float, d_model: int, warmup: int) -> float:
    """The factor on eq. 3 whose rate peaks (at update `warmup`) at `peak`: fairseq's --lr in the paper's terms."""
    return peak / inverse_sqrt_lr(warmup, d_model, warmup)


def effective_lr_scale(opts: TrainOptions, d_model: int) -> float:
    """The eq. 3 factor a run trains with: --lr's, where given, else --lr-scale."""
    return opts.lr_scale if opts.lr is None else lr_scale_for_peak(opts.lr, d_model, opts.warmup)


def update_ema(ema: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * params, in place, for each pair (one fused kernel per group): after an
    optimizer step, as Marian's exponential smoothing and fairseq's --ema-decay keep it."""
    torch._foreach_lerp_(ema, params, 1.0 - decay)


def cooldown_factor(budget_used: float, cooldown: float) -> float:
    """The factor on the learning rate that falls linearly from 1 to 0 over the final `cooldown` share of
    the training budget (the trapezoidal schedule's cool-down); 1 before it, and always 1 when cooldown is 0."""
    if cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - budget_used) / cooldown))


class TranslationLoss(nn.Module):
    """The model plus its training criterion, so DDP sees one forward: label-smoothed cross-entropy, summed."""

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, src: torch.Tensor, prev_output: torch.Tensor, target_index: torch.Tensor,
                target: torch.Tensor, with_nll: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Summed loss over the real target tokens: `target_index` (n,) flat positions into (B, T), `target`
        (n,) their ids. With `with_nll` (no gradients), also the summed NLL of the same forward pass."""
        hidden = self.model(src, prev_output).flatten(0, 1).index_select(0, target_index)  # (n, d)
        # Only the real target positions reach the output projection (padding would cost matmul rows),
        # and the (tokens x V) logits are never held at once (see ops.linear_cross_entropy).
        model = self.model
        chunk, vocab = loss_chunk_rows(hidden.device), model.config.target_vocab  # past vocab: padding rows
        if with_nll:
            return linear_cross_entropy_and_nll(hidden, model.output_matrix, target, self.label_smoothing, chunk,
                                                vocab, model.logit_bias)
        return linear_cross_entropy(hidden, model.output_matrix, target, self.label_smoothing, chunk, vocab,
                                    model.logit_bias)


def autocast_context(precision: str, device: torch.device):
    """torch.autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def validate(loss_module: TranslationLoss, corpus, batches, vocab, precision: str, device: torch.device,
             ctx: D.DistContext) -> dict:
    """Validation loss (label-smoothed), NLL and perplexity over the whole split, summed over processes."""
    was_training = loss_module.training
    loss_module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll: read once at the end
    ntokens = 0
    for indices in batches[ctx.rank :: ctx.world_size]:
        batch = collate(corpus, indices, vocab).to(device)
        with autocast_context(precision, device):
            loss, nll = loss_module(batch.src, batch.prev_output, batch.target_index, batch.target, with_nll=True)
        totals += torch.stack([loss, nll]).double()
        ntokens += batch.ntokens
    counts = torch.cat([totals, torch.full((1,), ntokens, dtype=torch.float64, device=device)])
    loss, nll, ntokens = D.all_reduce(counts, ctx, device)
    loss_module.train(was_training)
    return {"valid_loss": loss / ntokens, "valid_nll": nll / ntokens, "valid_ppl": math.exp(nll / ntokens)}


def valid_bleu(model: Transformer, data: DataDir, device: torch.device, precision: str) -> float:
    """Greedy-decode the valid source and score detokenized output against the raw reference with sacreBLEU
    (tokenized as the target language wants: `score.default_tokenize`)."""
    import sacrebleu

    from nmt_cli.decode.score import default_tokenize
    from nmt_cli.decode.translate import Translator

    translator = Translator([model], data.vocab, data.segmenter(), data.source_lang, data.target_lang, device,
                            precision=precision, target_vocab=data.target_vocab)
    translator.target_token = data.meta.get("target_token", "")
    sources = (data.path / f"valid.raw.{data.source_lang}").read_text(encoding="utf-8").splitlines()
    refs = (data.path / f"valid.raw.{data.target_lang}").read_text(encoding="utf-8").splitlines()
    was_training = model.training
    model.eval()
    hyps = translator.translate(sources, greedy=True, max_tokens=4096)
    model.train(was_training)
    return sacrebleu.corpus_bleu(hyps, [refs], tokenize=default_tokenize(data.target_lang)).score


def train_step(runner: nn.Module, model: Transformer, micro: list[Batch], optimizer, scaler, opts: TrainOptions,
               ctx: D.DistContext, device: torch.device,
               flags: Callable[[], Sequence[float]] | None = None) -> tuple[float, float | None, list[float]]:
    """One update from the micro-batches of `micro` (gradient accumulation). Returns the loss summed over
    every process's target tokens, the global target token count (None when the update was skipped: non-finite
    gradients, weights and optimizer untouched), and the numbers `flags()` gives (the run's stop and save
    flags, taken once the gradients are in) summed over processes.

    The loss is summed over target tokens and divided by the global token count; DDP averages gradients
    over processes, hence the world_size factor. All of it costs one small all-reduce and one host read per
    update: the loss, the finiteness of the gradient norm (all-reduced gradients, so every process decides
    alike) and the flags travel in one device tensor, read after a fused optimizer's step is queued (it skips
    itself on the device after non-finite gradients), before any other optimizer's step.
    """
    local_tokens = sum(b.ntokens for b in micro)
    # Filled on the device (torch.tensor would copy from pageable host memory, which waits for the stream).
    global_tokens = torch.full((), local_tokens, dtype=torch.float64, device=device)
    if ctx.enabled:
        dist.all_reduce(global_tokens)  # stays on the device: no host read
    factor = (ctx.world_size / global_tokens).float()
    update_loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro):
        sync = i == len(micro) - 1
        with runner.no_sync() if ctx.enabled and not sync else nullcontext():
            with autocast_context(opts.precision, device):
                loss = runner(batch.src, batch.prev_output, batch.target_index, batch.target)
            scaler.scale(loss * factor).backward()
        update_loss += loss.detach()
    if scaler.is_enabled():
        scaler.unscale_(optimizer)  # records its own inf check for scaler.update, on the device
    if opts.clip_norm > 0:
        norm = nn.utils.clip_grad_norm_(model.parameters(), opts.clip_norm)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    non_finite = ~torch.isfinite(norm)  # alike on every process: the gradients were all-reduced
    # A fused Adam skips itself on the device when told the gradients are not finite (`found_inf`, as
    # GradScaler drives it): the step is queued before the update's host read, so the device runs it while the
    # host waits there, and the next micro-batch's forward queues right behind it.
    step_on_device = bool(optimizer.defaults.get("fused"))
    if step_on_device:
        optimizer.found_inf = non_finite.float()
        optimizer.step()
        del optimizer.found_inf
    # [loss, non-finite, tokens, *flags]: summed over processes in one all-reduce, read in one go
    host_values = _on_device([local_tokens, *(flags() if flags else ())], device)
    shared = torch.cat([torch.stack([update_loss, non_finite.double()]), host_values])
    if ctx.enabled:
        dist.all_reduce(shared)
    loss_sum, non_finite_sum, tokens, *flags_summed = shared.tolist()  # the update's one host read
    skipped = non_finite_sum > 0
    if not skipped and not step_on_device:
        optimizer.step()
    if scaler.is_enabled():
        scaler.update()  # lowers the scale after non-finite gradients, raises it after enough finite ones
    # Under DDP the gradients are views into its buckets (`gradient_as_bucket_view`): zeroed in place, they stay
    # views; set to None, the next backward would allocate them apart from the buckets again.
    optimizer.zero_grad(set_to_none=not ctx.enabled)
    return loss_sum, None if skipped else tokens, flags_summed


def _on_device(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """A few host numbers as a float64 tensor on `device`, copied without waiting for the device's queue."""
    t = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
