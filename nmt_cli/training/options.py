"""`nmt train`'s options as one dataclass, below both the run loop (`train`) and the update (`update`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainOptions:
    """Everything `nmt train` needs; mirrors its command-line flags (0 means "no limit" / "off")."""

    data: Path
    save_dir: Path
    arch: str | None = None  # a preset of model.PRESETS; None: "base", or the --init-from model's
    layers: int | None = None
    d_model: int | None = None
    ffn: int | None = None
    heads: int | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    pre_norm: bool | None = None
    head_dim: int | None = None
    learned_positions: bool | None = None
    max_tokens: int = 4096
    update_freq: int = 1
    max_updates: int = 0
    max_epochs: int = 0
    max_time: float = 0.0  # minutes of wall-clock time, validation included
    precision: str = "auto"  # precision.auto_precision: bf16 where the device runs it fast, else fp32
    comm_precision: str = "fp32"  # gradients' all-reduce dtype between processes (DDP communication hook)
    compile: bool | None = None  # torch.compile the layers; None: on CUDA only (on CPU it measured slower)
    seed: int = 1
    device: str | None = None
    save_interval_updates: int = 0
    save_interval_minutes: float = 0.0
    state_interval_minutes: float = 10.0  # the full training state (checkpoint_last.pt) at least this often
    keep_last: int = 5
    valid_interval: int = 0  # updates; 0 validates at the end of each epoch
    eval_bleu: bool = False
    patience: int = 0
    lr_scale: float = 1.0
    lr: float | None = None  # the peak learning rate (fairseq's --lr): sets the eq. 3 factor in its place
    adam_betas: tuple[float, float] = (0.9, 0.98)  # section 5.3
    weight_decay: float = 0.0  # decoupled from the gradient (AdamW), as fairseq's adam applies it
    ema: float = 0.0  # decay of an exponential moving average of the weights, kept in fp32 (0: none)
    valid_ema: bool = False  # validation (and so the best checkpoint) scores the moving average, not the weights
    warmup: int = 4000
    cooldown: float = 0.0  # final share of the budget (--max-updates or --max-time) over which the lr falls to 0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    log_interval: int = 50
    init_from: Path | None = None  # fine-tuning: this model's weights and architecture, fresh optimizer/schedule
    tensorboard: Path | None = None  # also write the logged scalars here for tensorboard
    background_save: bool = True  # write checkpoints on a background thread while training goes on
    quiet: bool = False
