"""Checkpoints: save atomically, load with clear errors, rebuild a model, average several."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from nmt_cli.errors import NmtError
from nmt_cli.text.vocab import Vocabulary
from nmt_cli.textio import atomic_path

from .files import TRANSFORMERS_FOLDER, checkpoint_hint, is_transformers_folder
from .transformer import ModelConfig, Transformer, architecture_differences

FORMAT = "nmt-checkpoint-2"  # 2: carries the SHA-256 of its payload; 1 (no checksum) still loads
FORMATS = ("nmt-checkpoint-1", FORMAT)
NUMBERED = re.compile(r"checkpoint_(\d+)\.pt$")


def payload_digest(obj) -> str:
    """SHA-256 over a checkpoint's contents in a fixed order: dict keys sorted, tensors by dtype, shape and bytes."""
    digest = hashlib.sha256()

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                digest.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own buffer, not a copy
        elif isinstance(x, dict):
            digest.update(b"{")
            for key in sorted(x, key=repr):
                digest.update(repr(key).encode())
                visit(x[key])
            digest.update(b"}")
        elif isinstance(x, (list, tuple)):
            digest.update(b"[")
            for item in x:
                visit(item)
            digest.update(b"]")
        else:
            digest.update(repr(x).encode())

    visit(obj)
    return digest.hexdigest()


def with_digest(state: dict) -> dict:
    """`state` as a checkpoint file holds it: with its format and the checksum of its contents."""
    payload = {**state, "format": FORMAT}
    payload.pop("sha256", None)
    payload["sha256"] = payload_digest(payload)
    return payload


def save_checkpoint(state: dict, *paths: str | Path) -> None:
    """Write `state` as a checkpoint under each of `paths`, each through a temporary file that is flushed to disk
    and renamed, so a crash or a power cut never leaves a truncated checkpoint; a full disk is one NmtError, the
    old file kept. It is serialized once, to the first path; the others are hard links to that file (a
    checkpoint file is only ever replaced, never changed in place, so names sharing one cannot see each other's
    later saves), or copies where the filesystem has no hard links."""
    first, *others = [Path(p) for p in paths]
    payload = with_digest(state)
    with atomic_path(first) as tmp:
        with open(tmp, "wb") as f:
            try:
                torch.save(payload, f)
            except RuntimeError as e:
                raise write_failure(tmp, e) from None
    for path in others:
        with atomic_path(path) as tmp:
            tmp.unlink()
            try:
                os.link(first, tmp)
            except OSError:
                shutil.copyfile(first, tmp)


def write_failure(path: Path, error: RuntimeError) -> OSError:
    """The OSError behind torch's own error for a write that failed (its archive writer reports a short write
    as "unexpected pos": the file did not grow by what it wrote), which `atomic_path` turns into one line."""
    try:
        stats = os.statvfs(path.parent)
        full = stats.f_bavail * stats.f_frsize < 64 << 20
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return OSError(errno.EIO, f"the write failed ({' '.join(str(error).split())[:80]})")


def foreign_file(path: Path) -> str | None:
    """What a file is when it is plainly not one torch.save wrote (neither a zip archive nor a pickle): 'a text
    file', 'an empty file' or 'a binary file of another kind'; None when it may be a checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None  # torch.load says why, below
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # torch.save's zip archive, or a legacy pickle
        return None
    if not head:
        return "an empty file"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError as e:
        return "a text file" if e.start >= len(head) - 3 else "a binary file of another kind"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read a checkpoint written by `save_checkpoint`; one-line NmtError when missing, corrupt or foreign."""
    path = Path(path)
    if not path.exists():
        raise NmtError(f"{path}: no such checkpoint")
    if is_transformers_folder(path):
        raise NmtError(f"{path}: {TRANSFORMERS_FOLDER}")
    if path.is_dir():
        raise NmtError(f"{path}: is a directory, expected a checkpoint file{checkpoint_hint(path)}")
    kind = foreign_file(path)
    if kind:
        raise NmtError(f"{path}: {kind}, not a checkpoint: nmt reads the .pt files that nmt train and nmt average "
                       "write")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles; the error below says it in one line
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError,
            AttributeError, TypeError, KeyError, IndexError, MemoryError) as e:
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise NmtError(f"{path}: not a readable checkpoint (corrupt or truncated: {reason})") from None
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        raise NmtError(f"{path}: not an nmt checkpoint")
    if state["format"] != FORMATS[0]:
        stored = state.pop("sha256", None)
        if stored != payload_digest(state):
            raise NmtError(f"{path}: checksum mismatch: the file is corrupt (bytes changed since it was written)")
        state["sha256"] = stored  # what it was checked against: names the contents (ranks compare it on resume)
    return state


TRANSLATION_KEYS = ("model", "config", "vocab", "bpe_codes", "source_lang", "target_lang")


def require_keys(state: dict, path: str | Path, keys: Sequence[str] = TRANSLATION_KEYS) -> dict:
    """`state` itself, or a one-line NmtError naming `path` and the keys it lacks."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise NmtError(f"{path}: checkpoint lacks {', '.join(missing)}")
    return state


# What a checkpoint's text pipeline is made of: checkpoints that differ in none of these read and write text
# alike (an ensemble, an average). The target's own vocabulary and SentencePiece model: models made elsewhere.
TOKENIZER_KEYS = ("vocab", "target_vocab", "bpe_codes", "sentencepiece", "target_sentencepiece", "tokenizer")


def target_vocabulary(state: dict) -> Vocabulary:
    """The vocabulary of a checkpoint's target side: its own where it has one, else the shared one."""
    return Vocabulary(state.get("target_vocab") or state["vocab"])


def model_from_checkpoint(state: dict) -> tuple[Transformer, Vocabulary]:
    """The model (in eval mode) and vocabulary a checkpoint describes."""
    config = ModelConfig.from_dict(state["config"])
    with skip_initialization():  # every weight comes from the checkpoint
        model = Transformer(config)
    model.load_state_dict(state["model"])
    model.eval()
    return model, Vocabulary(state["vocab"])


@contextlib.contextmanager
def skip_initialization() -> Iterator[None]:
    """Build modules without drawing their random initial weights (the modules' own reset_parameters and
    torch.nn.init become no-ops), for weights that are loaded right after; as transformers' no_init_weights."""
    patched = [(nn.init, name) for name in ("uniform_", "normal_", "xavier_uniform_", "kaiming_uniform_",
                                             "zeros_", "ones_")]
    patched += [(cls, "reset_parameters") for cls in (nn.Linear, nn.Embedding, nn.LayerNorm)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    try:
        for owner, name in patched:
            setattr(owner, name, _keep)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _keep(tensor_or_module, *args, **kwargs):
    return tensor_or_module


def numbered_checkpoints(save_dir: str | Path) -> list[Path]:
    """`checkpoint_<updates>.pt` files of a save dir, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(save_dir).glob("checkpoint_*.pt") if (m := NUMBERED.search(p.name))]
    return [p for _, p in sorted(found)]


SELF_CONTAINED_KEYS = ("config", "vocab", "target_vocab", "bpe_codes", "sentencepiece", "target_sentencepiece",
                       "source_lang", "target_lang", "tokenizer", "target_token")


def with_ema_weights(state: dict, path: str | Path) -> dict:
    """A checkpoint whose weights are its exponential moving average (`nmt train --ema`), without the average
    kept beside them; one line for a checkpoint trained without --ema."""
    if not state.get("ema"):
        raise NmtError(f"{path}: holds no moving average of its weights (train with --ema DECAY)")
    model = {k: (state["ema"][k].to(v.dtype) if k in state["ema"] else v) for k, v in state["model"].items()}
    return {**{k: v for k, v in state.items() if k != "ema"}, "model": model}


def average_checkpoints(paths: Sequence[str | Path], ema: bool = False) -> dict:
    """Element-wise mean of the models' parameters (accumulated in fp32), with the metadata of the last one.

    Refuses checkpoints of different architectures (dropout may differ: `TRAINING_ONLY`) or vocabularies. With
    `ema`, averages their moving averages (`nmt train --ema`) instead of their weights.
    Training state (optimizer, RNG) is dropped.
    """
    if not paths:
        raise NmtError("no checkpoints to average")
    first = load_checkpoint(paths[0])
    if ema:
        first = with_ema_weights(first, paths[0])
    total = {k: v.to(torch.float32).clone() for k, v in first["model"].items()}
    last = first
    for path in paths[1:]:
        state = load_checkpoint(path)
        if ema:
            state = with_ema_weights(state, path)
        if differ := architecture_differences(first["config"], state["config"]):
            changed = ", ".join(f"{k} {first['config'].get(k)} -> {state['config'].get(k)}" for k in differ)
            raise NmtError(f"{path}: model config differs from {paths[0]} ({changed}); cannot average")
        if (state["vocab"], state.get("target_vocab")) != (first["vocab"], first.get("target_vocab")):
            raise NmtError(f"{path}: vocabulary differs from {paths[0]}; cannot average")
        if state.get("run", first.get("run")) != first.get("run", state.get("run")):
            raise NmtError(f"{path}: from another training run than {paths[0]} (their run ids differ: a save dir "
                           "reused by a fresh run?); average the checkpoints of one run")
        for k, v in state["model"].items():
            total[k] += v.to(torch.float32)
        last = state
    n = len(paths)
    out = model_only(last)
    out.pop("ema", None)  # the last one's moving average is not the average's
    out["model"] = {k: (v / n).to(first["model"][k].dtype) for k, v in total.items()}
    out["averaged_from"] = [str(p) for p in paths]
    return out


def with_decoding(state: dict, beam: int, lenpen: float, chosen: str) -> dict:
    """`state` carrying the decoding settings chosen for it (`stored_decoding`), which translate, serve, the
    exports and the Python API use unless told otherwise."""
    return {**state, "decoding": {"beam": int(beam), "lenpen": float(lenpen), "chosen": chosen}}


def model_only(state: dict) -> dict:
    """A checkpoint without its training state (optimizer, loss scaler, RNG, progress): what translation needs,
    a third of a training checkpoint's size."""
    out = {k: state[k] for k in (*SELF_CONTAINED_KEYS, "model", "averaged_from", "decoding", "run", "ema")
           if k in state}
    out["updates"] = state.get("updates", 0)
    return out


def to_host(obj):
    """A copy of a checkpoint's contents whose tensors are on the CPU and owned by the copy, so that training can
    go on changing the live weights and optimizer state while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class CheckpointWriter:
    """Serializes, hashes and writes checkpoints on a background thread while training goes on: one save in
    flight; the next save (and `wait`, on the stop path) waits for it. An error of the write (a full disk) is
    raised by the next `save` or `wait`. With background=False, each save happens in the caller's thread."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, saves: Sequence[tuple[dict, Sequence[Path]]], after: Callable[[], None] | None = None) -> None:
        """Write each state (already copied with `to_host`) under each of its paths, in order, then run `after`
        (pruning)."""
        self.wait()
        if not self.background:
            self._write(saves, after)
            return
        self.thread = threading.Thread(target=self._write, args=(saves, after), name="nmt-checkpoint-writer",
                                       daemon=True)
        self.thread.start()

    def _write(self, saves: Sequence[tuple[dict, Sequence[Path]]], after: Callable[[], None] | None) -> None:
        try:
            for state, paths in saves:
                save_checkpoint(state, *paths)
            if after is not None:
                after()
        except BaseException as e:  # handed to the training thread
            if not self.background:
                raise
            self.error = e

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise its error, if it had one."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def checkpoints_to_average(paths: list[Path], last: int = 0) -> tuple[list[Path], str | None]:
    """The checkpoint files `nmt average` reads: `paths` as given, or with `last` the last N numbered
    checkpoints of the one save dir given; and a warning when the save dir holds fewer than N."""
    if last < 0:
        raise NmtError(f"--last must be 0 or more (got {last})")
    warning = None
    if not last:
        for path in paths:
            if path.is_dir():
                raise NmtError(f"{path}: is a directory; give checkpoint files, or --last N {path}")
    else:
        if len(paths) != 1:
            raise NmtError(f"--last N takes exactly one save directory (got {len(paths)} paths)")
        if not paths[0].exists():
            raise NmtError(f"{paths[0]}: no such save directory")
        if not paths[0].is_dir():
            raise NmtError(f"{paths[0]}: a file, not a save directory; --last N reads the numbered checkpoints of a "
                           "save dir (or give checkpoint files without --last)")
        found = numbered_checkpoints(paths[0])
        if not found:
            raise NmtError(f"{paths[0]}: no numbered checkpoints (checkpoint_<updates>.pt)")
        if len(found) < last:
            warning = f"{paths[0]} has only {len(found)} numbered checkpoints; averaging those"
        paths = found[-last:]
    if not paths:
        raise NmtError("give checkpoints to average, or --last N SAVE_DIR")
    return paths, warning
