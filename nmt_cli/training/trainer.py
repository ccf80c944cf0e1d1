"""`nmt train`: the paper's training recipe (section 5), the run loop and its bookkeeping (update.py: the update)."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, nullcontext, suppress
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nmt_cli import __version__
from nmt_cli.data.binarized import (
    Batch,
    DataDir,
    ParallelCorpus,
    collate,
    make_batches,
    prefetch,
    shuffled,
    weighted_batches,
)
from nmt_cli.errors import NmtError
from nmt_cli.hardware import device_kind, resolve_device
from nmt_cli.model.checkpoint import (
    CheckpointWriter,
    load_checkpoint,
    model_only,
    numbered_checkpoints,
    target_vocabulary,
    to_host,
)
from nmt_cli.model.precision import resolve_precision
from nmt_cli.model.transformer import ModelConfig, Transformer, count_parameters, make_config
from nmt_cli.textio import atomic_path, read_small_file, remove_temporaries
from nmt_cli.torch_env import TRAINING_KERNEL_CACHE, loaded_allocator, size_kernel_cache

from . import distributed as D
from .options import TrainOptions  # noqa: F401  (re-exported: callers import it from nmt_cli.training.trainer)
from .runstate import (
    EXIT_CODES,
    JsonLog,
    SaveDirLock,
    StopRequests,
    TrainState,
    Window,
    plain_line,
    rng_state,
    set_rng_state,
    tensorboard_writer,
)
from .update import (  # noqa: F401  (re-exported: nmt_cli.training.trainer is where callers look for the update)
    TranslationLoss,
    autocast_context,
    cooldown_factor,
    effective_lr_scale,
    inverse_sqrt_lr,
    train_step,
    update_ema,
    valid_bleu,
    validate,
)


def check_resume(state: dict, path: Path, config: ModelConfig, data: DataDir) -> None:
    """One-line errors when a checkpoint does not belong to this model or data, or cannot resume training."""
    missing = [k for k in ("model", "config", "vocab", "optimizer", "scaler", "rng", "progress") if k not in state]
    if missing:
        kind = "an averaged or exported model" if "model" in state and "optimizer" in missing else "incomplete"
        raise NmtError(f"{path}: {kind}, without training state ({', '.join(missing)}); it cannot resume training: "
                       "use it with --init-from in another --save-dir")
    if state["vocab"] != data.vocab.symbols:
        raise NmtError(f"{path}: vocabulary differs from {data.path / 'vocab.txt'} "
                       f"({len(state['vocab'])} vs {len(data.vocab)} symbols); use another --save-dir")
    saved = ModelConfig.from_dict(state["config"])
    # The saved run's vocabulary padding is kept (`resumed_config`), whatever this version would choose.
    diffs = [f"{k} {v} vs {getattr(config, k)}" for k, v in saved.to_dict().items()
             if k not in (*DROPOUT_FIELDS, "vocab_multiple") and getattr(config, k) != v]
    if diffs:
        raise NmtError(f"{path}: architecture differs from this command's ({', '.join(diffs)}); use another --save-dir")


def resumed_config(saved: ModelConfig, config: ModelConfig, opts: TrainOptions) -> tuple[ModelConfig, list[str]]:
    """The config a resumed run trains with: the saved one, with the dropout rates given on this command line
    (a rate not given keeps the saved value, not the preset's); and a line per rate that changed."""
    given = {k: getattr(config, k) for k in DROPOUT_FIELDS if getattr(opts, k) is not None}
    new = replace(saved, **given)
    changes = [f"--{k.replace('_', '-')} {getattr(saved, k)} -> {getattr(new, k)}" for k in DROPOUT_FIELDS
               if getattr(saved, k) != getattr(new, k)]
    return new, changes


def restore_scaler(scaler: torch.amp.GradScaler, saved: dict) -> str | None:
    """Load a saved fp16 loss scaler; a run that saved none (bf16 or fp32 until now) starts a fresh one, and the
    line returned says so."""
    if scaler.is_enabled() and not saved:
        return f"a fresh fp16 loss scale ({scaler.get_scale():g}): the run being resumed kept none"
    scaler.load_state_dict(saved)
    return None


def gradient_compression_hook(precision: str) -> Callable:
    """A DDP communication hook that all-reduces the gradient buckets in bf16 or fp16 (--comm-precision): each
    process casts its bucket and divides it by the process count, the all-reduce sums the half-size copies,
    and each process casts the result back into its fp32 bucket (an average, as without the hook). PyTorch's
    own `bf16_compress_hook` does the same but DDP accepts it only with NCCL; this one runs on gloo too."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16

    def hook(group, bucket):  # unannotated: DDP compares annotations with classes, which strings are not here
        group = group or dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done):
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return hook


def check_options(opts: TrainOptions) -> None:
    """One-line errors for numeric options outside their range, before anything is loaded."""
    checks = [
        ("--max-tokens", opts.max_tokens, opts.max_tokens >= 1, "at least 1"),
        ("--update-freq", opts.update_freq, opts.update_freq >= 1, "at least 1"),
        ("--max-updates", opts.max_updates, opts.max_updates >= 0, "0 (no limit) or more"),
        ("--max-epochs", opts.max_epochs, opts.max_epochs >= 0, "0 (no limit) or more"),
        ("--max-time", opts.max_time, opts.max_time >= 0, "0 (no limit) or more"),
        ("--save-interval-updates", opts.save_interval_updates, opts.save_interval_updates >= 0, "0 (off) or more"),
        ("--save-interval-minutes", opts.save_interval_minutes, opts.save_interval_minutes >= 0, "0 (off) or more"),
        ("--state-interval-minutes", opts.state_interval_minutes, opts.state_interval_minutes >= 0,
         "0 (epoch ends only) or more"),
        ("--keep-last", opts.keep_last, opts.keep_last >= 0, "0 (all) or more"),
        ("--valid-interval", opts.valid_interval, opts.valid_interval >= 0, "0 (each epoch) or more"),
        ("--patience", opts.patience, opts.patience >= 0, "0 (off) or more"),
        ("--lr-scale", opts.lr_scale, opts.lr_scale > 0, "positive"),
        ("--lr", opts.lr, opts.lr is None or opts.lr > 0, "positive"),
        ("--adam-betas", opts.adam_betas, len(opts.adam_betas) == 2 and all(0 <= b < 1 for b in opts.adam_betas),
         "two numbers in [0, 1)"),
        ("--weight-decay", opts.weight_decay, opts.weight_decay >= 0, "0 (off) or more"),
        ("--ema", opts.ema, 0 <= opts.ema < 1, "0 (off) or a decay in (0, 1), such as 0.999"),
        ("--warmup", opts.warmup, opts.warmup >= 1, "at least 1"),
        ("--cooldown", opts.cooldown, 0 <= opts.cooldown < 1, "in [0, 1)"),
        ("--label-smoothing", opts.label_smoothing, 0 <= opts.label_smoothing < 1, "in [0, 1)"),
        ("--clip-norm", opts.clip_norm, opts.clip_norm >= 0, "0 (off) or more"),
        ("--log-interval", opts.log_interval, opts.log_interval >= 1, "at least 1"),
        ("--comm-precision", opts.comm_precision, opts.comm_precision in ("fp32", "bf16", "fp16"),
         "fp32, bf16 or fp16"),
    ]
    for name in ("layers", "d_model", "ffn", "heads", "head_dim"):
        value = getattr(opts, name)
        if value is not None:
            checks.append((f"--{name.replace('_', '-')}", value, value >= 1, "at least 1"))
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        value = getattr(opts, name)
        if value is not None:
            checks.append((f"--{name.replace('_', '-')}", value, 0 <= value < 1, "in [0, 1)"))
    for flag, value, ok, wanted in checks:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise NmtError(f"{flag} must be {wanted} (got {value})")
    if opts.valid_ema and not opts.ema:
        raise NmtError("--valid-ema validates the moving average of --ema: give --ema DECAY too")
    if opts.cooldown and not (opts.max_updates or opts.max_time):
        raise NmtError("--cooldown needs a budget to end at: --max-updates or --max-time")


ARCHITECTURE_FIELDS = ("layers", "d_model", "ffn", "heads", "pre_norm", "head_dim", "learned_positions")


def check_architecture_flags(opts: TrainOptions, model: ModelConfig) -> None:
    """Fine-tuning keeps the --init-from model's architecture: refuse --arch or a size flag that asks for
    another one (one line naming what differs) rather than ignore it."""
    sizes = {k: getattr(opts, k) for k in ARCHITECTURE_FIELDS if getattr(opts, k) is not None}
    asked = dict(sizes)
    if opts.arch is not None:  # the preset with the size flags applied, field by field
        preset = make_config(opts.arch, model.vocab_size, pad=model.pad, **sizes)
        asked = {k: getattr(preset, k) for k in ARCHITECTURE_FIELDS}
    diffs = [f"{k} {v} vs {getattr(model, k)}" for k, v in asked.items() if getattr(model, k) != v]
    if diffs:
        given = ([f"--arch {opts.arch}"] if opts.arch else []) + [f"--{k.replace('_', '-')}" for k in sizes]
        raise NmtError(f"{opts.init_from}: fine-tuning keeps this model's architecture, but {' '.join(given)} asks "
                       f"for another ({', '.join(diffs)}); drop {'it' if len(given) == 1 else 'them'}")


# Options whose change breaks an exact resume: the batches (and so the saved data position) or the random
# streams would differ. World size is handled by TrainState.rescale.
EXACT_RESUME_OPTIONS = ("max_tokens", "update_freq", "seed")
# Options a resumed run may change; it follows the new values from the next update on, and says so.
# The dropout rates may change too; they are compared as the model config has them (see `resumed_config`).
SCHEDULE_OPTIONS = ("lr_scale", "lr", "warmup", "cooldown", "label_smoothing", "clip_norm", "precision",
                    "adam_betas", "weight_decay")
DROPOUT_FIELDS = ("dropout", "attention_dropout", "activation_dropout")


def changed_options(path: Path, opts: TrainOptions) -> list[str]:
    """Compare a resumed run's options with the `options.json` its save dir recorded: one-line error for an
    option that cannot change without breaking the exact resume; 'warmup 4000 -> 1000' for each schedule option
    that changed (the run goes on with the new value)."""
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # written by a killed run mid-way: nothing to compare against
    new = json.loads(json.dumps(asdict(opts), default=str))
    for name in EXACT_RESUME_OPTIONS:
        if name in old and old[name] != new[name]:
            flag = "--" + name.replace("_", "-")
            raise NmtError(f"{path.parent}: {flag} {new[name]} differs from the run being resumed ({old[name]}): its "
                           f"saved data position would map onto other batches; resume with {flag} {old[name]} or use "
                           "another --save-dir")
    return [f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in SCHEDULE_OPTIONS if k in old and old[k] != new[k]]


def world_size_change(old: int, new: int, opts: TrainOptions) -> str:
    """What a resume on another number of processes changes: the update's size, and the data position (no
    longer bit-exact: the epoch's batches are dealt to the processes anew)."""
    return (f"{old} -> {new} processes (an update now holds {new * opts.update_freq} batches instead of "
            f"{old * opts.update_freq}; keep --update-freq x processes constant for the same batch size; the epoch "
            "goes on from the same point, but not bit-exactly as it would have)")


def schedule_warning(opts: TrainOptions) -> str | None:
    """A line for a schedule that cannot do what eq. 3 intends within the update budget, else None."""
    if opts.max_updates and opts.warmup > opts.max_updates:
        return (f"--warmup {opts.warmup} is more than --max-updates {opts.max_updates}: the learning rate rises the "
                "whole run and never reaches its peak; with little data try the Multi30k recipe's --warmup 1000 "
                "--lr-scale 0.5, or a --warmup below the budget")
    return None


def stopping_line(opts: TrainOptions) -> str:
    """How the run will stop and how to stop it safely, said once at start-up."""
    def count(n: float, noun: str) -> str:
        return f"{n:,g} {noun}" + ("" if n == 1 else "s")

    limits = [count(opts.max_updates, "update") if opts.max_updates else "",
              count(opts.max_epochs, "epoch") if opts.max_epochs else "",
              count(opts.max_time, "minute") if opts.max_time else "",
              count(opts.patience, "validation") + " without improvement" if opts.patience else ""]
    limits = [x for x in limits if x]
    safe = ("Ctrl-C (or SIGTERM) saves checkpoint_last.pt after the current update and stops; the same command "
            "resumes")
    if not limits:
        return ("no stopping limit (--max-updates, --max-epochs, --max-time or --patience): trains until stopped; "
                + safe)
    return f"stops after {' or '.join(limits)}, whichever comes first; " + safe


def schedule_line(opts: TrainOptions, d_model: int, scale: float) -> str:
    """The learning rate and optimizer a run trains with, said once at start-up: whichever of --lr and
    --lr-scale was given, both in the other's terms."""
    peak = inverse_sqrt_lr(opts.warmup, d_model, opts.warmup, scale)
    betas = ", ".join(f"{b:g}" for b in opts.adam_betas)
    decay = f", weight decay {opts.weight_decay:g} (decoupled)" if opts.weight_decay else ""
    return (f"learning rate: eq. 3 with --warmup {opts.warmup}, peak {peak:.3g} at update {opts.warmup} "
            f"(--lr {peak:.3g} = --lr-scale {scale:.4g}); Adam betas ({betas}){decay}")


def end_of_run(summary: dict, save_dir: Path) -> tuple[str, int]:
    """The line `nmt train` ends with, and its exit code (130 / 143 after SIGINT / SIGTERM, else 0)."""
    if summary["reason"] == "already_finished":
        return (f"nothing to do: {save_dir} already finished ({summary['finished_by']}, {summary['updates']} "
                "updates); raise that limit to train further"), 0
    if summary["reason"] in EXIT_CODES:
        return (f"stopped by {summary['reason']} after update {summary['updates']}; "
                f"{Path(save_dir) / 'checkpoint_last.pt'} saved (run the same command to resume)",
                EXIT_CODES[summary["reason"]])
    best = summary["best"]
    shown = "none (no validation ran)" if best is None else f"{best:.3f}"
    return (f"stopped ({summary['reason']}) after {summary['updates']} updates, {summary['elapsed']:.0f} s; "
            f"best {shown}"), 0


def check_lengths(data: DataDir, splits: dict, config: ModelConfig) -> None:
    """Refuse, before training starts, data with sentences the model's positions cannot hold."""
    for name, corpus in splits.items():
        longest = max(int(corpus.src.sizes.max(initial=0)), int(corpus.tgt.sizes.max(initial=0)))
        if longest + 1 > config.max_positions:  # + </s> (or <s>)
            raise NmtError(f"{data.path}: the {name} split has a sentence of {longest} tokens, more than the "
                           f"model's {config.max_positions} positions hold; re-run nmt prepare (--max-len)")


def metrics_line(metrics: dict) -> str:
    """'valid_loss 2.816 valid_nll ...' for the log lines."""
    return " ".join(f"{k} {v:.3f}" for k, v in metrics.items())


class Trainer:
    """One training run. `run` loops over updates; each goes through `step` (the update), then `should_stop`
    and `validate_and_save` (the bookkeeping), so no kind of update can skip the bookkeeping (fairseq's
    `train_step` / `validate_and_save` / `should_stop` split)."""

    def __init__(self, opts: TrainOptions) -> None:
        check_options(opts)
        self.device = device = resolve_device(opts.device, int(os.environ.get("LOCAL_RANK", "0")))
        # `auto` is recorded (options.json, the log) as what it chose on this device
        self.opts = opts = replace(opts, precision=resolve_precision(opts.precision, device),
                                   compile=device.type == "cuda" if opts.compile is None else opts.compile)
        self.data = data = DataDir.open(opts.data)
        initial = self.initial_model(data) if opts.init_from is not None else None
        if initial is not None:  # the model's own architecture; only the dropout rates may change
            rates = {"dropout": opts.dropout, "attention_dropout": opts.attention_dropout,
                     "activation_dropout": opts.activation_dropout}
            changes = {k: v for k, v in rates.items() if v is not None}
            config = replace(ModelConfig.from_dict(initial["config"]), **changes)
            check_architecture_flags(opts, config)
        else:
            if data.own_target_vocab is not None:
                raise NmtError(f"{data.path}: has a target vocabulary of its own (prepared --from-model): train it "
                               "with --init-from that model")
            config = make_config(opts.arch or "base", len(data.vocab), pad=data.vocab.pad, layers=opts.layers,
                                 d_model=opts.d_model, ffn=opts.ffn, heads=opts.heads, dropout=opts.dropout,
                                 attention_dropout=opts.attention_dropout,
                                 activation_dropout=opts.activation_dropout, pre_norm=opts.pre_norm,
                                 head_dim=opts.head_dim, learned_positions=opts.learned_positions)
        self.save_dir = Path(opts.save_dir)
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise NmtError(f"{self.save_dir}: not a directory (--save-dir)")
        self.last_path = self.save_dir / "checkpoint_last.pt"
        resume = load_checkpoint(self.last_path) if self.last_path.exists() else None
        self.schedule_changes: list[str] = []
        if resume is not None:
            check_resume(resume, self.last_path, config, data)
            self.schedule_changes = changed_options(self.save_dir / "options.json", opts)
            config, rate_changes = resumed_config(ModelConfig.from_dict(resume["config"]), config, opts)
            self.schedule_changes += rate_changes
        self.config = config
        self.resumed = resume is not None
        # Names the run in each of its checkpoints (kept on resume), so that averaging can refuse to mix runs.
        self.run_id = (resume or {}).get("run") or secrets.token_hex(8)

        self.ctx = ctx = D.init_distributed(device)
        if ctx.enabled:
            self.agree_on_save_dir(resume)
        torch.manual_seed(opts.seed)
        self.model = model = Transformer(config).to(device)
        if opts.compile:
            model.compile_layers()
        self.compile_pending = opts.compile  # the first update compiles: its time is reported
        # fused: one kernel for all parameters' Adam update (CPU and CUDA); the per-tensor loop cost 4x more.
        self.optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=tuple(opts.adam_betas), eps=1e-9,
                                          weight_decay=opts.weight_decay, decoupled_weight_decay=True, fused=True)
        self.lr_scale = effective_lr_scale(opts, config.d_model)
        self.scaler = torch.amp.GradScaler(device.type, enabled=opts.precision == "fp16")
        self.state = TrainState(world_size=ctx.world_size)
        if initial is not None and resume is None:
            model.load_state_dict(initial["model"])
        if resume is not None:
            model.load_state_dict(resume["model"])
            self.optimizer.load_state_dict(resume["optimizer"])
            for group in self.optimizer.param_groups:  # the saved ones; a resume may change them (and says so)
                group["betas"], group["weight_decay"] = tuple(opts.adam_betas), opts.weight_decay
            if (fresh_scale := restore_scaler(self.scaler, resume["scaler"])) is not None:
                self.schedule_changes.append(fresh_scale)
            self.state = TrainState.from_dict(resume["progress"])
            rngs = resume["rng"]
            set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0], device)
            if self.state.world_size != ctx.world_size:
                self.schedule_changes.append(world_size_change(self.state.world_size, ctx.world_size, opts))
            self.state.rescale(ctx.world_size)

        # The exponential moving average of the weights (--ema), in fp32 beside them; a resume goes on with it.
        self.ema: dict[str, torch.Tensor] | None = None
        if opts.ema:
            saved = (resume or {}).get("ema") or {}
            self.ema = {name: (saved[name].to(device, torch.float32) if name in saved else
                               p.detach().to(torch.float32).clone()) for name, p in model.named_parameters()}
            self.ema_pairs = ([self.ema[name] for name, _ in model.named_parameters()],
                              [p for _, p in model.named_parameters()])

        self.train_corpus, self.valid_corpus = data.split("train"), data.split("valid")
        self.dropout_draws = data.dropout_draws()  # BPE-dropout: epoch E reads draw (E - 1) mod their number
        check_lengths(data, {"train": self.train_corpus, "valid": self.valid_corpus,
                             **{f"BPE-dropout draw {k}": d for k, d in enumerate(self.dropout_draws, start=1)}}, config)
        self.batches = make_batches(self.train_corpus.src.sizes, self.train_corpus.tgt.sizes, opts.max_tokens,
                                    opts.seed)
        self.valid_batches = make_batches(self.valid_corpus.src.sizes, self.valid_corpus.tgt.sizes, opts.max_tokens,
                                          opts.seed)
        self.weighting = data.corpus_weights()  # several corpora, weighted: each epoch draws its own pairs
        if len(self.batches) < ctx.world_size:
            raise NmtError(f"{data.path}: {len(self.batches)} training batches cannot feed {ctx.world_size} processes")
        self.loss_module = TranslationLoss(model, opts.label_smoothing)
        if ctx.enabled:
            ids = [device.index] if device.type == "cuda" else None
            # The only buffer (sinusoidal positions) is a constant: no need to broadcast it every step (the flag
            # is `forward_sync_buffers` from torch 2.12 on, `broadcast_buffers` before).
            no_sync = {BUFFER_SYNC_FLAG: False}
            # Gradients as views into DDP's communication buckets: no copy between them after each all-reduce
            # (so they are zeroed in place, not set to None: `update.train_step`).
            self.runner: nn.Module = DistributedDataParallel(self.loss_module, device_ids=ids,
                                                             gradient_as_bucket_view=True, **no_sync)
            if opts.comm_precision != "fp32":
                self.runner.register_comm_hook(None, gradient_compression_hook(opts.comm_precision))
        else:
            self.runner = self.loss_module
        self.runner.train()
        # Numbered checkpoints (what `nmt average --last N` reads) come from one regular schedule: the update or
        # minute interval when one is given, else epoch ends; and the final update. Other saves (a stop signal,
        # an epoch end under an interval) update checkpoint_last.pt only.
        self.interval_given = opts.save_interval_updates > 0 or opts.save_interval_minutes > 0
        self.window = Window()
        self.stops = StopRequests()
        self.writer = CheckpointWriter(background=opts.background_save)
        self.log = JsonLog(None)

    def agree_on_save_dir(self, resume: dict | None) -> None:
        """Multi-process runs: every process must see the save dir rank 0 writes to and have loaded the same
        resume point from it, else all refuse with one line (a node that resumed from nothing while the others
        resumed would train other weights, silently, until a collective hangs)."""
        ctx = self.ctx
        marker = self.save_dir / ".shared-check"
        token = secrets.token_hex(8) if ctx.is_main else None
        if ctx.is_main:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            with atomic_path(marker) as tmp:
                tmp.write_text(token, encoding="utf-8")
        token = D.broadcast_object(token, ctx)  # sent once the marker is written
        wait = shared_dir_wait()
        deadline = time.monotonic() + wait
        while not (seen := read_small_file(marker) == token) and time.monotonic() < deadline:
            # A network filesystem may show another node's new folder or file late: an NFS client keeps a
            # cached "does not exist" for up to 60 s by default (acdirmax). Listing the folder and its parent
            # makes it ask the server again.
            for folder in (self.save_dir.parent, self.save_dir):
                with suppress(OSError):
                    os.listdir(folder)
            time.sleep(0.5)
        point = (resume["updates"], resume.get("sha256")) if resume is not None else None
        views = D.gather_objects((socket.gethostname(), seen, point), ctx)
        blind = [f"rank {rank} on {host}" for rank, (host, saw, _) in enumerate(views) if not saw]
        if blind:
            raise NmtError(f"{self.save_dir}: {', '.join(blind)} cannot see the --save-dir rank 0 writes to "
                           f"(waited {wait:g} s for it; NMT_SHARED_DIR_WAIT=SECONDS waits longer); a multi-node run "
                           "needs --save-dir on one filesystem shared by every node")
        points = {p for _, _, p in views}
        if len(points) > 1:
            found = ", ".join(f"rank {r}: {'update ' + str(p[0]) if p else 'no checkpoint'}"
                              for r, (_, _, p) in enumerate(views))
            raise NmtError(f"{self.last_path}: the processes loaded different resume points ({found}); was it "
                           "replaced while the run started? start it again")

    def initial_model(self, data: DataDir) -> dict:
        """The --init-from checkpoint, checked against the data's vocabulary."""
        state = load_checkpoint(self.opts.init_from)
        if "model" not in state or "config" not in state or "vocab" not in state:
            raise NmtError(f"{self.opts.init_from}: not a model checkpoint (no model, config or vocabulary)")
        model_tokenizer = (state.get("tokenizer") or {}).get("name", "moses")
        data_tokenizer = (data.meta.get("tokenizer") or {}).get("name", "moses")
        if model_tokenizer != data_tokenizer:
            raise NmtError(f"{self.opts.init_from}: the model was trained on --tokenizer {model_tokenizer} data, but "
                           f"{data.path} was prepared with --tokenizer {data_tokenizer}; prepare the fine-tuning data "
                           f"with nmt prepare --from-model {self.opts.init_from}")
        if state["vocab"] != data.vocab.symbols or target_vocabulary(state) != data.target_vocab:
            raise NmtError(f"{self.opts.init_from}: vocabulary differs from {data.path / 'vocab.txt'}; prepare the "
                           f"fine-tuning data with nmt prepare --from-model {self.opts.init_from}")
        return state

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        """Train until a stop condition; return the final progress record (with `reason`)."""
        opts, ctx, state = self.opts, self.ctx, self.state
        if ctx.is_main:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        with SaveDirLock(self.save_dir) if ctx.is_main else nullcontext(), self.stops:
            if ctx.is_main:
                remove_temporaries(self.save_dir)  # left by killed runs; the lock says none is running
                set_aside = None if self.resumed else set_aside_earlier_run(self.save_dir)
                # the options as given, and the architecture that ran (the --init-from model's, or the preset's)
                options = asdict(opts) | {"model": self.config.to_dict()}
                (self.save_dir / "options.json").write_text(json.dumps(options, default=str, indent=2) + "\n")
            board = tensorboard_writer(opts.tensorboard) if opts.tensorboard is not None and ctx.is_main else None
            self.log = JsonLog(self.save_dir / "train.jsonl" if ctx.is_main else None, board)
            finished = self.finished_reason()
            if finished is not None:
                summary = {"event": "end", "reason": "already_finished", "finished_by": finished, **state.to_dict()}
                self.log.write(summary)
                self.log.close()
                D.shutdown(ctx)
                return summary
            self.log.write({"event": "start", "resumed_at": state.updates if self.resumed else None,
                            "parameters": count_parameters(self.model), "config": self.config.to_dict(),
                            "world_size": ctx.world_size, "device": str(self.device),
                            "machine": device_kind(self.device), "precision": opts.precision,
                            "allocator": loaded_allocator() or "system"})
            # (message, printed with --quiet too): what a resume changes is not progress; advice on a schedule is
            warnings = [] if self.resumed else [(schedule_warning(opts), False)]
            if ctx.is_main and set_aside is not None:  # not progress: printed with --quiet too
                count, folder = set_aside
                message = (f"{self.save_dir} holds {count} numbered checkpoints but no checkpoint_last.pt (a run that "
                           f"ended before its first full save cannot be resumed): starting afresh, with that run's "
                           f"checkpoints and log moved to {folder} so that nmt average --last never mixes two runs")
                self.log.write({"event": "warning", "message": message})
                print(f"nmt train: warning: {message}", file=sys.stderr, flush=True)
            if self.schedule_changes:
                warnings.append((f"resuming at update {state.updates} with {'; '.join(self.schedule_changes)}: "
                                 "the new values apply from the next update on", True))
            for warning, always in warnings:
                if warning is None:
                    continue
                self.log.write({"event": "warning", "message": warning})
                if ctx.is_main and (always or not opts.quiet):
                    print(f"nmt train: warning: {warning}", file=sys.stderr, flush=True)
            if ctx.is_main and not opts.quiet:
                print(f"nmt train: {stopping_line(opts)}", file=sys.stderr, flush=True)
                print(f"nmt train: {schedule_line(opts, self.config.d_model, self.lr_scale)}", file=sys.stderr,
                      flush=True)
            if opts.init_from is not None and not self.resumed:
                self.validate_starting_point()
            self.start = time.monotonic() - state.elapsed
            self.last_interval_save = self.last_state_save = time.monotonic()
            reason = None
            # A terminal gets a live bar; a log file (nohup, SLURM, `> log`) gets plain timestamped lines.
            self.plain = ctx.is_main and not opts.quiet and not sys.stdout.isatty()
            if self.plain:
                plain_line(f"nmt {__version__}: nmt {' '.join(sys.argv[1:])}")
                plain_line(f"{count_parameters(self.model):,} parameters, {ctx.world_size} process(es) on "
                           f"{self.device}, {opts.precision}; "
                           + (f"resuming at update {state.updates}" if self.resumed else "starting") + "; config "
                           + json.dumps({k: v for k, v in asdict(opts).items() if k not in ("quiet",)}, default=str))
            bar = Progress(TextColumn("[bold]train[/]"), BarColumn(), TextColumn("{task.fields[status]}"),
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           disable=opts.quiet or not ctx.is_main or self.plain)
            with bar:
                self.bar, self.task = bar, bar.add_task("train", total=opts.max_updates or None,
                                                        completed=state.updates, status="")
                try:
                    while reason is None:
                        reason = self.run_epoch()
                finally:
                    self.writer.wait()  # the last save is on disk before the run reports its end
            summary = {"event": "end", "reason": reason, **state.to_dict()}
            self.log.write(summary)
            self.log.close()
        D.shutdown(ctx)
        return summary

    def report_compile(self, seconds: float) -> None:
        """Log (and print) how long the first update took with the layers compiled in it."""
        self.log.write({"event": "compiled", "seconds": round(seconds, 1)})
        if self.ctx.is_main and not self.opts.quiet:
            message = f"compiled the encoder and decoder layers (torch.compile) in {seconds:.0f} s, the first update"
            if sys.stdout.isatty():
                print(f"nmt train: {message}", file=sys.stderr, flush=True)
            else:
                plain_line(message)

    def validation_metrics(self) -> tuple[dict, float]:
        """Validation loss, NLL and perplexity (and BLEU with --eval-bleu) over every process, and the figure
        that ranks checkpoints: BLEU with --eval-bleu, else the loss."""
        opts, ctx = self.opts, self.ctx
        with self.moving_average_in_model():
            metrics = validate(self.loss_module, self.valid_corpus, self.valid_batches, self.data.vocab,
                               opts.precision, self.device, ctx)
            if opts.eval_bleu:
                score = valid_bleu(self.model, self.data, self.device, opts.precision) if ctx.is_main else 0.0
                (metrics["valid_bleu"],) = D.all_reduce([score], ctx, self.device)
        return metrics, metrics["valid_bleu"] if opts.eval_bleu else metrics["valid_loss"]

    @contextlib.contextmanager
    def moving_average_in_model(self) -> Iterator[None]:
        """With --valid-ema, the model holds its moving average while the block runs, and its own weights again
        after it, bit for bit; otherwise nothing changes."""
        if not (self.opts.valid_ema and self.ema is not None):
            yield
            return
        averages, params = self.ema_pairs
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, average in zip(params, averages):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, weights in zip(params, saved):
                    p.copy_(weights)

    def validate_starting_point(self) -> None:
        """Fine-tuning: validate the --init-from model on the new data before the first update. It is the first
        candidate for the best checkpoint (fine-tuning that only makes the model worse leaves it the best), and
        its line is printed like every validation's."""
        opts, ctx, state = self.opts, self.ctx, self.state
        metrics, state.best = self.validation_metrics()
        self.log.write({"event": "valid", "update": 0, **metrics, "best": state.best, "baseline": True})
        if ctx.is_main:
            self.writer.save([(self.host_copy(None), [self.save_dir / "checkpoint_best.pt"])])
            if not opts.quiet:
                shown = f"update 0 (the --init-from model): {metrics_line(metrics)} (best)"
                if sys.stdout.isatty():
                    print(shown, flush=True)
                else:
                    plain_line(shown)

    def epoch_corpus(self, epoch: int) -> ParallelCorpus:
        """The training pairs as epoch `epoch` reads them: train, or with BPE-dropout one draw after another."""
        if not self.dropout_draws:
            return self.train_corpus
        return self.dropout_draws[(epoch - 1) % len(self.dropout_draws)]

    def epoch_batches(self, epoch: int) -> list:
        """The batches of an epoch, unshuffled: the same every epoch, unless corpora are weighted
        (`binarized.weighted_batches`); then each corpus's share of the epoch's target tokens is logged. With
        BPE-dropout, the batches of the epoch's draw."""
        corpus = self.epoch_corpus(epoch)
        if self.weighting is None:
            if not self.dropout_draws:
                return self.batches
            return make_batches(corpus.src.sizes, corpus.tgt.sizes, self.opts.max_tokens, self.opts.seed)
        ids, weights = self.weighting
        batches = weighted_batches(corpus.src.sizes, corpus.tgt.sizes, ids, weights, self.opts.max_tokens,
                                   self.opts.seed, epoch)
        if self.ctx.is_main and self.state.batch_pos == 0:
            sample = np.concatenate(batches)
            tokens = np.bincount(ids[sample], weights=corpus.tgt.sizes[sample] + 1, minlength=len(weights))
            names = [c["name"] for c in self.data.meta["corpora"]]
            shares = {n: round(float(t / tokens.sum()), 4) for n, t in zip(names, tokens)}
            self.log.write({"event": "corpora", "epoch": epoch, "target_token_shares": shares,
                            "weights": dict(zip(names, weights))})
            if not self.opts.quiet:
                plain_line(f"epoch {epoch}: target tokens by corpus "
                           + ", ".join(f"{n} {100 * v:.1f}% (weight {w:g})" for (n, v), w in zip(shares.items(),
                                                                                                   weights)))
        return batches

    def run_epoch(self) -> str | None:
        """The rest of the current epoch (or until a stop); returns the stop reason, if any."""
        opts, ctx, state = self.opts, self.ctx, self.state
        corpus = self.epoch_corpus(state.epoch)
        epoch_batches = shuffled(self.epoch_batches(state.epoch), opts.seed, state.epoch)
        per_rank = len(epoch_batches) // ctx.world_size
        mine = epoch_batches[ctx.rank :: ctx.world_size][:per_rank]
        groups = [mine[i : i + opts.update_freq] for i in range(state.batch_pos, len(mine), opts.update_freq)]
        pin = self.device.type == "cuda"

        def make_group(group: list) -> list[Batch]:
            batches = [collate(corpus, idx, self.data.vocab) for idx in group]
            return [b.pin_memory() for b in batches] if pin else batches

        # On CUDA the next group is collated (and pinned) on a background thread while this one runs.
        with closing(prefetch(make_group, groups, background=pin)) as stream:
            for micro in stream:
                reason = self.step([b.to(self.device, non_blocking=pin) for b in micro], len(mine))
                if reason is not None:
                    return reason
        return None

    def step(self, micro: list[Batch], batches_in_epoch: int) -> str | None:
        """One update and its bookkeeping; returns the stop reason, if any."""
        opts, state = self.opts, self.state
        lr = inverse_sqrt_lr(state.updates + 1, self.config.d_model, opts.warmup, self.lr_scale)
        lr *= cooldown_factor(self.budget_used(), opts.cooldown)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        started = time.monotonic()
        try:
            loss, global_tokens, shared = train_step(self.runner, self.model, micro, self.optimizer, self.scaler,
                                                     opts, self.ctx, self.device,
                                                     lambda: self.host_flags(time.monotonic()))
        except torch._dynamo.exc.BackendCompilerFailed as e:  # a missing C++ compiler or Triton, say
            cause = getattr(e, "inner_exception", None) or e
            reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise NmtError(f"--compile: torch.compile could not compile the layers ({reason}); train with "
                           "--no-compile") from None
        now = time.monotonic()
        if self.compile_pending:
            self.compile_pending = False
            self.report_compile(now - started)
        time_up, save_due, state_due, signalled = self.read_flags(shared)
        skipped = global_tokens is None
        state.batch_pos += len(micro)
        end_of_epoch = state.batch_pos >= batches_in_epoch
        if end_of_epoch:
            state.epoch += 1
            state.batch_pos = 0
        if skipped:
            # Weights, optimizer and schedule untouched; the bookkeeping below still runs (an epoch end stays one).
            self.log.write({"event": "skipped", "update": state.updates + 1, "reason": "non-finite gradients",
                            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None})
        else:
            state.updates += 1
            self.window.add(loss, global_tokens)
            if self.ema is not None:
                update_ema(*self.ema_pairs, self.opts.ema)
        reason = self.should_stop(end_of_epoch, time_up, signalled)
        if not skipped and (state.updates % opts.log_interval == 0 or reason is not None):
            self.log_train(lr, now, end_of_epoch)
        self.bar.update(self.task, completed=state.updates)
        return self.validate_and_save(end_of_epoch, skipped, save_due, reason, state_due)

    def budget_used(self) -> float:
        """The share of the training budget spent so far: the larger of updates / --max-updates and
        elapsed / --max-time (0 when neither is set)."""
        opts, state = self.opts, self.state
        shares = [0.0]
        if opts.max_updates:
            shares.append(state.updates / opts.max_updates)
        if opts.max_time:
            shares.append(state.elapsed / (opts.max_time * 60))
        return max(shares)

    def host_flags(self, now: float) -> list[float]:
        """This process's view of: time limit reached, minute interval due, full state due, SIGTERM, SIGINT
        received, seconds of training; `train_step` sums them over processes with its loss (no extra host
        read)."""
        opts = self.opts
        elapsed = now - self.start
        save_due = opts.save_interval_minutes > 0 and now - self.last_interval_save >= opts.save_interval_minutes * 60
        state_due = (opts.state_interval_minutes > 0
                     and now - self.last_state_save >= opts.state_interval_minutes * 60)
        return [float(opts.max_time > 0 and elapsed >= opts.max_time * 60), float(save_due), float(state_due),
                float(self.stops.requested == "SIGTERM"), float(self.stops.requested == "SIGINT"), elapsed]

    def read_flags(self, summed: list[float]) -> tuple[bool, bool, bool, str | None]:
        """Time limit reached, minute interval due, full state due, stop signal received: the same on every
        process (each flag raised by any process counts; the clock is the processes' mean, so a time-based
        --cooldown gives them the same learning rate)."""
        time_up, save_due, state_due, sigterm, sigint, elapsed = summed
        self.state.elapsed = elapsed / self.ctx.world_size
        signalled = "SIGINT" if sigint > 0 else "SIGTERM" if sigterm > 0 else None
        return time_up > 0, save_due > 0, state_due > 0, signalled

    def should_stop(self, end_of_epoch: bool, time_up: bool, signalled: str | None) -> str | None:
        """Why training stops after this update, if it does."""
        opts, state = self.opts, self.state
        # A limit first: a stop signal that lands on the final update still ends the run as finished (final
        # validation, final numbered checkpoint, exit 0: nothing left for a requeued job to do).
        if opts.max_updates and state.updates >= opts.max_updates:
            return "max_updates"
        if end_of_epoch and opts.max_epochs and state.epoch > opts.max_epochs:
            return "max_epochs"
        if time_up:
            return "max_time"
        return signalled

    def finished_reason(self) -> str | None:
        """The limit a resumed run has already reached (re-running a finished command trains nothing)."""
        if not self.resumed:
            return None
        opts, state = self.opts, self.state
        time_up = bool(opts.max_time) and state.elapsed >= opts.max_time * 60
        # epoch > max_epochs can only hold right after an epoch ended
        reason = self.should_stop(end_of_epoch=True, time_up=time_up, signalled=None)
        if reason is None and opts.patience and state.bad_validations >= opts.patience:
            reason = "patience"
        return reason

    def log_train(self, lr: float, now: float, end_of_epoch: bool) -> None:
        state = self.state
        record = {"event": "train", "update": state.updates, "epoch": state.epoch - end_of_epoch,
                  **self.window.read(now), "lr": lr, "elapsed_s": round(state.elapsed, 1)}
        self.log.write(record)
        status = f"upd {state.updates} loss {record['loss']:.3f} lr {lr:.2e} {record['tgt_tokens_per_s']:,.0f} tok/s"
        self.bar.update(self.task, status=status)
        if self.plain:
            eta = self.eta()
            plain_line(f"epoch {record['epoch']} | {status} | elapsed {_clock(state.elapsed)}"
                       + (f" | eta {_clock(eta)}" if eta is not None else ""))

    def eta(self) -> float | None:
        """Seconds left until --max-updates or --max-time, whichever comes first (None without either)."""
        opts, state = self.opts, self.state
        left = []
        if opts.max_time:
            left.append(max(opts.max_time * 60 - state.elapsed, 0.0))
        if opts.max_updates and state.updates:
            left.append(state.elapsed / state.updates * (opts.max_updates - state.updates))
        return min(left) if left else None

    def validate_and_save(self, end_of_epoch: bool, skipped: bool, save_due: bool, reason: str | None,
                          state_due: bool = False) -> str | None:
        """Validation and checkpoints after an update; returns the stop reason (patience may add one).
        Numbered checkpoints (for averaging) and the best one hold the weights; checkpoint_last.pt, the full
        training state for an exact resume, is written at epoch ends, at the end, on a stop signal and every
        --state-interval-minutes: on a GPU the numbered ones come every few seconds, and Adam's moments would
        double what each of them writes and stalls."""
        opts, state, ctx = self.opts, self.state, self.ctx
        updates = state.updates
        signalled = reason in EXIT_CODES
        finished = reason is not None and not signalled  # a limit: the end of training
        # A stop signal skips nothing this update was due (an epoch end's validation and numbered checkpoint
        # would otherwise be lost for good); it only adds the save of checkpoint_last.pt.
        on_interval = not skipped and bool(opts.valid_interval) and updates % opts.valid_interval == 0
        do_valid = on_interval or (not opts.valid_interval and end_of_epoch) or finished
        if self.interval_given:
            numbered = save_due or (not skipped and bool(opts.save_interval_updates)
                                    and updates % opts.save_interval_updates == 0)
        else:
            numbered = end_of_epoch
        numbered = numbered or finished  # the final update is always numbered: `nmt average --last N` ends there
        full_state = end_of_epoch or reason is not None or state_due
        improved = False
        if do_valid:
            metrics, value = self.validation_metrics()
            improved = state.best is None or (value > state.best if opts.eval_bleu else value < state.best)
            if improved:
                state.best, state.bad_validations = value, 0
            else:
                state.bad_validations += 1
            self.log.write({"event": "valid", "update": updates, **metrics, "best": state.best})
            if not opts.quiet and ctx.is_main:
                shown = f"update {updates}: {metrics_line(metrics)}"
                shown += " (best)" if improved else ""
                if self.plain:
                    plain_line(shown)
                else:
                    self.bar.console.print(shown)
            if opts.patience and state.bad_validations >= opts.patience and reason is None:
                reason = "patience"
                full_state = numbered = True
        if full_state or numbered or improved:
            rngs = D.gather_objects(rng_state(self.device), ctx) if full_state else None
            if ctx.is_main:
                weights = ([self.save_dir / f"checkpoint_{updates}.pt"] if numbered else []) + \
                    ([self.save_dir / "checkpoint_best.pt"] if improved else [])
                copy = self.host_copy(rngs)
                saves = ([(model_only(copy), weights)] if weights else []) + \
                    ([(copy, [self.last_path])] if full_state else [])
                self.writer.save(saves, self.prune if numbered else None)
            now = time.monotonic()
            if save_due:
                self.last_interval_save = now
            if full_state:
                self.last_state_save = now
        if signalled:
            self.log.write({"event": "stop", "signal": reason, "update": updates})
        return reason

    def host_copy(self, rngs: list | None) -> dict:
        """The checkpoint's contents copied to host memory (the writer serializes the copy while training
        changes the live tensors): the full training state, or without `rngs` the weights only."""
        return to_host(self.checkpoint(rngs))

    def prune(self) -> None:
        """Remove numbered checkpoints beyond the newest --keep-last."""
        if self.opts.keep_last > 0:
            for old in numbered_checkpoints(self.save_dir)[: -self.opts.keep_last]:
                old.unlink(missing_ok=True)

    def checkpoint(self, rngs: list | None) -> dict:
        """What a checkpoint holds: the self-contained model and, given the processes' `rngs`, the complete
        training state."""
        data = self.data
        model = {
            "model": self.model.state_dict(),
            "config": self.model.config.to_dict(),
            "vocab": data.vocab.symbols,
            "bpe_codes": data.bpe_codes,
            "sentencepiece": data.sentencepiece,
            **({"target_vocab": data.target_vocab.symbols} if data.own_target_vocab is not None else {}),
            **({"target_sentencepiece": data.target_sentencepiece} if data.target_sentencepiece else {}),
            **({"target_token": data.meta["target_token"]} if data.meta.get("target_token") else {}),
            "source_lang": data.source_lang,
            "target_lang": data.target_lang,
            "tokenizer": data.meta.get("tokenizer", {}),
            "updates": self.state.updates,
            "run": self.run_id,
            **({"ema": self.ema} if self.ema is not None else {}),
        }
        if rngs is None:
            return model
        return {**model, "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "rng": rngs,
                "progress": self.state.to_dict()}


def set_aside_earlier_run(save_dir: Path) -> tuple[int, Path] | None:
    """Before a fresh run in a save dir without checkpoint_last.pt: move the numbered checkpoints, the best one
    and the log another run left there (one that ended before its first full save) into save_dir/earlier-run-N;
    returns how many numbered ones and where, or None when there were none."""
    earlier = numbered_checkpoints(save_dir)
    if not earlier:
        return None
    n = 1
    while (save_dir / f"earlier-run-{n}").exists():
        n += 1
    folder = save_dir / f"earlier-run-{n}"
    folder.mkdir()
    for path in [*earlier, save_dir / "checkpoint_best.pt", save_dir / "train.jsonl"]:
        if path.exists():
            os.replace(path, folder / path.name)
    return len(earlier), folder


BUFFER_SYNC_FLAG = ("forward_sync_buffers" if "forward_sync_buffers" in
                    inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


def shared_dir_wait() -> float:
    """Seconds a process waits to see rank 0's marker in the save dir before it judges the folder not shared:
    NMT_SHARED_DIR_WAIT, else 90 (longer than an NFS client's default attribute cache of a folder, 60 s)."""
    try:
        return max(0.0, float(os.environ.get("NMT_SHARED_DIR_WAIT", "90")))
    except ValueError:
        value = os.environ["NMT_SHARED_DIR_WAIT"]
        raise NmtError(f"NMT_SHARED_DIR_WAIT={value!r} is not a number of seconds") from None


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(opts: TrainOptions) -> dict:
    """Train (or resume) a model as `opts` says; return the final progress record."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    size_kernel_cache(TRAINING_KERNEL_CACHE)
    return Trainer(opts).run()
