"""What a user reads first: every command's --help whole at 80 columns, the commands in pipeline order, one
letter per concept, and fairseq's spellings accepted without being listed."""

from __future__ import annotations

import json
import re

import pytest

from nmt_cli.cli.commandline import PIPELINE_ORDER, expand_aliases

from .conftest import run_cli
from .docs_reference import cli_commands

COMMANDS = cli_commands()


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_help_renders_whole_at_80_columns(path, monkeypatch):
    """Each line fits 80 columns; each flag name and each help sentence is there whole (wrapped, never cut);
    no markup eats a `[default: ...]`; no typer-internal type names or braces."""
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli(*path.split(), "--help")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert max(map(len, text.splitlines())) <= 80, text
    words = set(re.findall(r"[\w-]+", text.replace("/", " ")))
    flat = squeeze(text)
    for param in COMMANDS[path].params:
        if getattr(param, "hidden", False):
            continue
        for name in [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else []:
            assert name in words, (path, name)
        if param.help:
            assert squeeze(param.help) in flat, (path, param.help)
    usage = text.splitlines()[0]
    assert re.match(rf"Usage: \S+ {path} \[OPTIONS\]", usage) and "{" not in usage, usage  # CliRunner: "root"
    for leftover in ("<bool>", "list[", "…", "\\["):
        assert leftover not in text, (path, leftover)


def test_defaults_in_help_text_survive(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "[default: 4096]" in squeeze(run_cli("train", "-h").stdout).replace("default:", "default: ")
    assert "[default: by the target language]" in " ".join(run_cli("score", "-h").stdout.split())


def test_nmt_help_lists_the_commands_in_pipeline_order(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = run_cli("--help").stdout
    listed = re.findall(r"^  ([a-z][a-z0-9-]+)\s", text.split("Commands:")[1], flags=re.M)
    assert listed == [name for name in PIPELINE_ORDER if name in listed]
    assert listed[:5] == ["prepare", "learn-bpe", "apply-bpe", "binarize", "train"] and "serve" in listed


def test_one_letter_per_concept_across_commands():
    """-m is --model, -i the input, -o the output wherever they appear; translate and serve share the batch
    and precision flags; --workers means processes only."""
    meaning = {"-m": "--model", "-i": "--input", "-o": "--output"}
    for path, cmd in COMMANDS.items():
        for param in cmd.params:
            for short in set(param.opts) & set(meaning):
                assert meaning[short] in param.opts, (path, param.opts)
    flags = {path: {o for p in cmd.params for o in p.opts} for path, cmd in COMMANDS.items()}
    assert {"--batch-size", "--max-tokens", "--precision"} <= flags["translate"] & flags["serve"]
    assert "--workers" not in flags["translate"]  # processes in prepare; translate's are --parallel-batches


def test_aliases_expand_as_written_and_are_listed_apart_in_help():
    aliases = {"--max-update": ("--max-updates",), "--fp16": ("--precision", "fp16"), "--inputs": ()}
    assert expand_aliases(["--max-update", "3", "--fp16", "--inputs", "ck", "--max-update=4", "--", "--fp16"],
                          aliases) == ["--max-updates", "3", "--precision", "fp16", "ck", "--max-updates=4", "--",
                                       "--fp16"]
    text = run_cli("train", "--help").stdout
    options, listed = text.split("Other spellings accepted (fairseq's names):")
    assert "--max-update " not in options and "--warmup-updates" not in options and "--fp16" not in options
    listed = [line.split() for line in listed.strip().splitlines()]
    assert ["--max-update", "=", "--max-updates"] in listed and ["--fp16", "=", "--precision", "fp16"] in listed
    assert "Other spellings" not in run_cli("plot", "--help").stdout  # a command without aliases lists none


def test_fairseq_spellings_train_and_score(toy_data, tmp_path):
    """A fairseq user's flags work: --max-update, --warmup-updates, --cpu, --keep-interval-updates; score's
    --hyp as -i."""
    result = run_cli("train", toy_data, "--save-dir", tmp_path / "ck", "--arch", "tiny", "--max-update", "2",
                     "--warmup-updates", "1", "--keep-interval-updates", "1", "--cpu", "--quiet")
    assert result.exit_code == 0, result.output
    options = json.loads((tmp_path / "ck" / "options.json").read_text())
    assert (options["max_updates"], options["warmup"], options["keep_last"], options["device"]) == (2, 1, 1, "cpu")
    (tmp_path / "h").write_text("the cat sat on the mat by the door\n")
    both = [run_cli("score", "-r", tmp_path / "h", flag, tmp_path / "h", "--metrics", "bleu", "--json").stdout
            for flag in ("-i", "--hyp")]
    assert both[0] == both[1] and json.loads(both[0])[0]["score"] == 100.0
