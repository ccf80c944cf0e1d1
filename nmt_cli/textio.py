"""Reading text files (plain or gzip) strictly as UTF-8, and writing files atomically."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import NmtError


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


def host_name() -> str:
    """This machine's name, in the characters a file name part may hold."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temporary_prefix(path: Path) -> str:
    """The name prefix of `path`'s temporary files and directories: `.NAME.PID@HOST.` (the pid and host tell a
    killed run's leftovers from those of a run still going, here or on another node of a shared filesystem)."""
    return f".{path.name}.{os.getpid()}@{host_name()}."


def remove_temporaries(folder: Path, name: str | None = None) -> None:
    """Remove the `.NAME.PID@HOST.*.tmp` files and directories in `folder` (of `name`, or of any name) left by
    processes of this host that are gone: what killed runs left behind. Another host's are left alone (its
    processes cannot be checked from here)."""
    if not folder.is_dir():
        return
    here = host_name()
    for entry in folder.glob(f".{name}.*.tmp" if name else ".*.tmp"):
        parts = entry.name[: -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or (name is not None and parts[0] != f".{name}"):
            continue
        pid, _, host = parts[1].partition("@")  # no host: written by an older nmt, on this machine
        if not pid.isdigit() or (host and host != here) or int(pid) == os.getpid() or alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether a process of this host has this pid and is still running (a zombie, killed but not yet reaped
    by its parent, is not: kill(pid, 0) alone would call it alive and keep its leftovers forever)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill
    return state not in ("Z", "X")


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


def publish_directory(staging: Path, out: Path) -> None:
    """Make a finished staging directory `out`, durably: its files and entries are flushed before the rename.
    An existing `out` is replaced (a file or symlink there is removed, never what a link points to)."""
    apply_default_mode(staging, directory=True)
    for path in staging.iterdir():
        fsync_path(path)
    fsync_path(staging, directory=True)
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    fsync_path(out.parent, directory=True)
