"""`make bench`: the prepare, train, translate, beam-step and serve benchmarks, one after the other, each
printing its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    failed = 0
    for name in ("prepare.py", "train.py", "translate.py", "beam_steps.py", "serve.py"):
        failed |= subprocess.run([sys.executable, str(HERE / name)]).returncode != 0
    sys.exit(failed)
