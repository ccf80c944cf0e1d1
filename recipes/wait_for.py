"""Wait until a file exists (another node's finished step on a shared filesystem), or give up with one line.

    python recipes/wait_for.py FILE --minutes 180 --what "node 0's data step"

Exit code 0 once FILE exists; 2 after --minutes without it, with a line saying what was awaited and what to do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def wait_for(path: Path, minutes: float, poll: float = 5.0) -> bool:
    """Whether `path` appeared within `minutes`."""
    deadline = time.monotonic() + minutes * 60
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(deadline - time.monotonic(), 0.01)))
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--what", default="the file")
    args = parser.parse_args()
    print(f"waiting for {args.what} ({args.file})", flush=True)
    if wait_for(args.file, args.minutes, poll=min(5.0, args.minutes * 60 / 10 or 0.1)):
        return 0
    print(f"{args.file}: not there after {args.minutes:g} minutes of waiting for {args.what}; is node 0 running "
          "with the same shared WMT14_EXP? (WMT14_WAIT_MINUTES sets the wait)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
