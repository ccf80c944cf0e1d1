"""Recipes: the WMT14 make targets carry the paper's settings; the Multi30k recipe runs end to end."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from .conftest import REPO, shared_data


def _dry_run(*args: str) -> str:
    result = subprocess.run(["make", "-n", "-o", ".venv/.installed", *args], cwd=REPO, capture_output=True,
                            text=True, check=True)
    return result.stdout


@pytest.mark.parametrize("model,updates,average,arch_dropout", [("base", 100000, 5, None), ("big", 300000, 20, None)])
def test_wmt14_dry_run_has_paper_settings(model, updates, average, arch_dropout):
    out = _dry_run(f"wmt14-{model}", "GPUS=8", "TEST_DATA=")
    train = next(line for line in out.splitlines() if " train " in line)
    for flag in (f"--arch {model}", f"--max-updates {updates}", "--warmup 4000", "--label-smoothing 0.1",
                 "--save-interval-minutes 10", "--precision bf16", "--max-tokens 4096", "--update-freq 1"):
        assert flag in train, (flag, train)
    assert train.startswith("torchrun") and "--nproc_per_node 8" in train
    assert f"nmt average --last {average}" in out
    translate = next(line for line in out.splitlines() if "nmt translate" in line)
    for flag in ("--beam 4", "--lenpen 0.6", "--max-len-a 1", "--max-len-b 50"):
        assert flag in translate
    assert "--tokenized-bleu de" in out
    assert "training-parallel-europarl-v7.tgz" in out and "training-parallel-nc-v9.tgz" in out
    assert "test-full.tgz" in out
    # fewer GPUs keep the tokens per update by accumulating gradients
    assert "--update-freq 4" in _dry_run(f"wmt14-{model}", "GPUS=2")
    assert "--nnodes 2" in _dry_run(f"wmt14-{model}", "GPUS=4", "NNODES=2")


def test_multi30k_recipe_end_to_end(tmp_path):
    data = shared_data("multi30k")
    exp = tmp_path / "m30k"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run(["make", "-o", ".venv/.installed", "multi30k", f"DATA={data}", f"EXP={exp}",
                             "ARCH=tiny", "LINES=300", "TRAIN_MINUTES=0.25", "BPE_MERGES=500", "AVERAGE_LAST=3",
                             "PRECISION=fp32"],
                            cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    hyps = (exp / "test.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 300
    assert re.search(r"bleu\s*│\s*[\d.]+", result.stdout) and "nrefs:1" in result.stdout
    assert "chrf" in result.stdout
    assert (exp / "model.pt").exists() and "val BLEU: averaged" in result.stdout
    # every step skips itself once its output exists
    again = subprocess.run(["make", "-o", ".venv/.installed", "-q", f"{exp}/test.hyp", f"DATA={data}",
                            f"EXP={exp}"], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
