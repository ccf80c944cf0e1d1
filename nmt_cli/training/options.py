"""`nmt train`'s options as one dataclass, below both the run loop (`train`) and the update (`update`). Each
field declares its flag (`nmt_cli.option_fields`): the command line, `--config`, `--print-config` and
options.json are made from these declarations."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import get_args, get_type_hints

from nmt_cli.errors import NmtError
from nmt_cli.option_fields import P_DATA, P_DEVICE, P_LOG, P_MODEL, P_OPTIM, P_STOP, option
from nmt_cli.textio import read_small_file
from nmt_cli.torch_env import ALLOCATOR_CHOICES, ALLOCATOR_HELP


def parse_betas(text: str) -> tuple[float, float]:
    """--adam-betas as '0.9,0.98', '0.9 0.98' or fairseq's '(0.9, 0.98)'; one line for anything else."""
    parts = [p for p in text.strip().strip("()[]").replace(",", " ").split() if p]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise NmtError(f"--adam-betas must be two numbers, as '0.9,0.98' (got {text!r})")
    return betas  # type: ignore[return-value]


@dataclass
class TrainOptions:
    """Everything `nmt train` needs, one field per flag (0 means "no limit" / "off")."""

    data: Path = option(argument=True, metavar="DATA_DIR", help="Data directory made by nmt prepare.")
    save_dir: Path = option(panel=P_STOP, help="Where checkpoints and train.jsonl go; re-running resumes.")
    # a preset of model.PRESETS; None: "base", or the --init-from model's
    arch: str | None = option(None, panel=P_MODEL, choices=("tiny", "small", "base", "big"), help=(
        "Model preset: tiny (smoke runs), small (Multi30k on CPU), base and big (the paper's, on GPUs); "
        "default base, or the --init-from model's architecture."))
    layers: int | None = option(None, panel=P_MODEL, help="Encoder and decoder layers (N).")
    d_model: int | None = option(None, panel=P_MODEL, help="Model width.")
    ffn: int | None = option(None, panel=P_MODEL, help="Feed-forward inner width.")
    heads: int | None = option(None, panel=P_MODEL, help="Attention heads.")
    dropout: float | None = option(None, panel=P_MODEL, help="Residual and embedding dropout.")
    attention_dropout: float | None = option(None, panel=P_MODEL, help="Dropout on attention weights.")
    activation_dropout: float | None = option(None, panel=P_MODEL, help="Dropout on the FFN inner layer.")
    pre_norm: bool | None = option(None, panel=P_MODEL, decls=("--pre-norm/--post-norm",),
                                   help="LayerNorm placement.")
    head_dim: int | None = option(None, panel=P_MODEL, help=(
        "Width of one attention head, d_k = d_v (default d_model / heads; Table 3 rows A and B vary it)."))
    learned_positions: bool | None = option(
        None, panel=P_MODEL, decls=("--learned-positions/--sinusoidal-positions",),
        help="Learned position embeddings instead of the paper's sinusoids (Table 3 row E).")
    max_tokens: int = option(4096, panel=P_DATA, help="Tokens per batch (padding counted).")
    update_freq: int = option(1, panel=P_DATA, help="Batches accumulated per update.")
    max_updates: int = option(0, panel=P_STOP, help="Stop after this many updates (0: no limit).")
    max_epochs: int = option(0, panel=P_STOP, help="Stop after this many epochs (0: no limit).")
    # minutes of wall-clock time, validation included
    max_time: float = option(0.0, panel=P_STOP, help="Stop after this many minutes (0: no limit).")
    # precision.auto_precision: bf16 where the device runs it fast, else fp32
    precision: str = option("auto", panel=P_DEVICE, choices=("auto", "fp32", "bf16", "fp16"), help=(
        "Mixed precision (fp16: CUDA only). auto: bf16 where the GPU or CPU multiplies it in hardware (fp16 on "
        "GPUs without bf16), fp32 elsewhere (fp32: exact float32)."))
    # the gradients' all-reduce dtype between processes (a DDP communication hook)
    comm_precision: str = option("fp32", panel=P_DEVICE, choices=("fp32", "bf16", "fp16"), help=(
        "Precision the gradients are all-reduced in between processes (bf16 or fp16: half the bytes, for nodes "
        "joined by a slow network; each process casts the sum back to fp32)."))
    # None: on CUDA only (on CPU it measured slower)
    compile: bool | None = option(
        None, panel=P_DEVICE, decls=("--compile/--no-compile",), show_default="on CUDA, off on CPU", help=(
            "torch.compile the encoder and decoder layers (fused dropout, residual and LayerNorm; far fewer "
            "kernel launches). Compiling takes the first update's time (reported)."))
    seed: int = option(1, panel=P_OPTIM, help="Random seed (initialization, batch order, dropout).")
    device: str | None = option(None, panel=P_DEVICE, choices=("cpu", "cuda"),
                                help="Default: cuda when available, else cpu.")
    save_interval_updates: int = option(0, panel=P_STOP, help="Save a numbered checkpoint every N updates.")
    save_interval_minutes: float = option(0.0, panel=P_STOP, help="Save a numbered checkpoint every M minutes.")
    state_interval_minutes: float = option(10.0, panel=P_STOP, help=(
        "Save the full training state (checkpoint_last.pt: weights, Adam's moments, data position) every M "
        "minutes, as well as at epoch ends and at the end; numbered and best checkpoints hold the weights only "
        "(0: at epoch ends and the end only)."))
    keep_last: int = option(5, panel=P_STOP, help="Numbered checkpoints to keep (0: all).")
    valid_interval: int = option(0, panel=P_STOP, help="Validate every N updates (0: each epoch).")
    eval_bleu: bool = option(False, panel=P_STOP, help="Also greedy-decode valid and pick the best by BLEU.")
    patience: int = option(0, panel=P_STOP, help="Stop after N validations without improvement (0: off).")
    lr_scale: float = option(1.0, panel=P_OPTIM, help="Factor on the eq. 3 learning rate.")
    lr: float | None = option(None, panel=P_OPTIM, show_default=False, help=(
        "The peak learning rate (fairseq's --lr), reached at update --warmup: eq. 3's factor is set to give it "
        "(in place of --lr-scale)."))
    adam_betas: tuple[float, float] = option(
        (0.9, 0.98), panel=P_OPTIM, parse=parse_betas, text="0.9,0.98",  # section 5.3
        help="Adam's beta1 and beta2, as '0.9,0.98' or fairseq's '(0.9, 0.98)' (paper: 0.9, 0.98).")
    weight_decay: float = option(0.0, panel=P_OPTIM, help=(
        "Weight decay, decoupled from the gradient (AdamW), as fairseq's adam applies it (0: off)."))
    ema: float = option(0.0, panel=P_OPTIM, help=(
        "Keep an exponential moving average of the weights with this decay (0.999, say; 0: none), in fp32, "
        "saved in every checkpoint; nmt average --ema makes a model of it."))
    valid_ema: bool = option(False, panel=P_OPTIM, help=(
        "Validate the moving average (--ema) instead of the weights: the logged validation, --eval-bleu and "
        "checkpoint_best rank it."))
    warmup: int = option(4000, panel=P_OPTIM, help=(
        "Warmup updates of eq. 3 (paper: 4000; small data: the Multi30k recipe's 1000 with --lr-scale 0.5)."))
    cooldown: float = option(0.0, panel=P_OPTIM, help=(
        "Lower the learning rate linearly to 0 over this final share of --max-updates/--max-time."))
    label_smoothing: float = option(0.1, panel=P_OPTIM, help="Label smoothing epsilon (paper: 0.1).")
    clip_norm: float = option(0.0, panel=P_OPTIM, help="Clip the gradient norm (0: off).")
    log_interval: int = option(50, panel=P_LOG, help="Updates between log lines.")
    init_from: Path | None = option(None, panel=P_MODEL, help=(
        "Start from this model's weights (and architecture) with a fresh optimizer and schedule: fine-tuning on "
        "data prepared with --from-model."))
    tensorboard: Path | None = option(None, panel=P_LOG, help=(
        "Also write the logged scalars to this folder for tensorboard (pip install -e '.[tensorboard]' in the "
        "clone)."))
    threads: int = option(0, panel=P_DEVICE, help="CPU threads for torch (0: torch's default).")
    cpu_allocator: str = option("auto", panel=P_DEVICE, choices=ALLOCATOR_CHOICES, help=ALLOCATOR_HELP)
    background_save: bool = option(
        True, panel=P_STOP, decls=("--background-save/--no-background-save",),
        help="Write checkpoints on a background thread while training goes on (one save in flight).")
    quiet: bool = option(False, panel=P_LOG, help="No progress bar or log lines.")


# Options a resume does not take from the run being resumed when they are not given: where the run reads and
# writes (always given) and whether it prints progress. (--init-from is kept: the architecture comes from it.)
NOT_KEPT_ON_RESUME = ("data", "save_dir", "quiet")


def kept_run_options(opts: TrainOptions, given: Collection[str]) -> TrainOptions:
    """For a save dir that holds a run to resume (checkpoint_last.pt and its options.json): `opts` with every
    option not in `given` (the flags on the command line) set to the run's own value, so that a resume with no
    flags goes on exactly as the run would have; options given keep their new values (`changed_options` names
    the changes). Anywhere else, `opts` as it is."""
    save_dir = Path(opts.save_dir)
    text = read_small_file(save_dir / "options.json") if (save_dir / "checkpoint_last.pt").is_file() else None
    try:
        stored = json.loads(text) if text else {}
    except ValueError:
        return opts  # written by a killed run mid-way: nothing to keep
    kept = {}
    types = get_type_hints(TrainOptions)
    for f in fields(TrainOptions):
        if f.name in given or f.name in NOT_KEPT_ON_RESUME or f.name not in stored:
            continue
        if f.name == "lr" and "lr_scale" in given:  # the two name one rate: the one given replaces the run's
            continue
        value = stored[f.name]
        if value is not None and Path in (types[f.name], *get_args(types[f.name])):  # JSON keeps a path as text
            value = Path(value)
        kept[f.name] = tuple(value) if isinstance(value, list) else value
    return replace(opts, **kept)
