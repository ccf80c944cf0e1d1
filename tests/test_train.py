"""nmt train: it learns, resumes exactly, matches across process counts, and refuses bad input."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmt_cli import hardware, torch_env
from nmt_cli.cli import commandline
from nmt_cli.decode.translate import Translator
from nmt_cli.errors import NmtError
from nmt_cli.model.checkpoint import load_checkpoint, numbered_checkpoints, save_checkpoint
from nmt_cli.training.trainer import TrainOptions, inverse_sqrt_lr, train

from .conftest import expect_error, require_tcmalloc, run_cli, threshold


def _opts(data: Path, save: Path, **kw) -> TrainOptions:
    base = dict(data=data, save_dir=save, arch="tiny", max_tokens=512, warmup=50, device="cpu", quiet=True, seed=7)
    base.update(kw)
    return TrainOptions(**base)


def _params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def _toy_task_scores(checkpoint: Path, raw: Path) -> dict[str, float]:
    """What the toy-task criteria look at: the run's first and last logged training loss, its last valid
    perplexity, and exact greedy outputs on the first 40 training sentences and the 60 held-out ones."""
    log = [json.loads(line) for line in (checkpoint.parent / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["event"] == "train"]
    scores = {"loss_ratio": losses[-1] / losses[0],
              "valid_ppl": [r for r in log if r["event"] == "valid"][-1]["valid_ppl"]}
    translator = Translator.from_checkpoint(checkpoint)
    for split, n in (("train", 40), ("valid", 60)):
        sources = (raw / f"{split}.en").read_text().splitlines()[:n]
        targets = (raw / f"{split}.de").read_text().splitlines()[:n]
        scores[split] = sum(h == t for h, t in zip(translator.translate(sources, greedy=True), targets))
    return scores


def test_tiny_model_learns_the_toy_task(toy_data, toy_model):
    """The fixture model has learned the mapping, held-out sentences included. Measured on the Intel Xeon (AMX)
    kind with the fixture's options and seeds 3-6: loss ratio 0.23-0.26, valid perplexity 1.111-1.116 (the floor
    under label smoothing 0.1 is 1/0.9 = 1.111), 40/40 training and 59-60/60 held-out sentences exact."""
    scores = _toy_task_scores(toy_model, toy_data.parent / "raw")
    threshold("last / first training loss", scores["loss_ratio"], high=0.35)
    threshold("valid perplexity", scores["valid_ppl"], high=1.25)
    threshold("exact greedy outputs, 40 training sentences", scores["train"], low=36)
    threshold("exact greedy outputs, 60 held-out sentences", scores["valid"], low=54)


def test_toy_task_criteria_fail_a_model_that_never_saw_the_mapping(tmp_path):
    """Negative control: the same training on targets shuffled across sentences learns what target sentences
    look like but not the mapping, and stays far from every threshold above (measured on the Intel Xeon (AMX)
    kind: loss ratio 0.71, valid perplexity 6.1, no exact output; 0.63, 7.8 and none after 800 updates)."""
    from nmt_cli.data.prepare import PrepareOptions, prepare

    from .conftest import TOY_TRAINING, write_task

    raw = tmp_path / "raw"
    write_task(raw / "train", 1200, seed=1)
    write_task(raw / "valid", 60, seed=2)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    (shuffled / "train.en").write_text((raw / "train.en").read_text())
    targets = (raw / "train.de").read_text().splitlines()
    random.Random(0).shuffle(targets)
    (shuffled / "train.de").write_text("\n".join(targets) + "\n")
    prepare(PrepareOptions("en", "de", str(shuffled / "train"), str(raw / "valid"), tmp_path / "data",
                           bpe_merges=30, workers=1, quiet=True))
    train(TrainOptions(data=tmp_path / "data", save_dir=tmp_path / "ck", **TOY_TRAINING | {"max_updates": 300}))
    scores = _toy_task_scores(tmp_path / "ck" / "checkpoint_last.pt", raw)
    assert scores["loss_ratio"] > 0.5 and scores["valid_ppl"] > 3 * 1.25, scores
    assert scores["train"] <= 4 and scores["valid"] <= 6, scores  # a tenth of the thresholds


def test_resume_is_exact(toy_data, tmp_path):
    """24 updates straight == 10 updates, stop, re-run the command to 24 (dropout on, crossing epochs)."""
    straight = tmp_path / "straight"
    train(_opts(toy_data, straight, max_updates=24, dropout=0.1, max_tokens=1024))
    resumed = tmp_path / "resumed"
    summary = train(_opts(toy_data, resumed, max_updates=10, dropout=0.1, max_tokens=1024))
    assert summary["updates"] == 10
    summary = train(_opts(toy_data, resumed, max_updates=24, dropout=0.1, max_tokens=1024))
    assert summary["updates"] == 24 and summary["epoch"] > 2
    a, b = _params(straight / "checkpoint_last.pt"), _params(resumed / "checkpoint_last.pt")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    starts = [json.loads(x) for x in (resumed / "train.jsonl").read_text().splitlines() if '"start"' in x]
    assert [s["resumed_at"] for s in starts] == [None, 10]


def test_two_processes_equal_one_with_update_freq_2(toy_data, tmp_path):
    """torchrun --nproc_per_node 2 (gloo) == one process with --update-freq 2, on the same batches, weights and
    their moving average (--ema) alike; with --comm-precision bf16 the gradients cross in bf16: the same losses
    to bf16's rounding, other weights."""
    single = tmp_path / "single"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process below: the same summation order within a product
    try:
        train(_opts(toy_data, single, max_updates=4, dropout=0.0, update_freq=2, max_tokens=256,
                    save_interval_updates=2, cooldown=0.5, log_interval=1, ema=0.9))
    finally:
        torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(save: Path, *flags: str) -> dict[str, torch.Tensor]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "nmt_cli", "train", str(toy_data), "--save-dir", str(save), "--arch", "tiny", "--max-tokens", "256",
               "--warmup", "50", "--device", "cpu", "--quiet", "--seed", "7", "--max-updates", "4", "--dropout", "0",
               "--cooldown", "0.5", "--log-interval", "1", "--ema", "0.9", *flags]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        return _params(save / "checkpoint_last.pt")

    def losses(save: Path) -> list[float]:
        return [r["loss"] for r in map(json.loads, (save / "train.jsonl").read_text().splitlines())
                if r["event"] == "train"]

    ddp = tmp_path / "ddp"
    a, b = _params(single / "checkpoint_last.pt"), torchrun(ddp)
    d = 64

    def comparable(name: str, x: torch.Tensor) -> torch.Tensor:
        if name.endswith("attn.in_proj.bias"):
            # The key bias has an exactly zero gradient (softmax is shift-invariant), so Adam turns the
            # rounding noise of either summation order into +-lr steps there: compare Q and V biases only.
            return torch.cat([x[:d], x[2 * d :]])
        return x

    for name in a:
        torch.testing.assert_close(comparable(name, a[name]), comparable(name, b[name]), atol=2e-6, rtol=1e-5,
                                   msg=name)
    # --ema: every process keeps the same moving average, which equals the one process's
    ema_a, ema_b = (load_checkpoint(s / "checkpoint_last.pt")["ema"] for s in (single, ddp))
    for name in ema_a:
        torch.testing.assert_close(comparable(name, ema_a[name]), comparable(name, ema_b[name]), atol=2e-6,
                                   rtol=1e-5, msg=f"ema {name}")
    fresh = _params(single / "checkpoint_2.pt")
    # The last two updates moved the weights far more than the comparison above tolerates (atol 2e-6).
    threshold("largest weight change in updates 3-4", max(float((fresh[n] - a[n]).abs().max()) for n in a),
              low=2e-4)
    log = [json.loads(x) for x in (ddp / "train.jsonl").read_text().splitlines()]
    assert log[0]["world_size"] == 2
    assert losses(ddp) == pytest.approx(losses(single), rel=1e-5)

    half = torchrun(tmp_path / "bf16", "--comm-precision", "bf16")
    assert losses(tmp_path / "bf16") == pytest.approx(losses(ddp), rel=1e-3)
    threshold("largest weight difference, bf16 vs fp32 gradient all-reduce",
              max(float((comparable(n, half[n]) - comparable(n, b[n])).abs().max()) for n in b), low=2e-5)

def test_cooldown_lowers_the_learning_rate_to_zero_at_the_budget(toy_data, tmp_path):
    """--cooldown 0.5 of --max-updates 20: eq. 3 for updates 1-11, then linearly down to 1/10 of it at update 20."""
    train(_opts(toy_data, tmp_path / "cd", max_updates=20, cooldown=0.5, log_interval=1))
    log = [json.loads(x) for x in (tmp_path / "cd" / "train.jsonl").read_text().splitlines()]
    lrs = {r["update"]: r["lr"] for r in log if r["event"] == "train"}
    assert sorted(lrs) == list(range(1, 21))
    for update, lr in lrs.items():
        factor = min(1.0, (1 - (update - 1) / 20) / 0.5)  # the share used before this update
        assert lr == pytest.approx(inverse_sqrt_lr(update, 64, 50) * factor), update
    assert lrs[20] == pytest.approx(0.1 * inverse_sqrt_lr(20, 64, 50))


def test_bf16_trains(toy_data, tmp_path):
    summary = train(_opts(toy_data, tmp_path / "bf16", max_updates=40, precision="bf16", log_interval=10))
    log = [json.loads(x) for x in (tmp_path / "bf16" / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["event"] == "train"]
    assert summary["updates"] == 40 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_compiled_layers_train_as_the_eager_ones_do(toy_data, tmp_path, monkeypatch):
    """--compile (torch.compile of the encoder and decoder layers; the default on CUDA): dynamo captures each
    layer type whole, once for the stack, and the run gives the eager run's per-update losses, with its
    compile time reported. Traced with the aot_eager backend (dynamo and AOT autograd, the parts that see this
    code; inductor's kernels are PyTorch's): inductor alone adds ~35 s here; benchmarks/compile.py runs it."""
    from torch._dynamo.utils import counters

    from nmt_cli.model.transformer import Transformer

    compile_layers = Transformer.compile_layers
    monkeypatch.setattr(Transformer, "compile_layers", lambda model: compile_layers(model, backend="aot_eager"))
    small = dict(max_updates=3, layers=2, d_model=32, ffn=64, heads=2, dropout=0.0, log_interval=1)
    train(_opts(toy_data, tmp_path / "eager", **small))
    graphs = counters["stats"]["unique_graphs"]
    train(_opts(toy_data, tmp_path / "compiled", compile=True, **small))
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one per layer type, shared by the stack

    def log(run: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / run / "train.jsonl").read_text().splitlines()]

    losses = {run: [r["loss"] for r in log(run) if r["event"] == "train"] for run in ("eager", "compiled")}
    assert len(losses["eager"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
    assert [r["seconds"] > 0 for r in log("compiled") if r["event"] == "compiled"] == [True]
    assert not any(r["event"] == "compiled" for r in log("eager"))

    def no_compiler(graph, inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(Transformer, "compile_layers", lambda model: compile_layers(model, backend=no_compiler))
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "failed", "--arch", "tiny", "--compile",
                         "--max-updates", "1", "--device", "cpu", "--quiet"),
                 "--compile: torch.compile could not compile the layers", "no C++ compiler found", "--no-compile")

def test_bad_training_input(toy_data, tmp_path):
    save = tmp_path / "ck"
    args = ["train", toy_data, "--save-dir", save, "--arch", "tiny", "--max-updates", "2", "--quiet",
            "--warmup", "10", "--device", "cpu"]
    expect_error(run_cli(*args, "--precision", "fp16"), "fp16", "CUDA")
    if not torch.cuda.is_available():
        expect_error(run_cli(*args[:-2], "--device", "cuda"), "--device cuda", "no CUDA")
    expect_error(run_cli("train", tmp_path / "missing", "--save-dir", save), "no such data directory")
    expect_error(run_cli(*args, "--cooldown", "1.5"), "--cooldown must be in [0, 1)")
    expect_error(run_cli(*args, "--activation-dropout", "1"), "--activation-dropout must be in [0, 1)")
    expect_error(run_cli("train", toy_data, "--save-dir", save, "--arch", "tiny", "--cooldown", "0.2"),
                 "--cooldown needs a budget", "--max-updates or --max-time")
    assert run_cli(*args).exit_code == 0
    blob = (save / "checkpoint_last.pt").read_bytes()
    expect_error(run_cli(*args, "--d-model", "32"), "architecture differs", "d_model 64 vs 32")
    state = load_checkpoint(save / "checkpoint_last.pt")
    state["vocab"] = state["vocab"][:-1] + ["zzz"]
    save_checkpoint(state, save / "checkpoint_last.pt")
    expect_error(run_cli(*args), "vocabulary differs")
    torch.save(state | {"vocab": state["vocab"][:-1] + ["yyy"]}, save / "checkpoint_last.pt")  # edited in place
    expect_error(run_cli(*args), "checkpoint_last.pt", "checksum mismatch")
    (save / "checkpoint_last.pt").write_bytes(blob[: len(blob) // 2])
    expect_error(run_cli(*args), "checkpoint_last.pt", "corrupt or truncated")


@pytest.mark.parametrize("keep_last", [2])
def test_checkpoints_kept_and_best(toy_data, tmp_path, keep_last):
    save = tmp_path / "ck"
    train(_opts(toy_data, save, max_updates=9, save_interval_updates=2, keep_last=keep_last, valid_interval=3))
    numbered = sorted(p.name for p in save.glob("checkpoint_[0-9]*.pt"))
    # numbered checkpoints come from the interval (equal spacing for averaging) and the final update, so that
    # `nmt average --last N` ends where training ended
    assert numbered == ["checkpoint_8.pt", "checkpoint_9.pt"]
    assert (save / "checkpoint_best.pt").exists() and (save / "checkpoint_last.pt").exists()
    state = load_checkpoint(save / "checkpoint_last.pt")
    for key in ("model", "config", "vocab", "bpe_codes", "source_lang", "target_lang", "optimizer", "rng", "progress"):
        assert key in state
    assert state["progress"]["updates"] == 9
    assert not list(save.glob("*.tmp"))


def test_numbered_and_best_checkpoints_hold_the_weights_and_the_full_state_comes_by_the_clock(
        toy_data, tmp_path, monkeypatch):
    """Numbered and best checkpoints: the weights (what averaging and translation read), well under the full
    state's size; checkpoint_last.pt, the full state, at epoch ends, at the end, and every
    --state-interval-minutes (here: due at every update), never merely because a numbered one was saved."""
    from nmt_cli.model import checkpoint as checkpoint_module

    written: list[tuple[str, bool, int]] = []
    real_save = checkpoint_module.save_checkpoint

    def recording_save(state, *paths):
        real_save(state, *paths)
        written.extend((Path(p).name, "optimizer" in state, state["updates"]) for p in paths)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", recording_save)
    save = tmp_path / "ck"
    train(_opts(toy_data, save, max_updates=20, save_interval_updates=2, keep_last=0, valid_interval=3,
                max_tokens=1024, state_interval_minutes=0, background_save=False, log_interval=1))
    steps = [r for r in map(json.loads, (save / "train.jsonl").read_text().splitlines()) if r["event"] == "train"]
    epoch_ends = {r["update"] for r, after in zip(steps, steps[1:]) if after["epoch"] > r["epoch"]}
    assert epoch_ends  # the run crosses epochs, so the test sees full states there
    assert all(not full for name, full, _ in written if name != "checkpoint_last.pt")
    assert all(full for name, full, _ in written if name == "checkpoint_last.pt")
    numbered = [u for name, _, u in written if name.split("_")[1][:-3].isdigit()]
    assert numbered == list(range(2, 21, 2))
    last = [u for name, _, u in written if name == "checkpoint_last.pt"]
    assert last[-1] == 20 and set(last) <= epoch_ends | {20}
    full_size = (save / "checkpoint_last.pt").stat().st_size
    assert (save / "checkpoint_20.pt").stat().st_size < 0.5 * full_size
    assert set(load_checkpoint(save / "checkpoint_best.pt")) >= {"model", "config", "vocab", "updates"}

    written.clear()
    train(_opts(toy_data, tmp_path / "clock", max_updates=6, save_interval_updates=3, state_interval_minutes=1e-9,
                background_save=False))
    assert [u for name, _, u in written if name == "checkpoint_last.pt"] == [1, 2, 3, 4, 5, 6]


def test_eval_bleu_and_patience(toy_data, tmp_path):
    """--eval-bleu picks the best checkpoint by valid BLEU; --patience stops after validations without gains."""
    save = tmp_path / "ck"
    summary = train(_opts(toy_data, save, max_updates=400, valid_interval=10, eval_bleu=True, patience=2,
                          lr_scale=1e-6, warmup=4000))
    assert summary["reason"] == "patience"
    valid = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines() if '"valid"' in x]
    assert len(valid) == 3 and all("valid_bleu" in v for v in valid)
    assert summary["best"] == valid[0]["valid_bleu"]


def test_one_host_read_per_update_not_per_micro_batch(toy_data, monkeypatch):
    """train_step over 4 micro-batches reads a device value on the host once (the gradient-norm check):
    losses and token counts stay on the device until the log interval."""
    from nmt_cli.data.binarized import DataDir, collate, make_batches
    from nmt_cli.model.transformer import Transformer, make_config
    from nmt_cli.training import distributed as D
    from nmt_cli.training.trainer import TranslationLoss, train_step

    data = DataDir.open(toy_data)
    corpus = data.split("train")
    groups = make_batches(corpus.src.sizes, corpus.tgt.sizes, 256, 1)[:4]
    micro = [collate(corpus, g, data.vocab) for g in groups]
    model = Transformer(make_config("tiny", len(data.vocab)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if "nmt_cli" in caller:  # reads of ours (torch's CPU Adam reads its CPU step counters itself)
                reads.append(f"{_name} in {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    def batch_loss() -> float:
        with torch.no_grad():
            loss = TranslationLoss(model, 0.1)
            return sum(float(loss(b.src, b.prev_output, b.target_index, b.target)) for b in micro)

    model.eval()
    loss_before = batch_loss()
    model.train()
    loss, tokens, flags = train_step(TranslationLoss(model, 0.1), model, micro, optimizer, scaler,
                                     _opts(toy_data, Path(".")), D.DistContext(), torch.device("cpu"),
                                     lambda: [1.0, 0.0, 2.5])
    monkeypatch.undo()
    assert len(reads) == 1, reads
    assert tokens == sum(b.ntokens for b in micro) and loss > 0 and flags == [1.0, 0.0, 2.5]
    model.eval()
    threshold("loss drop on the same batches after one update", loss_before - batch_loss(), low=0.05 * loss_before)


@pytest.mark.parametrize("processes", [1, 2])
def test_one_host_read_per_update_in_the_whole_loop(toy_data, tmp_path, processes):
    """Each update of the run loop (step, flags, logging, bookkeeping) reads the device once, in one process
    and under torchrun with 2 processes (where the flags and the loss travel in one all-reduce)."""
    script = Path(__file__).with_name("host_reads.py")
    launch = [] if processes == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run([sys.executable, *launch, str(script), str(toy_data), str(tmp_path / "ck"), "6"],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    per_step = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(per_step) == 5 and all(len(reads) == 1 for reads in per_step), per_step


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_gradient_skips_the_update(toy_data, fused):
    """NaN gradients leave the weights and Adam's state as they were: decided on the host after the update's
    read (any optimizer), or on the device by a fused Adam whose step is queued before the read."""
    from nmt_cli.data.binarized import DataDir, collate, make_batches
    from nmt_cli.model.transformer import Transformer, make_config
    from nmt_cli.training import distributed as D
    from nmt_cli.training.trainer import TranslationLoss, train_step

    data = DataDir.open(toy_data)
    corpus = data.split("train")
    micro = [collate(corpus, make_batches(corpus.src.sizes, corpus.tgt.sizes, 256, 1)[0], data.vocab)]
    model = Transformer(make_config("tiny", len(data.vocab)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)

    def step() -> tuple[float, float | None]:
        loss, tokens, _ = train_step(TranslationLoss(model, 0.1), model, micro, optimizer,
                                     torch.amp.GradScaler("cpu", enabled=False), _opts(toy_data, Path(".")),
                                     D.DistContext(), torch.device("cpu"))
        return loss, tokens

    if fused:
        assert step()[1] is not None  # a real step first: Adam's state exists
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    hook = model.encoder[0].feed_forward.w1.weight.register_hook(lambda g: g * float("nan"))  # NaN gradient
    loss, tokens = step()
    assert math.isfinite(loss) and tokens is None
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    after = list(optimizer.state.values())
    assert len(after) == len(state)
    for now, then in zip(after, state):
        assert now.keys() == then.keys() and all(torch.equal(now[k], then[k]) for k in then)
    if fused:
        hook.remove()
        assert step()[1] is not None and all(float(s["step"]) == 2 for s in optimizer.state.values())
        assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))

def test_numbered_checkpoints_at_epoch_ends_without_an_interval(toy_data, tmp_path):
    save = tmp_path / "ck"
    summary = train(_opts(toy_data, save, max_epochs=0, max_updates=30, max_tokens=2048, keep_last=0))
    log = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines()]
    epoch_ends = [r["update"] for r in log if r["event"] == "valid"][:-1]  # the last validation is the stop's
    numbered = sorted(int(p.stem.split("_")[1]) for p in save.glob("checkpoint_[0-9]*.pt"))
    assert numbered == [*epoch_ends, 30] and summary["updates"] == 30  # epoch ends, and the final update
    assert len(set(b - a for a, b in zip(numbered[:-1], numbered[1:-1]))) == 1  # epochs equally spaced


def test_prefetch_keeps_order_and_raises_worker_errors():
    from nmt_cli.data.binarized import prefetch

    assert list(prefetch(lambda x: x * 2, range(5))) == [0, 2, 4, 6, 8]

    def broken(x):
        if x == 3:
            raise ValueError("bad batch")
        return x

    got = []
    with pytest.raises(ValueError, match="bad batch"):
        for x in prefetch(broken, range(5)):
            got.append(x)
    assert got == [0, 1, 2]


def test_training_tensors_use_huge_pages_unless_the_user_says_otherwise():
    """`nmt train` turns on PyTorch's transparent-huge-page allocation before torch is imported (a user's own
    THP_MEM_ALLOC_ENABLE wins); a 64 MB tensor then lies in huge pages where the kernel allows them."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    probe = ("from nmt_cli.torch_env import use_huge_pages_for_tensors as use; on = use(); import torch; "
             "x = torch.ones(1 << 24); import re; rollup = open('/proc/self/smaps_rollup').read(); "
             "print(on, int(re.search(r'AnonHugePages:\\s+(\\d+)', rollup).group(1)) > 0)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.split() == ["True", "True"], default.stderr
    refused = subprocess.run([sys.executable, "-c", probe], env={**env, "THP_MEM_ALLOC_ENABLE": "0"},
                             capture_output=True, text=True, check=True)
    # with huge pages on request only ("[madvise]"), nothing else asks for them
    assert refused.stdout.split() == ["False", "False" if "[madvise]" in thp.read_text() else refused.stdout.split()[1]]


def test_a_cpu_run_preloads_tcmalloc_and_trains_the_same_numbers_as_on_the_system_allocator(toy_data, tmp_path):
    """`nmt train` on CPU executes itself again with tcmalloc preloaded (its log names the allocator and the
    machine it ran on), and `--cpu-allocator system` keeps glibc's; the allocator changes no number: 20 updates'
    losses are equal bit for bit."""
    require_tcmalloc()
    logs = {}
    for choice in ("auto", "system"):
        save = tmp_path / choice
        result = subprocess.run([sys.executable, "-m", "nmt_cli", "train", str(toy_data), "--save-dir", str(save),
                                 "--arch", "tiny", "--max-tokens", "512", "--max-updates", "20", "--log-interval",
                                 "1", "--device", "cpu", "--quiet", "--cpu-allocator", choice],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        logs[choice] = [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]
    allocators = {choice: next(r for r in log if r["event"] == "start")["allocator"] for choice, log in logs.items()}
    assert "libtcmalloc" in allocators["auto"] and allocators["system"] == "system", allocators
    # the log names the machine too: what a resumed run's figures were measured on, when it moved
    assert {next(r for r in log if r["event"] == "start")["machine"] for log in logs.values()} == {
        f"{hardware.cpu_kind()}: {hardware.cpu_flags()[0]}"}
    losses = {choice: [r["loss"] for r in log if r["event"] == "train"] for choice, log in logs.items()}
    assert len(losses["auto"]) == 20 and losses["auto"] == losses["system"]


def test_only_the_nmt_command_itself_is_executed_again(monkeypatch):
    """The allocator's restart runs the process's own command line: that of `nmt` or `python -m nmt_cli` (under
    torchrun too); never a test's (pytest's own, or a `python -c` script's), or that of tests/warm_nmt.py, whose
    forked children call the entry point with another command line than their own."""
    monkeypatch.setattr(commandline, "console_script", True)
    monkeypatch.setattr(sys, "orig_argv", ["/env/python", "-u", "-m", "nmt_cli", "train", "data"])
    monkeypatch.setattr(sys, "argv", ["/clone/nmt_cli/__main__.py", "train", "data"])
    assert commandline.own_command() == [sys.executable, "-u", "-m", "nmt_cli", "train", "data"]
    monkeypatch.setattr(sys, "orig_argv", ["/env/python", "tests/warm_nmt.py", "serve", "/tmp/nmt.sock"])
    monkeypatch.setattr(sys, "argv", ["nmt", "train", "data"])
    assert commandline.own_command() is None
    monkeypatch.setattr(sys, "orig_argv", ["/env/python", "/env/bin/nmt", "train", "data"])
    assert commandline.own_command() is None  # sys.argv[0] is not that script
    monkeypatch.setattr(sys, "argv", ["/env/bin/nmt", "train", "data"])
    assert commandline.own_command() == [sys.executable, "/env/bin/nmt", "train", "data"]
    # a pytest-xdist worker that called the entry point in-process with its own sys.argv
    monkeypatch.setattr(sys, "orig_argv", ["/env/python", "-c", "import sys; exec(...)"])
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert commandline.own_command() is None
    monkeypatch.setattr(commandline, "console_script", False)  # the app called in-process
    assert commandline.own_command() is None


def test_a_named_allocator_that_cannot_be_had_is_one_line_and_auto_goes_on_without(monkeypatch):
    """--cpu-allocator NAME fails in one line when the library is missing, or when another one is preloaded
    already; auto with none installed returns (the run goes on, on the system's allocator) and never executes
    anything."""
    monkeypatch.setattr(torch_env, "loaded_allocator", lambda: None)
    monkeypatch.setattr(torch_env, "find_allocator", lambda name: None)
    monkeypatch.delenv(torch_env.PRELOAD_TRIED, raising=False)
    with pytest.raises(NmtError, match="--cpu-allocator tcmalloc: libtcmalloc not found on this machine"):
        torch_env.preload_allocator("tcmalloc", ["false"])
    torch_env.preload_allocator("auto", ["false"])
    torch_env.preload_allocator("system", ["false"])
    monkeypatch.setattr(torch_env, "loaded_allocator", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    with pytest.raises(NmtError, match="runs on /usr/lib/libtcmalloc_minimal.so.4 already"):
        torch_env.preload_allocator("jemalloc", ["false"])
    torch_env.preload_allocator("tcmalloc", ["false"])


def test_a_warmup_longer_than_the_budget_is_reported(toy_data, tmp_path):
    """--warmup beyond --max-updates: the rate never leaves warm-up, so the run says so (stderr and train.jsonl);
    a schedule that fits says nothing."""
    result = run_cli("train", toy_data, "--save-dir", tmp_path / "long", "--arch", "tiny", "--max-updates", "3",
                     "--warmup", "50", "--device", "cpu", "--log-interval", "1")
    assert result.exit_code == 0, result.output
    assert "--warmup 50 is more than --max-updates 3" in result.stderr
    events = [json.loads(x) for x in (tmp_path / "long" / "train.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("warning") == 1
    train(_opts(toy_data, tmp_path / "fits", max_updates=3, warmup=2))
    assert '"warning"' not in (tmp_path / "fits" / "train.jsonl").read_text()


def test_precision_auto_is_bf16_only_where_the_cpu_multiplies_it_and_the_run_says_how_it_stops(
        toy_data, tmp_path, monkeypatch):
    """The default `--precision auto` records what it chose (bf16 on a CPU with AMX or avx512_bf16 and oneDNN
    kernels for it, fp32 elsewhere), and the start-up line says how the run stops and how to stop it safely."""
    import torch

    from nmt_cli.model import precision
    from nmt_cli.training.trainer import stopping_line

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.auto_precision(cpu) == "fp32"
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr("nmt_cli.model.ops.ONEDNN_BF16", True)
    assert precision.auto_precision(cpu) == "bf16"
    monkeypatch.setattr("nmt_cli.model.ops.ONEDNN_BF16", False)  # AVX-512 missing: oneDNN has no bf16 kernels
    assert precision.auto_precision(cpu) == "fp32"
    monkeypatch.undo()

    result = run_cli("train", toy_data, "--save-dir", tmp_path / "auto", "--arch", "tiny", "--max-updates", "2",
                     "--warmup", "1", "--max-time", "5", "--device", "cpu")
    assert result.exit_code == 0, result.output
    options = json.loads((tmp_path / "auto" / "options.json").read_text())
    assert options["precision"] == precision.auto_precision(cpu) != "auto"
    assert "stops after 2 updates or 5 minutes, whichever comes first; Ctrl-C" in result.stderr
    assert "trains until stopped" in stopping_line(_opts(toy_data, tmp_path))
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "x", "--precision", "fp16", "--device", "cpu"),
                 "--precision fp16 needs CUDA")


def test_a_resume_that_cannot_be_exact_is_refused_and_schedule_changes_are_reported(toy_data, tmp_path):
    """Re-running in a save dir with another --max-tokens (or --update-freq, --seed) would map the saved data
    position onto other batches: refused with one line. Another --warmup is allowed, and said at start."""
    save = tmp_path / "ck"
    train(_opts(toy_data, save, max_updates=3))
    args = ["train", toy_data, "--save-dir", save, "--arch", "tiny", "--warmup", "50", "--device", "cpu", "--quiet",
            "--seed", "7", "--max-updates", "6"]
    expect_error(run_cli(*args, "--max-tokens", "1024"), "--max-tokens 1024 differs from the run being resumed (512)")
    expect_error(run_cli(*args[:-4], "--seed", "8", "--max-updates", "6", "--max-tokens", "512"), "--seed 8 differs")
    assert json.loads((save / "train.jsonl").read_text().splitlines()[-1])["updates"] == 3  # nothing ran
    summary = train(_opts(toy_data, save, max_updates=6, warmup=20))
    assert summary["updates"] == 6
    warnings = [json.loads(x)["message"] for x in (save / "train.jsonl").read_text().splitlines() if '"warning"' in x]
    assert warnings[1:] == ["resuming at update 3 with --warmup 50 -> 20: the new values apply from the next update on"]
    assert warnings[0].startswith("--warmup 50 is more than --max-updates 3")  # the first run's


def test_dropout_rates_may_change_on_resume_and_a_rate_not_given_keeps_its_value(toy_data, tmp_path):
    """Dropout is not architecture: a resume with another --dropout trains with it from the next update, says
    so (stderr and train.jsonl), and a later resume without the flag keeps it rather than the preset's."""
    save = tmp_path / "ck"
    train(_opts(toy_data, save, max_updates=2, dropout=0.1))
    args = ["train", toy_data, "--save-dir", save, "--arch", "tiny", "--warmup", "50", "--device", "cpu",
            "--seed", "7", "--max-tokens", "512"]
    result = run_cli(*args, "--max-updates", "4", "--dropout", "0.3", "--attention-dropout", "0.2")
    assert result.exit_code == 0, result.output
    assert "--dropout 0.1 -> 0.3; --attention-dropout 0.0 -> 0.2" in result.stderr
    assert load_checkpoint(save / "checkpoint_last.pt")["config"]["dropout"] == 0.3
    assert run_cli(*args, "--max-updates", "5", "--quiet").exit_code == 0
    config = load_checkpoint(save / "checkpoint_last.pt")["config"]
    assert (config["dropout"], config["attention_dropout"]) == (0.3, 0.2)
    warnings = [json.loads(x)["message"] for x in (save / "train.jsonl").read_text().splitlines() if '"warning"' in x]
    assert [w for w in warnings if "dropout" in w] == [
        "resuming at update 2 with --dropout 0.1 -> 0.3; --attention-dropout 0.0 -> 0.2: the new values apply "
        "from the next update on"]
    expect_error(run_cli(*args, "--max-updates", "6", "--ffn", "64"), "architecture differs", "ffn 128 vs 64")


def test_a_precision_change_to_fp16_starts_a_fresh_loss_scale():
    """A bf16 or fp32 run saved a disabled scaler's empty state; resuming it in fp16 must not load that (torch
    raises on an empty state), and an fp16 run's scale carries over."""
    from nmt_cli.training.trainer import restore_scaler

    fresh = torch.amp.GradScaler("cpu", enabled=True)
    assert "a fresh fp16 loss scale" in restore_scaler(fresh, torch.amp.GradScaler("cpu", enabled=False).state_dict())
    saved = torch.amp.GradScaler("cpu", enabled=True, init_scale=512.0)
    resumed = torch.amp.GradScaler("cpu", enabled=True)
    assert restore_scaler(resumed, saved.state_dict()) is None and resumed.get_scale() == 512.0
    off = torch.amp.GradScaler("cpu", enabled=False)  # fp16 -> bf16: the saved scale is simply not used
    assert restore_scaler(off, saved.state_dict()) is None and not off.is_enabled()


def test_the_end_line_gives_the_best_validation_to_three_decimals(tmp_path):
    from nmt_cli.training.trainer import end_of_run

    line, code = end_of_run({"reason": "max_updates", "updates": 5, "elapsed": 3.2, "best": 4.1234567}, tmp_path)
    assert code == 0 and line == "stopped (max_updates) after 5 updates, 3 s; best 4.123"
    assert end_of_run({"reason": "max_updates", "updates": 5, "elapsed": 3.2, "best": None}, tmp_path)[0].endswith(
        "best none (no validation ran)")


def test_a_resume_keeps_the_runs_own_options_and_changes_only_those_given(toy_data, tmp_path):
    """A run started with many flags, resumed with only --max-updates raised, trains bit for bit as the same
    run uninterrupted (the flags not given keep the run's values, not the defaults); a resume with no flags at
    all goes on to the run's own --max-updates (nothing left: it says so); a flag given with another value is
    applied and named, with --quiet too."""
    flags = ["--arch", "tiny", "--max-tokens", "512", "--warmup", "20", "--lr-scale", "0.5", "--dropout", "0.2",
             "--seed", "7", "--label-smoothing", "0.2", "--device", "cpu", "--keep-last", "2", "--quiet"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", toy_data, "--save-dir", straight, *flags, "--max-updates", "6").exit_code == 0
    assert run_cli("train", toy_data, "--save-dir", resumed, *flags, "--max-updates", "3").exit_code == 0
    result = run_cli("train", toy_data, "--save-dir", resumed, "--max-updates", "6")
    assert result.exit_code == 0, result.output
    a, b = (load_checkpoint(d / "checkpoint_last.pt") for d in (straight, resumed))
    assert b["updates"] == 6 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert json.loads((resumed / "options.json").read_text())["warmup"] == 20
    assert len(numbered_checkpoints(resumed)) == 2  # --keep-last kept too

    again = run_cli("train", toy_data, "--save-dir", resumed)
    assert again.exit_code == 0 and "already finished (max_updates, 6 updates)" in again.stderr, again.output
    changed = run_cli("train", toy_data, "--save-dir", resumed, "--max-updates", "7", "--warmup", "30", "--quiet")
    assert changed.exit_code == 0, changed.output
    assert "nmt train: warning: resuming at update 6 with --warmup 20 -> 30" in changed.stderr
    options = json.loads((resumed / "options.json").read_text())
    assert (options["warmup"], options["lr_scale"], options["max_updates"]) == (30, 0.5, 7)

    # A fine-tuning run (its architecture from --init-from) resumes with its limit raised alone too.
    tuned = tmp_path / "tuned"
    assert run_cli("train", toy_data, "--save-dir", tuned, "--init-from", straight / "checkpoint_last.pt",
                   "--max-updates", "2", "--warmup", "2", "--max-tokens", "512", "--device", "cpu",
                   "--quiet").exit_code == 0
    again = run_cli("train", toy_data, "--save-dir", tuned, "--max-updates", "3", "--quiet")
    assert again.exit_code == 0, again.output
    assert load_checkpoint(tuned / "checkpoint_last.pt")["updates"] == 3


def test_lr_is_the_peak_of_eq_3_and_one_flag_of_the_two_is_given():
    from nmt_cli.training.update import lr_scale_for_peak

    for d_model, warmup, peak in ((512, 4000, 7e-4), (64, 20, 5e-3), (1024, 1, 1e-3)):
        scale = lr_scale_for_peak(peak, d_model, warmup)
        rates = [inverse_sqrt_lr(step, d_model, warmup, scale) for step in range(1, 2 * warmup + 2)]
        assert rates[warmup - 1] == pytest.approx(peak, rel=1e-12) and max(rates) == rates[warmup - 1]
    assert lr_scale_for_peak(inverse_sqrt_lr(4000, 512, 4000), 512, 4000) == pytest.approx(1.0)  # the paper's
    expect_error(run_cli("train", "d", "--save-dir", "s", "--lr", "1e-3", "--lr-scale", "2"), "--lr and --lr-scale")
    expect_error(run_cli("train", "d", "--save-dir", "s", "--adam-betas", "0.9"), "--adam-betas must be two numbers")


def test_weight_decay_is_decoupled_and_a_resume_applies_new_adam_settings(toy_data, tmp_path):
    """One update from the same weights and batch with --weight-decay 0, 0.1 and 0.2: the decay takes lr x wd x w
    off each weight beside Adam's step (decoupled, as AdamW), so the 0.2 run sits twice as far from the 0 run
    as the 0.1 run. A resume with other --adam-betas / --weight-decay trains with them and names them."""
    weights = {}
    for decay in (0.0, 0.1, 0.2):
        save = tmp_path / f"wd{decay}"
        train(TrainOptions(data=toy_data, save_dir=save, arch="tiny", max_tokens=512, max_updates=1, warmup=1,
                           lr=1e-2, dropout=0.0, weight_decay=decay, device="cpu", precision="fp32", quiet=True,
                           valid_interval=0))
        weights[decay] = load_checkpoint(save / "checkpoint_last.pt")["model"]
    for name, base in weights[0.0].items():
        if base.is_floating_point() and base.abs().sum() > 0 and name.endswith("weight"):
            one, two = base - weights[0.1][name], base - weights[0.2][name]
            assert one.abs().max() > 1e-6, name
            torch.testing.assert_close(two, 2 * one, rtol=1e-3, atol=1e-7, msg=name)
    save = tmp_path / "wd0.1"
    summary = train(TrainOptions(data=toy_data, save_dir=save, arch="tiny", max_tokens=512, max_updates=2, warmup=1,
                                 lr=1e-2, dropout=0.0, weight_decay=0.2, adam_betas=(0.8, 0.99), device="cpu",
                                 precision="fp32", quiet=True))
    assert summary["updates"] == 2
    groups = torch.load(save / "checkpoint_last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [(tuple(g["betas"]), g["weight_decay"]) for g in groups] == [((0.8, 0.99), 0.2)]
    warnings = [json.loads(x)["message"] for x in (save / "train.jsonl").read_text().splitlines() if '"warning"' in x]
    assert any("--weight-decay 0.1 -> 0.2" in w and "--adam-betas" in w for w in warnings), warnings


def test_ema_of_constant_weights_is_those_weights_and_a_resumed_run_keeps_it_bit_for_bit(toy_data, tmp_path):
    """--ema: the moving average of weights that do not change is those weights; a run resumed halfway has the
    same weights and the same moving average, to the bit, as the run uninterrupted; the average follows the
    weights (between them and where they started); `nmt average --ema` makes a model of it."""
    from nmt_cli.training.update import update_ema

    weights = [torch.randn(5, 3), torch.randn(7)]
    ema = [w.clone() for w in weights]
    for _ in range(10):
        update_ema(ema, weights, 0.9)
    assert all(torch.equal(e, w) for e, w in zip(ema, weights))

    flags = dict(arch="tiny", max_tokens=512, warmup=10, dropout=0.0, device="cpu", precision="fp32", quiet=True,
                 seed=7, ema=0.9)
    train(TrainOptions(data=toy_data, save_dir=tmp_path / "straight", max_updates=6, **flags))
    train(TrainOptions(data=toy_data, save_dir=tmp_path / "resumed", max_updates=3, **flags))
    train(TrainOptions(data=toy_data, save_dir=tmp_path / "resumed", max_updates=6, **flags))
    a, b = (load_checkpoint(tmp_path / d / "checkpoint_last.pt") for d in ("straight", "resumed"))
    assert a["ema"].keys() == b["ema"].keys() and all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moved = [k for k in a["ema"] if not torch.equal(a["ema"][k], a["model"][k])]
    assert moved and all(a["ema"][k].dtype == torch.float32 for k in a["ema"])
    numbered = load_checkpoint(tmp_path / "straight" / "checkpoint_6.pt")
    assert all(torch.equal(numbered["ema"][k], a["ema"][k]) for k in a["ema"])  # numbered checkpoints carry it

    out = tmp_path / "ema.pt"
    assert run_cli("average", "--ema", tmp_path / "straight" / "checkpoint_6.pt", "-o", out).exit_code == 0
    model = load_checkpoint(out)
    assert "ema" not in model and all(torch.equal(model["model"][k], a["ema"][k]) for k in a["ema"])
    plain = tmp_path / "plain"
    train(TrainOptions(data=toy_data, save_dir=plain, max_updates=1, **{**flags, "ema": 0.0}))
    expect_error(run_cli("average", "--ema", plain / "checkpoint_last.pt", "-o", tmp_path / "x.pt"),
                 "holds no moving average", "--ema DECAY")


def test_valid_ema_validates_the_moving_average_and_leaves_training_as_it_was(toy_data, tmp_path):
    """--valid-ema: each logged validation loss is the moving average's (the loss of a model made of the
    checkpoint's EMA, computed apart), not the weights'; the weights and the average after the run are those of
    the same run without the flag, to the bit. Without --ema it is one line."""
    from nmt_cli.data.binarized import DataDir, make_batches
    from nmt_cli.errors import NmtError
    from nmt_cli.model.checkpoint import model_from_checkpoint, with_ema_weights
    from nmt_cli.training.distributed import DistContext
    from nmt_cli.training.update import TranslationLoss, validate

    flags = dict(arch="tiny", max_tokens=512, warmup=10, dropout=0.0, device="cpu", precision="fp32", quiet=True,
                 seed=7, ema=0.9, max_updates=6, valid_interval=3)
    train(TrainOptions(data=toy_data, save_dir=tmp_path / "plain", **flags))
    train(TrainOptions(data=toy_data, save_dir=tmp_path / "ema", valid_ema=True, **flags))
    a, b = (load_checkpoint(tmp_path / d / "checkpoint_last.pt") for d in ("plain", "ema"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])

    def logged(save: Path) -> float:
        log = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines()]
        return [r for r in log if r["event"] == "valid"][-1]["valid_loss"]

    model, _ = model_from_checkpoint(with_ema_weights(b, "ema"))
    data = DataDir.open(toy_data)
    valid = data.split("valid")
    batches = make_batches(valid.src.sizes, valid.tgt.sizes, 512, 7)
    apart = validate(TranslationLoss(model, 0.1), valid, batches, data.vocab, "fp32", torch.device("cpu"),
                     DistContext())["valid_loss"]
    assert logged(tmp_path / "ema") == pytest.approx(apart, rel=1e-6)
    assert abs(logged(tmp_path / "plain") - apart) > 1e-3  # the weights' loss is another figure
    with pytest.raises(NmtError, match="--valid-ema validates the moving average of --ema"):
        train(TrainOptions(data=toy_data, save_dir=tmp_path / "x", **{**flags, "ema": 0.0, "valid_ema": True}))
