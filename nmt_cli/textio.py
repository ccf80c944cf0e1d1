"""Reading text files (plain or gzip) strictly as UTF-8, and writing files atomically."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.processes import alive, host_name


def _open_binary(path: Path):
    if not path.exists():
        raise NmtError(f"{path}: no such file")
    if path.is_dir():
        raise NmtError(f"{path}: is a directory, expected a text file")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def iter_lines(path: str | Path) -> Iterator[str]:
    """Yield the lines of a UTF-8 text file (optionally .gz) without their newline.

    Raises NmtError naming the file and line for bytes that are not UTF-8.
    """
    path = Path(path)
    try:
        with _open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise NmtError(f"{path}:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
                yield line.rstrip("\n").rstrip("\r")
    except (OSError, EOFError) as e:
        if isinstance(e, gzip.BadGzipFile) or isinstance(e, EOFError):
            raise NmtError(f"{path}: corrupt gzip file ({e})") from None
        raise NmtError(f"{path}: cannot read ({e.strerror or e})") from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file (optionally .gz), newlines stripped."""
    return list(iter_lines(path))


def stdin_lines() -> Iterator[str]:
    """Lines of stdin, strictly UTF-8: bad bytes are one error naming the line."""
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        try:
            yield raw.decode("utf-8").rstrip("\n").rstrip("\r")
        except UnicodeDecodeError as e:
            raise NmtError(f"<stdin>:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_stdin() -> list[str]:
    """All of stdin as lines (strictly UTF-8; a final newline adds no empty line)."""
    try:
        lines = [line.rstrip("\n") for line in sys.stdin.buffer.read().decode("utf-8").split("\n")]
    except UnicodeDecodeError as e:
        raise NmtError(f"<stdin>: not valid UTF-8 ({e.reason})") from None
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read_small_file(path: str | Path) -> str | None:
    """A small text file's contents without surrounding whitespace (a marker, a lock holder), or None when it
    cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes as stored."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_UMASK = os.umask(0)
os.umask(_UMASK)


def apply_default_mode(path: Path, directory: bool = False) -> None:
    """Give a file or directory made by mkstemp/mkdtemp (0600/0700) the mode the umask asks for."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


def fsync_path(path: Path, directory: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_prefix(path: Path) -> str:
    """The name prefix of `path`'s temporary files and directories: `.NAME.PID@HOST.` (the pid and host tell a
    killed run's leftovers from those of a run still going, here or on another node of a shared filesystem)."""
    return f".{path.name}.{os.getpid()}@{host_name()}."


_ASIDE = "old-"  # the random part of a name that `move_aside` gave


def remove_temporaries(folder: Path, name: str | None = None) -> None:
    """Remove the `.NAME.PID@HOST.*.tmp` files and directories in `folder` (of `name`, or of any name) left by
    processes of this host that are gone: what killed runs left behind. Another host's are left alone (its
    processes cannot be checked from here)."""
    if not folder.is_dir():
        return
    here = host_name()
    for entry in sorted(folder.glob(f".{name}.*.tmp" if name else ".*.tmp")):
        parts = entry.name[: -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or (name is not None and parts[0] != f".{name}"):
            continue
        pid, _, host = parts[1].partition("@")  # no host: written by an older nmt, on this machine
        if not pid.isdigit() or (host and host != here) or int(pid) == os.getpid() or alive(int(pid)):
            continue
        target = folder / parts[0][1:]
        if parts[2].startswith(_ASIDE) and not target.exists() and not target.is_symlink():
            os.replace(entry, target)  # the run died between moving the old one aside and renaming the new in
            print(f"nmt: restored {target} (a run replacing it was killed)", file=sys.stderr)
            continue
        folder_left = entry.is_dir() and not entry.is_symlink()
        try:
            remove_path(entry)
        except OSError:
            continue
        if folder_left:
            print(f"nmt: removed {entry}, the unfinished folder of a killed run", file=sys.stderr)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; only if the block succeeds, flush it to disk and rename it onto
    `path` (then flush the directory), so neither a crash nor a power cut leaves a partial file under the
    final name. A failed write (a full disk) is one NmtError naming `path`; the old file stays as it was."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NmtError(f"{path}: cannot write here ({path.parent} is not a directory)") from None
    if path.is_dir():
        raise NmtError(f"{path}: is a directory, expected a file name")
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        apply_default_mode(tmp_path)
        fsync_path(tmp_path)
        os.replace(tmp_path, path)
        fsync_path(path.parent, directory=True)
    except OSError as e:
        raise NmtError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_lines(path: str | Path, lines: list[str]) -> None:
    """Write lines (newline-terminated, UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for line in lines:
                f.write(line)
                f.write("\n")


@contextlib.contextmanager
def staging_directory(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to build it in, removed unless `publish_directory` renamed it into
    place; an OSError inside (a full disk) becomes one line naming `out`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NmtError(f"{out}: cannot write here ({out.parent} is not a directory)") from None
    remove_temporaries(out.parent, out.name)  # staging directories of killed runs
    path = Path(tempfile.mkdtemp(prefix=temporary_prefix(out), suffix=".tmp", dir=out.parent))
    try:
        yield path
    except OSError as e:  # a full disk, a vanished directory: one line, nothing left that looks complete
        raise NmtError(f"{out}: cannot write ({e.strerror or e})") from None
    finally:
        if path.exists():
            shutil.rmtree(path)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where the system
    or the filesystem cannot, having changed nothing."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_path(path: Path) -> None:
    """Remove a file, a symlink (never what it points to) or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def move_aside(out: Path) -> Path:
    """Rename `out` to a temporary name beside it that `remove_temporaries` restores if this process dies
    before the replacement is in place; returns that name."""
    aside = out.parent / f"{temporary_prefix(out)}{_ASIDE}{os.urandom(4).hex()}.tmp"
    os.replace(out, aside)
    return aside


def publish_directory(staging: Path, out: Path) -> None:
    """Make a finished staging directory `out`, durably: its files and entries are flushed before the rename.

    An existing `out` is replaced without a moment in which the name holds neither folder: the two are swapped
    in one step where the filesystem allows it (then the old one is deleted); elsewhere the old one is moved
    aside first, and a run killed before the new one is renamed in has it restored by the next run."""
    apply_default_mode(staging, directory=True)
    for path in staging.iterdir():
        fsync_path(path)
    fsync_path(staging, directory=True)
    if not out.exists() and not out.is_symlink():
        os.replace(staging, out)
    elif exchange_paths(staging, out):
        fsync_path(out.parent, directory=True)
        remove_path(staging)  # now the old folder
    else:
        aside = move_aside(out)
        os.replace(staging, out)
        fsync_path(out.parent, directory=True)
        remove_path(aside)
    fsync_path(out.parent, directory=True)


EXPORT_MARKER = "nmt-export.json"  # written last into an export folder: the folder is a finished export


def mark_export(folder: Path, kind: str, **extra) -> None:
    """Record in `folder`, as its last file, that it is a finished nmt export of `kind` (with `extra`, such as
    the tokenizer record an import restores)."""
    (folder / EXPORT_MARKER).write_text(json.dumps({"kind": kind, **extra}) + "\n", encoding="utf-8")


def export_kind(folder: Path) -> str | None:
    """The kind of nmt export `folder` is, or None when it is not a finished one."""
    text = read_small_file(folder / EXPORT_MARKER) if folder.is_dir() else None
    try:
        return json.loads(text)["kind"] if text else None
    except (ValueError, KeyError, TypeError):
        return None


def prepared_names(meta: dict) -> set[str]:
    """The names of the entries `nmt prepare` and `nmt binarize` write into a data dir described by `meta`."""
    langs = (meta.get("source_lang"), meta.get("target_lang"))
    names = {"meta.json", "vocab.txt", "bpe.codes", "spm.model", "target-vocab.txt", "target-spm.model",
             "train.corpus.npy"}
    splits = meta.get("splits")
    for split in splits if isinstance(splits, dict) else {}:
        names |= {f"{split}.{lang}.{kind}" for lang in langs for kind in ("bin", "idx")}
        names |= {f"{split}.{kind}.{lang}" for lang in langs for kind in ("raw", "bpe")}
    return names


def is_prepared_data_dir(folder: Path) -> bool:
    """Whether `folder` is a data dir as nmt prepare leaves it: its meta.json is nmt's (a format number, the
    languages, the splits) and the folder holds nothing else than what that meta.json says was written, so that
    --force replaces a data dir but never a folder of the user's that merely holds a file named meta.json."""
    text = read_small_file(folder / "meta.json")
    try:
        meta = json.loads(text) if text else None
    except ValueError:
        return False
    if not (isinstance(meta, dict) and isinstance(meta.get("format"), int) and isinstance(meta.get("splits"), dict)
            and isinstance(meta.get("source_lang"), str) and isinstance(meta.get("target_lang"), str)):
        return False
    return all(entry.name in prepared_names(meta) and entry.is_file() and not entry.is_symlink()
               for entry in folder.iterdir())


def describe_path(path: Path) -> str:
    """What a user would call the thing at `path`, in a few words: a file, a save dir, a data dir, an export."""
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file"
    if (kind := export_kind(path)) is not None:
        return f"an nmt export for {kind}"
    entries = list(path.iterdir())
    if is_prepared_data_dir(path):
        return "a data dir of nmt prepare"
    if (path / "meta.json").is_file():
        try:
            meta = json.loads(read_small_file(path / "meta.json") or "")
        except ValueError:
            meta = None
        others = sorted(e.name for e in entries if e.name not in prepared_names(meta if isinstance(meta, dict) else {}))
        if not others:
            return "a folder with a meta.json that nmt prepare did not write"
        return f"a folder with a meta.json and {_count(len(others), 'entry')} nmt prepare does not write ({others[0]})"
    checkpoints = sum(1 for e in entries if e.suffix == ".pt")
    if checkpoints:
        return f"a folder with {_count(checkpoints, 'checkpoint')} (.pt) among {_count(len(entries), 'entry')}"
    if not entries:
        return "an empty folder"
    folders = sum(1 for e in entries if e.is_dir())
    return f"a folder with {_count(len(entries) - folders, 'file')} and {_count(folders, 'folder')}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun if n == 1 else noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def check_replaceable(out: Path, force: bool, what: str, is_finished: Callable[[Path], bool],
                      flag: str = "--output") -> None:
    """Refuse, in one line, to write over `out` unless it is absent, or `force` is given and `out` is a folder
    that `is_finished` recognises as `what` (a previous output of the same command): --force never replaces
    anything else, the working directory or a folder above it included."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise NmtError(f"{out}: already exists (use --force to replace it)")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise NmtError(f"{out}: is the working directory or holds it; --force never replaces that: "
                       f"choose another {flag}")
    if out.is_symlink() or not out.is_dir() or not is_finished(out):
        raise NmtError(f"{out}: {describe_path(out)}, not {what} (the only folder --force replaces): "
                       f"choose another {flag}")
