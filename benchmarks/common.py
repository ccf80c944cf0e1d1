"""Helpers shared by the benchmarks: where the data is, how to print a table, and an `nmt serve` to load."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("DATA", REPO.parent / "shared" / "data" / "multi30k"))


def require_multi30k() -> Path:
    """The Multi30k folder, or exit with a one-line message."""
    if not (MULTI30K / "train.en.gz").exists() and not (MULTI30K / "train.en").exists():
        sys.exit(f"benchmark: Multi30k not found in {MULTI30K} (set DATA=)")
    return MULTI30K


def prepare_multi30k(out: Path) -> Path:
    """`nmt prepare` of Multi30k en-de train and val with the recipe's 10,000 joint BPE merges into `out`."""
    data = require_multi30k()
    subprocess.run([sys.executable, "-m", "nmt_cli", "prepare", "-s", "en", "-t", "de", "--train",
                    str(data / "train"), "--valid", str(data / "val"), "--bpe-merges", "10000", "--out", str(out),
                    "--quiet"], check=True)
    return out


def flickr_test_sources() -> list[str]:
    """The English side of Multi30k test_2016_flickr (1,000 sentences), the translation benchmarks' input."""
    from nmt_cli.textio import read_lines

    data = require_multi30k()
    path = data / "test_2016_flickr.en.gz"
    return read_lines(path if path.exists() else data / "test_2016_flickr.en")


def machine() -> str:
    """A one-line description of this machine, its kind first (Intel Xeon with AMX or not, AMD EPYC, ...)."""
    from nmt_cli.hardware import describe_machine

    return describe_machine()


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A rich table on stdout."""
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[f"{x:,.1f}" if isinstance(x, float) else str(x) for x in row])
    Console(width=max(Console().width, 140)).print(table)


class ServeProcess:
    """`nmt serve -m MODEL FLAGS...` on a free loopback port, started and stopped (SIGTERM) with `with`. Its
    stderr goes to a file, `log()`: a pipe nobody reads fills up with access-log lines and blocks the server."""

    def __init__(self, model: str, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.command = [sys.executable, "-m", "nmt_cli", "serve", "-m", model, "--port", str(self.port),
                        "--device", "cpu", *flags]
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)

    def __enter__(self) -> ServeProcess:
        self.proc = subprocess.Popen(self.command, stderr=self._log, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    sys.exit(f"benchmark: the server did not start: {self.log()}")
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(60)

    def log(self) -> str:
        return Path(self._log.name).read_text()
