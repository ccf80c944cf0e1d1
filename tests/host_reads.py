"""Count the host reads of device values that nmt's own code makes in each training update.

    python tests/host_reads.py DATA SAVE_DIR [UPDATES]                                  # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/host_reads.py DATA SAVE_DIR

Trains the tiny model for UPDATES updates (no validation or save until the last) and prints, on rank 0, one
JSON list: the reads made by each update but the last (`Trainer.step`, bookkeeping included).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def main() -> None:
    from nmt_cli.training.trainer import Trainer, TrainOptions

    data, save = sys.argv[1], sys.argv[2]
    updates = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    opts = TrainOptions(data=data, save_dir=save, arch="tiny", max_tokens=256, update_freq=2, max_updates=updates,
                        warmup=50, device="cpu", precision="fp32", seed=3, quiet=True, log_interval=2, clip_norm=1.0,
                        valid_interval=10_000)
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if "nmt_cli" in caller:  # ours only (torch's CPU Adam reads its own step counters)
                reads.append(f"{_name} in {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return _original(self, *a, **kw)

        setattr(torch.Tensor, name, counted)
    per_step: list[list[str]] = []
    real_step = Trainer.step

    def step(self, micro, batches_in_epoch):
        reads.clear()
        reason = real_step(self, micro, batches_in_epoch)
        per_step.append(list(reads))
        return reason

    Trainer.step = step
    trainer = Trainer(opts)
    rank = trainer.ctx.rank
    trainer.run()
    if rank == 0:
        print(json.dumps(per_step[:-1]))


if __name__ == "__main__":
    main()
