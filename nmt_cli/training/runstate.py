"""What a training run keeps besides the model: its position, its log, its stop requests and its lock."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path

import torch

from nmt_cli.errors import NmtError
from nmt_cli.processes import alive, host_name
from nmt_cli.textio import read_small_file


@dataclass
class TrainState:
    """The position of a run: everything `progress` in a checkpoint holds, so a resume continues exactly."""

    epoch: int = 1  # the epoch being trained
    batch_pos: int = 0  # this process's next batch within the epoch
    updates: int = 0
    elapsed: float = 0.0  # seconds of training so far, over all resumed runs
    best: float | None = None  # best validation value (loss, or BLEU with --eval-bleu)
    bad_validations: int = 0  # validations since the best
    world_size: int = 1  # processes that trained it (batch_pos is per process)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def rescale(self, world_size: int) -> None:
        """The same global position for another number of processes."""
        if world_size != self.world_size:
            self.batch_pos = self.batch_pos * self.world_size // world_size
            self.world_size = world_size


def rng_state(device: torch.device) -> dict:
    """This process's random generators (CPU, and the device's on CUDA)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Window:
    """Loss and target token sums (over all processes) since the last log line."""

    def __init__(self) -> None:
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.loss, self.tokens, self.time = 0.0, 0.0, now

    def add(self, loss: float, tokens: float) -> None:
        self.loss += loss
        self.tokens += tokens

    def read(self, now: float) -> dict:
        """Mean loss per target token and target tokens/s (all processes) since the last read; resets."""
        record = {"loss": self.loss / max(self.tokens, 1), "tgt_tokens_per_s": self.tokens / max(now - self.time, 1e-9)}
        self.reset(now)
        return record


TENSORBOARD_SCALARS = {"train": ("loss", "lr", "tgt_tokens_per_s"),
                       "valid": ("valid_loss", "valid_nll", "valid_ppl", "valid_bleu")}


def tensorboard_writer(folder: Path):
    """A SummaryWriter for --tensorboard, or one NmtError saying how to install tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise NmtError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' "
                       "(or pip install tensorboard)") from None
    return SummaryWriter(log_dir=str(folder))


class JsonLog:
    """Append JSON lines to train.jsonl (main process only), each stamped with the wall-clock time; with a
    tensorboard writer, the same scalars go to tensorboard too (against the update number)."""

    def __init__(self, path: Path | None, tensorboard=None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None
        self.tensorboard = tensorboard

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
            self.file.flush()
        if self.tensorboard is not None and record.get("event") in TENSORBOARD_SCALARS:
            for key in TENSORBOARD_SCALARS[record["event"]]:
                if record.get(key) is not None:
                    self.tensorboard.add_scalar(f"{record['event']}/{key}", record[key], record["update"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def plain_line(text: str) -> None:
    """A timestamped line on stdout, for logs that are not a terminal (nohup, SLURM, `> log`)."""
    print(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')} {text}", flush=True)


EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class StopRequests:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) ask the run to stop after the current update and save; a
    second SIGINT aborts at once. Installed only in the main thread; `requested` is the first signal's name."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without saving
        self.requested = self.requested or name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# flock's errors on filesystems mounted without it (Lustre's default, some NFS setups)
NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


class SaveDirLock:
    """An exclusive lock on a save directory for the life of a run. With flock, the OS releases it when the run
    dies; where the filesystem has no flock, an exclusive-create lock file (`.lock.excl`, holding pid@host)
    stands in: one left by a dead process of this host is taken over, another host's is reported."""

    def __init__(self, save_dir: Path) -> None:
        self.path = save_dir / ".lock"
        self.exclusive = save_dir / ".lock.excl"
        self.file = None
        self.owns_exclusive = False

    def __enter__(self) -> SaveDirLock:
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise NmtError(f"{self.path.parent}: another nmt train is using this --save-dir (pid {holder}); "
                           "wait for it or choose another --save-dir") from None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            self.take_exclusive_file()
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def take_exclusive_file(self) -> None:
        """The lock without flock: create `.lock.excl` or fail because it exists."""
        me = f"{os.getpid()}@{host_name()}"
        for _ in range(2):
            try:
                fd = os.open(self.exclusive, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_small_file(self.exclusive) or ""
                pid, _, host = holder.partition("@")
                if host == host_name() and pid.isdigit() and not alive(int(pid)):
                    print(f"nmt train: {self.exclusive}: removed a stale lock of pid {pid} (gone)", file=sys.stderr)
                    self.exclusive.unlink(missing_ok=True)
                    continue
                self.file.close()
                raise NmtError(f"{self.exclusive}: this --save-dir is locked by pid {pid or '?'} on "
                               f"{host or 'an unknown host'} (the filesystem has no flock, so nmt uses this "
                               "file); if no nmt train runs there, remove the file") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.owns_exclusive = True
            return

    def __exit__(self, *exc) -> None:
        if self.owns_exclusive:
            self.exclusive.unlink(missing_ok=True)
        elif self.file:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        if self.file:
            self.file.close()
