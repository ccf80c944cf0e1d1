"""`nmt train`: the paper's training recipe (section 5) with token batching, AMP, torchrun DDP and exact resume."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import closing, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import TRAINING_KERNEL_CACHE, size_kernel_cache
from . import distributed as D
from .checkpoint import load_checkpoint, numbered_checkpoints, save_checkpoint
from .data import Batch, DataDir, collate, make_batches, prefetch, shuffled
from .errors import NmtError
from .model import ModelConfig, Transformer, count_parameters, make_config
from .ops import linear_cross_entropy, linear_cross_entropy_and_nll


@dataclass
class TrainOptions:
    """Everything `nmt train` needs; mirrors its command-line flags (0 means "no limit" / "off")."""

    data: Path
    save_dir: Path
    arch: str = "base"
    layers: int | None = None
    d_model: int | None = None
    ffn: int | None = None
    heads: int | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    pre_norm: bool | None = None
    max_tokens: int = 4096
    update_freq: int = 1
    max_updates: int = 0
    max_epochs: int = 0
    max_time: float = 0.0  # minutes of wall-clock time, validation included
    precision: str = "fp32"
    seed: int = 1
    device: str | None = None
    save_interval_updates: int = 0
    save_interval_minutes: float = 0.0
    keep_last: int = 5
    valid_interval: int = 0  # updates; 0 validates at the end of each epoch
    eval_bleu: bool = False
    patience: int = 0
    lr_scale: float = 1.0
    warmup: int = 4000
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    log_interval: int = 50
    quiet: bool = False


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (paper eq. 3), times `scale`."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


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
        if with_nll:
            return linear_cross_entropy_and_nll(hidden, self.model.embed.weight, target, self.label_smoothing)
        return linear_cross_entropy(hidden, self.model.embed.weight, target, self.label_smoothing)


def autocast_context(precision: str, device: torch.device):
    """torch.autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse precisions the device cannot run, with one line."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise NmtError(f"unknown --precision {precision!r} (use fp32, bf16 or fp16)")
    if precision == "fp16" and device.type != "cuda":
        raise NmtError("--precision fp16 needs CUDA (loss scaling is for GPUs); on CPU use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise NmtError("--precision bf16: this GPU does not support bfloat16; use fp16")


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


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
    loss, nll, ntokens = D.all_reduce_sum(counts, ctx, device)
    loss_module.train(was_training)
    return {"valid_loss": loss / ntokens, "valid_nll": nll / ntokens, "valid_ppl": math.exp(nll / ntokens)}


def valid_bleu(model: Transformer, data: DataDir, device: torch.device, precision: str) -> float:
    """Greedy-decode the valid source and score detokenized output against the raw reference with sacreBLEU."""
    import sacrebleu

    from .translate import Translator

    translator = Translator([model], data.vocab, data.bpe_codes, data.source_lang, data.target_lang, device,
                            precision=precision,
                            normalize=bool(data.meta.get("tokenizer", {}).get("normalize_punctuation", False)))
    sources = (data.path / f"valid.raw.{data.source_lang}").read_text(encoding="utf-8").splitlines()
    refs = (data.path / f"valid.raw.{data.target_lang}").read_text(encoding="utf-8").splitlines()
    was_training = model.training
    model.eval()
    hyps = translator.translate(sources, greedy=True, max_tokens=4096)
    model.train(was_training)
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def build_state(model: Transformer, data: DataDir, opt, scaler, progress: dict, rngs: list) -> dict:
    """Everything a checkpoint holds: the self-contained model and the complete training state."""
    return {
        "model": model.state_dict(),
        "config": model.config.to_dict(),
        "vocab": data.vocab.symbols,
        "bpe_codes": data.bpe_codes,
        "source_lang": data.source_lang,
        "target_lang": data.target_lang,
        "tokenizer": data.meta.get("tokenizer", {}),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rngs,
        "progress": dict(progress),
        "updates": progress["updates"],
    }


def check_resume(state: dict, path: Path, config: ModelConfig, data: DataDir) -> None:
    """One-line errors when a checkpoint does not belong to this model or data."""
    if state["vocab"] != data.vocab.symbols:
        raise NmtError(f"{path}: vocabulary differs from {data.path / 'vocab.txt'} "
                       f"({len(state['vocab'])} vs {len(data.vocab)} symbols); use another --save-dir")
    saved = ModelConfig.from_dict(state["config"])
    if saved != config:
        diffs = [f"{k} {v} vs {getattr(config, k)}" for k, v in saved.to_dict().items() if getattr(config, k) != v]
        raise NmtError(f"{path}: architecture differs from this command's ({', '.join(diffs)}); use another --save-dir")


class JsonLog:
    """Append JSON lines to train.jsonl (main process only)."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None

    def write(self, record: dict) -> None:
        """One record, stamped with the wall-clock time (Unix seconds)."""
        if self.file:
            self.file.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def check_lengths(data: DataDir, splits: dict, config: ModelConfig) -> None:
    """Refuse, before training starts, data with sentences the model's positions cannot hold."""
    for name, corpus in splits.items():
        longest = max(int(corpus.src.sizes.max(initial=0)), int(corpus.tgt.sizes.max(initial=0)))
        if longest + 1 > config.max_positions:  # + </s> (or <s>)
            raise NmtError(f"{data.path}: the {name} split has a sentence of {longest} tokens, more than the "
                           f"model's {config.max_positions} positions hold; re-run nmt prepare (--max-len)")


class Window:
    """Loss and token sums since the last log line, kept on the device until `read` (one host sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.global_tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.tokens, self.time = 0, now

    def add(self, loss: torch.Tensor, tokens: int, global_tokens: torch.Tensor) -> None:
        self.loss += loss
        self.global_tokens += global_tokens
        self.tokens += tokens

    def read(self, now: float) -> dict:
        """Mean loss per target token and target tokens/s (all processes) since the last read; resets."""
        loss, global_tokens = torch.stack([self.loss, self.global_tokens]).tolist()
        record = {"loss": loss / max(self.tokens, 1), "tgt_tokens_per_s": global_tokens / max(now - self.time, 1e-9)}
        self.reset(now)
        return record


def train_step(runner: nn.Module, model: Transformer, micro: list[Batch], optimizer, scaler, opts: TrainOptions,
               ctx: D.DistContext, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One update from the micro-batches of `micro` (gradient accumulation); returns this process's summed
    loss and the global target token count, both on the device, or (loss, None) when the update was skipped
    (non-finite gradients: weights and optimizer untouched).

    The loss is summed over target tokens and divided by the global token count; DDP averages gradients
    over processes, hence the world_size factor. The only host sync is the finiteness check of the gradient
    norm, once per update (it is the all-reduced gradient, so every process decides alike).
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
        scaler.unscale_(optimizer)
    if opts.clip_norm > 0:
        norm = nn.utils.clip_grad_norm_(model.parameters(), opts.clip_norm)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(optimizer)  # skips the step itself on inf/NaN gradients
        scaler.update()
        skipped = scaler.get_scale() < scale_before
    else:
        skipped = not math.isfinite(float(norm))
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return update_loss, None if skipped else global_tokens


def train(opts: TrainOptions) -> dict:
    """Train (or resume) a model as `opts` says; return the final progress record."""
    size_kernel_cache(TRAINING_KERNEL_CACHE)
    device = D.resolve_device(opts.device, int(os.environ.get("LOCAL_RANK", "0")))
    check_precision(opts.precision, device)
    if opts.update_freq < 1 or opts.max_tokens < 1:
        raise NmtError("--update-freq and --max-tokens must be positive")
    data = DataDir.open(opts.data)
    config = make_config(opts.arch, len(data.vocab), pad=data.vocab.pad, layers=opts.layers, d_model=opts.d_model,
                         ffn=opts.ffn, heads=opts.heads, dropout=opts.dropout,
                         attention_dropout=opts.attention_dropout, pre_norm=opts.pre_norm)
    save_dir = Path(opts.save_dir)
    last_path = save_dir / "checkpoint_last.pt"
    resume = load_checkpoint(last_path) if last_path.exists() else None
    if resume is not None:
        check_resume(resume, last_path, config, data)

    ctx = D.init_distributed(device)
    torch.manual_seed(opts.seed)
    model = Transformer(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.amp.GradScaler(device.type, enabled=opts.precision == "fp16")
    progress = {"epoch": 1, "batch_pos": 0, "updates": 0, "elapsed": 0.0, "best": None, "bad_validations": 0,
                "world_size": ctx.world_size}
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scaler.load_state_dict(resume["scaler"])
        progress.update(resume["progress"])
        rngs = resume["rng"]
        set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0], device)
        if progress["world_size"] != ctx.world_size:  # same global position, other process count
            progress["batch_pos"] = progress["batch_pos"] * progress["world_size"] // ctx.world_size
            progress["world_size"] = ctx.world_size

    train_corpus, valid_corpus = data.split("train"), data.split("valid")
    check_lengths(data, {"train": train_corpus, "valid": valid_corpus}, config)
    batches = make_batches(train_corpus.src.sizes, train_corpus.tgt.sizes, opts.max_tokens, opts.seed)
    valid_batches = make_batches(valid_corpus.src.sizes, valid_corpus.tgt.sizes, opts.max_tokens, opts.seed)
    if len(batches) < ctx.world_size:
        raise NmtError(f"{data.path}: {len(batches)} training batches cannot feed {ctx.world_size} processes")
    loss_module = TranslationLoss(model, opts.label_smoothing)
    if ctx.enabled:
        ids = [device.index] if device.type == "cuda" else None
        # The only buffer (sinusoidal positions) is a constant: no need to broadcast it every step.
        runner: nn.Module = DistributedDataParallel(loss_module, device_ids=ids, broadcast_buffers=False)
    else:
        runner = loss_module
    runner.train()

    if ctx.is_main:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "options.json").write_text(json.dumps(asdict(opts), default=str, indent=2) + "\n")
    log = JsonLog(save_dir / "train.jsonl" if ctx.is_main else None)
    log.write({"event": "start", "resumed_at": progress["updates"] if resume else None,
               "parameters": count_parameters(model), "config": config.to_dict(), "world_size": ctx.world_size,
               "device": str(device), "precision": opts.precision})
    higher_is_better = opts.eval_bleu
    start = time.monotonic() - progress["elapsed"]
    last_interval_save = time.monotonic()
    # Numbered checkpoints (what `nmt average --last N` reads) come from one regular schedule only: the update
    # or minute interval when one is given, else epoch ends. Other saves update checkpoint_last.pt.
    interval_given = opts.save_interval_updates > 0 or opts.save_interval_minutes > 0
    window = Window(device)
    stop_reason = None
    pin = device.type == "cuda"

    def make_group(group: list) -> list[Batch]:
        return [collate(train_corpus, idx, data.vocab) for idx in group]

    bar = Progress(TextColumn("[bold]train[/]"), BarColumn(), TextColumn("{task.fields[status]}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), disable=opts.quiet or not ctx.is_main)
    with bar:
        task = bar.add_task("train", total=opts.max_updates or None, completed=progress["updates"], status="")
        while stop_reason is None:
            epoch_batches = shuffled(batches, opts.seed, progress["epoch"])
            per_rank = len(epoch_batches) // ctx.world_size
            mine = epoch_batches[ctx.rank :: ctx.world_size][:per_rank]
            groups = [mine[i : i + opts.update_freq] for i in range(progress["batch_pos"], len(mine), opts.update_freq)]
            # The next group is collated (and pinned) on a background thread while this one runs.
            with closing(prefetch(make_group, groups, pin, background=device.type == "cuda")) as stream:
                for micro in stream:
                    micro = [b.to(device, non_blocking=pin) for b in micro]
                    lr = inverse_sqrt_lr(progress["updates"] + 1, config.d_model, opts.warmup, opts.lr_scale)
                    for group_ in optimizer.param_groups:
                        group_["lr"] = lr
                    update_loss, global_tokens = train_step(runner, model, micro, optimizer, scaler, opts, ctx,
                                                            device)
                    skipped = global_tokens is None
                    progress["batch_pos"] += len(micro)
                    end_of_epoch = progress["batch_pos"] >= len(mine)
                    if skipped:
                        # Weights untouched, schedule not advanced; never a NaN model.
                        log.write({"event": "overflow", "update": progress["updates"] + 1,
                                   "loss_scale": scaler.get_scale() if scaler.is_enabled() else None})
                        if end_of_epoch:
                            progress["epoch"] += 1
                            progress["batch_pos"] = 0
                        continue
                    progress["updates"] += 1
                    updates = progress["updates"]
                    window.add(update_loss, sum(b.ntokens for b in micro), global_tokens)

                    if end_of_epoch:
                        progress["epoch"] += 1
                        progress["batch_pos"] = 0
                    now = time.monotonic()
                    progress["elapsed"] = now - start
                    timed = [0.0, 0.0]
                    if opts.max_time > 0 and progress["elapsed"] >= opts.max_time * 60:
                        timed[0] = 1.0
                    if opts.save_interval_minutes > 0 and now - last_interval_save >= opts.save_interval_minutes * 60:
                        timed[1] = 1.0
                    if opts.max_time > 0 or opts.save_interval_minutes > 0:
                        timed = D.all_reduce_sum(timed, ctx, device)  # every process must decide alike
                    if opts.max_updates and updates >= opts.max_updates:
                        stop_reason = "max_updates"
                    elif end_of_epoch and opts.max_epochs and progress["epoch"] > opts.max_epochs:
                        stop_reason = "max_epochs"
                    elif timed[0] > 0:
                        stop_reason = "max_time"

                    if updates % opts.log_interval == 0 or stop_reason:
                        record = {"event": "train", "update": updates, "epoch": progress["epoch"] - end_of_epoch,
                                  **window.read(now), "lr": lr, "elapsed_s": round(progress["elapsed"], 1)}
                        log.write(record)
                        bar.update(task, status=f"upd {updates} loss {record['loss']:.3f} lr {lr:.2e} "
                                                f"{record['tgt_tokens_per_s']:,.0f} tok/s")
                    bar.update(task, completed=updates)

                    do_valid = (opts.valid_interval and updates % opts.valid_interval == 0) or (
                        not opts.valid_interval and end_of_epoch) or stop_reason is not None
                    if interval_given:
                        numbered = bool(opts.save_interval_updates and updates % opts.save_interval_updates == 0)
                        numbered = numbered or timed[1] > 0
                    else:
                        numbered = end_of_epoch
                    do_save = numbered or end_of_epoch or stop_reason is not None
                    improved = False
                    if do_valid:
                        metrics = validate(loss_module, valid_corpus, valid_batches, data.vocab, opts.precision,
                                           device, ctx)
                        if opts.eval_bleu:
                            score = valid_bleu(model, data, device, opts.precision) if ctx.is_main else 0.0
                            (metrics["valid_bleu"],) = D.all_reduce_sum([score], ctx, device)
                        value = metrics["valid_bleu"] if opts.eval_bleu else metrics["valid_loss"]
                        best = progress["best"]
                        improved = best is None or (value > best if higher_is_better else value < best)
                        if improved:
                            progress["best"], progress["bad_validations"] = value, 0
                        else:
                            progress["bad_validations"] += 1
                        log.write({"event": "valid", "update": updates, **metrics, "best": progress["best"]})
                        if not opts.quiet and ctx.is_main:
                            shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
                            bar.console.print(f"update {updates}: {shown}" + (" (best)" if improved else ""))
                        if opts.patience and progress["bad_validations"] >= opts.patience and stop_reason is None:
                            stop_reason = "patience"
                            do_save = True
                    if do_save or improved:
                        rngs = D.gather_objects(rng_state(device), ctx)
                        if ctx.is_main:
                            state = build_state(model, data, optimizer, scaler, progress, rngs)
                            if numbered:
                                save_checkpoint(state, save_dir / f"checkpoint_{updates}.pt")
                                if opts.keep_last > 0:
                                    for old in numbered_checkpoints(save_dir)[: -opts.keep_last]:
                                        old.unlink()
                            if do_save:
                                save_checkpoint(state, last_path)
                            if improved:
                                save_checkpoint(state, save_dir / "checkpoint_best.pt")
                        if timed[1] > 0:
                            last_interval_save = time.monotonic()
                    if stop_reason is not None:
                        break
    summary = {"event": "end", "reason": stop_reason, **progress}
    log.write(summary)
    log.close()
    D.shutdown(ctx)
    return summary
