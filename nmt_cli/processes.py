"""Which process on which host a name belongs to (temporary files, the save dir's lock), and whether it still
runs."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def host_name() -> str:
    """This machine's name, in the characters a file name part may hold."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


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
