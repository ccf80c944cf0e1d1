"""`nmt plot`: training curves of one or more runs, from their train.jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.textio import atomic_path, iter_lines


def read_log(save_dir: Path) -> list[dict]:
    """The records of SAVE_DIR/train.jsonl; one-line errors for a missing or malformed log."""
    path = Path(save_dir) / "train.jsonl"
    if not Path(save_dir).is_dir():
        raise NmtError(f"{save_dir}: no such save directory")
    if not path.is_file():
        raise NmtError(f"{path}: no such file (has nmt train run with this --save-dir?)")
    records = []
    for number, line in enumerate(iter_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise NmtError(f"{path}:{number}: not a JSON line ({e.msg})") from None
        if not isinstance(record, dict):
            raise NmtError(f"{path}:{number}: not a JSON object")
        records.append(record)
    if not any(r.get("event") == "train" for r in records):
        raise NmtError(f"{path}: no training records yet")
    return records


def _series(records: list[dict], event: str, key: str) -> tuple[list[float], list[float]]:
    rows = [(r["update"], r[key]) for r in records if r.get("event") == event and r.get(key) is not None]
    return [u for u, _ in rows], [v for _, v in rows]


def plot_runs(save_dirs: Sequence[Path], output: Path, x_axis: str = "update") -> None:
    """Write a PNG (or any format matplotlib knows by the suffix) of train/valid loss, valid BLEU (or
    perplexity), learning rate and tokens/s of each run against updates, or against hours of training."""
    if x_axis not in ("update", "time"):
        raise NmtError(f"--x must be update or time (got {x_axis!r})")
    runs = [(Path(d), read_log(Path(d))) for d in save_dirs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    names = [d.name for d, _ in runs]
    labels = [str(d) if names.count(d.name) > 1 else d.name for d, _ in runs]
    has_bleu = any(r.get("valid_bleu") is not None for _, records in runs for r in records)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 9
    for (_, records), label, color in zip(runs, labels, colors):
        updates, elapsed = _series(records, "train", "elapsed_s")

        def x(values: list[float], updates=updates, elapsed=elapsed) -> list[float]:
            if x_axis == "update":
                return values
            return list(np.interp(values, [0, *updates], [0.0, *elapsed]) / 3600.0)

        u, loss = _series(records, "train", "loss")
        axes[0, 0].plot(x(u), loss, color=color, label=f"{label} train")
        u, valid = _series(records, "valid", "valid_loss")
        axes[0, 0].plot(x(u), valid, color=color, linestyle="--", marker="o", markersize=3, label=f"{label} valid")
        u, metric = _series(records, "valid", "valid_bleu" if has_bleu else "valid_ppl")
        axes[0, 1].plot(x(u), metric, color=color, marker="o", markersize=3, label=label)
        u, lr = _series(records, "train", "lr")
        axes[1, 0].plot(x(u), lr, color=color, label=label)
        u, speed = _series(records, "train", "tgt_tokens_per_s")
        axes[1, 1].plot(x(u), speed, color=color, label=label)
    xlabel = "update" if x_axis == "update" else "hours of training"
    titles = [("loss per target token (label-smoothed)", axes[0, 0]),
              ("valid BLEU (greedy)" if has_bleu else "valid perplexity", axes[0, 1]),
              ("learning rate", axes[1, 0]), ("target tokens/s", axes[1, 1])]
    for title, ax in titles:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    suffix = output.suffix.lstrip(".") or "png"
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format=suffix, dpi=120)
    plt.close(fig)
