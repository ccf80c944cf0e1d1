"""Two "nodes" on loopback: `torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1}`, gloo, each node started
from its own working directory, as on a cluster whose nodes share (or do not share) the save dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from nmt_cli.model.checkpoint import load_checkpoint

from .test_lifecycle import _log, _wait_for_updates


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(data: Path, saves: list[Path], workdirs: list[Path], *flags: str) -> list[subprocess.Popen]:
    """Node 0 and node 1 of one `nmt train` job; node i writes to saves[i] (the same folder when shared)."""
    port = free_port()
    procs = []
    for rank, (save, cwd) in enumerate(zip(saves, workdirs)):
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "nmt_cli",
               "train", str(data), "--save-dir", str(save), "--arch", "tiny", "--max-tokens", "256", "--warmup", "50",
               "--device", "cpu", "--seed", "5", "--update-freq", "2", *flags]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                                      start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def test_two_nodes_stop_on_sigterm_and_resume_to_the_same_weights(toy_data, tmp_path):
    """SIGTERM reaches node 0 only; both nodes stop after the same update (the flag travels in the update's
    all-reduce), both resume from the shared save dir, and the weights equal an uninterrupted 2-node run's."""
    shared, work = tmp_path / "shared", [tmp_path / "node0", tmp_path / "node1"]
    procs = start_nodes(toy_data, [shared, shared], work, "--max-updates", "100000", "--log-interval", "1")
    _wait_for_updates(shared, 3, procs[0], timeout=180)
    os.killpg(procs[0].pid, signal.SIGTERM)
    finish(procs)
    stop = [r for r in _log(shared) if r["event"] == "stop"]
    assert len(stop) == 1 and stop[0]["signal"] == "SIGTERM"
    stopped_at = stop[0]["update"]
    assert load_checkpoint(shared / "checkpoint_last.pt")["updates"] == stopped_at
    end = str(stopped_at + 3)
    results = finish(start_nodes(toy_data, [shared, shared], work, "--max-updates", end, "--quiet"))
    assert [code for code, _ in results] == [0, 0], results
    straight = tmp_path / "straight"
    results = finish(start_nodes(toy_data, [straight, straight], work, "--max-updates", end, "--quiet"))
    assert [code for code, _ in results] == [0, 0], results
    a, b = load_checkpoint(straight / "checkpoint_last.pt"), load_checkpoint(shared / "checkpoint_last.pt")
    assert {**a["progress"], "elapsed": 0} == {**b["progress"], "elapsed": 0} and a["updates"] == stopped_at + 3
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for name in ("optimizer", "rng"):
        assert len(a[name]) == len(b[name])


def test_two_nodes_with_separate_save_dirs_refuse_before_training(toy_data, tmp_path, monkeypatch):
    """Each node given its own local folder (node 1 would resume from nothing while node 0 resumes): both
    refuse at start with one line, and neither trains."""
    saves, work = [tmp_path / "local0" / "ck", tmp_path / "local1" / "ck"], [tmp_path / "n0", tmp_path / "n1"]
    monkeypatch.setenv("NMT_SHARED_DIR_WAIT", "5")  # the default waits out an NFS client's attribute cache (90 s)
    results = finish(start_nodes(toy_data, saves, work, "--max-updates", "4", "--quiet"))
    for code, err in results:
        assert code != 0
        lines = [x for x in err.splitlines() if x.startswith("nmt train: ")]
        assert len(lines) == 1 and "cannot see the --save-dir" in lines[0] and "shared by every node" in lines[0], err
        assert "waited 5 s" in lines[0] and "NMT_SHARED_DIR_WAIT" in lines[0], err
    assert not list(saves[0].glob("checkpoint*.pt")) and not list(saves[1].glob("checkpoint*.pt"))


def test_resume_on_another_number_of_processes_says_what_changes(toy_data, tmp_path):
    """1 process, then 2 under torchrun on the same save dir: the run goes on, and says in one warning that the
    update now holds twice the batches and that the data position is no longer bit-exact."""
    from nmt_cli.training.trainer import TrainOptions, train

    save = tmp_path / "ck"
    train(TrainOptions(data=toy_data, save_dir=save, arch="tiny", max_tokens=256, warmup=50, device="cpu",
                       seed=5, max_updates=3, quiet=True))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "nmt_cli",
           "train", str(toy_data), "--save-dir", str(save), "--arch", "tiny", "--max-tokens", "256", "--warmup",
           "50", "--device", "cpu", "--seed", "5", "--max-updates", "5"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [x for x in result.stderr.splitlines() if x.startswith("nmt train: warning: ")]
    assert len(warnings) == 1 and "1 -> 2 processes (an update now holds 2 batches instead of 1" in warnings[0]
    assert "not bit-exactly" in warnings[0]
    assert load_checkpoint(save / "checkpoint_last.pt")["progress"]["world_size"] == 2
