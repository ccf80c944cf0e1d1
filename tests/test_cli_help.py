"""What a user reads first: every command's --help whole at 80 columns, the commands in pipeline order, one
letter per concept, and fairseq's spellings accepted without being listed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence  # noqa: F401 (a test's dataclass field is typed with it)

import pytest

from nmt_cli.cli.commandline import PIPELINE_ORDER, expand_aliases

from .conftest import expect_error, run_cli
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


def test_a_config_file_sets_a_commands_options_and_flags_override_it(toy_data, toy_model, tmp_path):
    """--config FILE: the same run as the flags it holds (options.json equal), a flag given beside it wins, and
    --print-config's output read back gives itself; translate reads one too. An unknown key names the file, the
    key and the nearest flag; a bad value names the file and the key; both one line, exit code 2."""
    run = tmp_path / "run.yaml"
    run.write_text("arch: tiny\nmax_tokens: 512\nwarmup: 20\nmax-updates: 2\ndevice: cpu\nlr-scale: 0.5\nquiet: true\n")
    flags = ["--arch", "tiny", "--max-tokens", "512", "--warmup", "20", "--max-updates", "2", "--device", "cpu",
             "--lr-scale", "0.5", "--quiet"]
    assert run_cli("train", toy_data, "--save-dir", tmp_path / "a", "--config", run).exit_code == 0
    assert run_cli("train", toy_data, "--save-dir", tmp_path / "b", *flags).exit_code == 0
    a, b = (json.loads((tmp_path / d / "options.json").read_text()) for d in "ab")
    assert {k: v for k, v in a.items() if k != "save_dir"} == {k: v for k, v in b.items() if k != "save_dir"}

    printed = run_cli("train", toy_data, "--save-dir", tmp_path / "c", "--config", run, "--warmup", "7",
                      "--print-config")
    assert printed.exit_code == 0 and "warmup: 7\n" in printed.stdout and "max-tokens: 512\n" in printed.stdout
    assert not (tmp_path / "c").exists()  # printed, nothing run
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    again = run_cli("train", "--config", tmp_path / "printed.yaml", "--print-config")
    assert again.stdout == printed.stdout

    (tmp_path / "beam.yaml").write_text("beam: 1\nlenpen: 0.0\n")
    source = tmp_path / "in.en"
    source.write_text("W1 W2 W3 .\n")
    via_file = run_cli("translate", "-m", toy_model, "-i", source, "--config", tmp_path / "beam.yaml")
    via_flags = run_cli("translate", "-m", toy_model, "-i", source, "--beam", "1", "--lenpen", "0")
    assert via_file.exit_code == 0 and via_file.stdout == via_flags.stdout

    (tmp_path / "typo.yaml").write_text("max-token: 512\n")
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "d", "--config", tmp_path / "typo.yaml"),
                 "typo.yaml: unknown key 'max-token'", "did you mean 'max-tokens'?")
    (tmp_path / "value.yaml").write_text("max-tokens: lots\n")
    expect_error(run_cli("train", toy_data, "--save-dir", tmp_path / "d", "--config", tmp_path / "value.yaml"),
                 "value.yaml: max-tokens:")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    expect_error(run_cli("average", "--config", tmp_path / "list.yaml"), "list.yaml: expected a mapping")


def test_each_option_is_declared_once_by_its_dataclass_field():
    """`TrainOptions` and `PrepareOptions` (what options.json records and a resume compares) are the only
    declaration of `nmt train`'s and `nmt prepare`'s flags: every field is a parameter of its command, with the
    field's own help, and the commands have no other parameter but --config and --print-config."""
    import dataclasses

    from nmt_cli.data.prepare import PrepareOptions
    from nmt_cli.option_fields import flag_of
    from nmt_cli.training.options import TrainOptions

    for command, options in (("train", TrainOptions), ("prepare", PrepareOptions)):
        params = {p.name: p for p in COMMANDS[command].params}
        declared = {f.name: flag_of(f) for f in dataclasses.fields(options)}
        assert set(params) - {"config", "print_config", "help"} == set(declared), command
        for name, flag in declared.items():
            assert params[name].help == flag.help, (command, name)


def test_options_command_turns_a_dataclass_into_flags():
    """The flags `options_command` makes from declared fields: spellings and short names, a choice, text parsed
    into the field's value, a repeatable flag (an empty tuple when not given), a switch pair, a field the flag
    may leave out; --help shows each field's help; a value outside the choices is a usage error (exit 2)."""
    from dataclasses import dataclass

    import typer
    from typer.testing import CliRunner

    from nmt_cli.cli.flags import options_command
    from nmt_cli.option_fields import option
    from nmt_cli.training.options import parse_betas

    @dataclass
    class Demo:
        name: str = option(decls=("--name", "-n"), unset=True, help="A name to greet.")
        size: int = option(3, help="How many times.")
        kind: str | None = option(None, choices=("plain", "loud"), help="How to greet.")
        betas: tuple[float, float] = option((0.9, 0.98), parse=parse_betas, text="0.9,0.98", help="Two numbers.")
        items: Sequence[str] = option((), decls=("--item",), type=list[str], help="Repeat for more.")
        polite: bool = option(True, decls=("--polite/--rude",), help="Say please.")

    seen = []
    app = typer.Typer()

    @app.command()
    @options_command(Demo)
    def demo(context: typer.Context, opts: Demo, values: dict) -> None:
        seen.append(opts)

    runner = CliRunner()
    result = runner.invoke(app, ["-n", "Ada", "--size", "5", "--kind", "loud", "--betas", "(0.5, 0.6)",
                                 "--item", "a", "--item", "b", "--rude"])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, []).exit_code == 0
    assert seen == [Demo("Ada", 5, "loud", (0.5, 0.6), ("a", "b"), False), Demo(None, 3, None, (0.9, 0.98), (), True)]
    shown = squeeze(runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output)
    for text in ("--name", "-n", "Anametogreet.", "[default:3]", "plain|loud", "--polite", "--rude", "0.9,0.98"):
        assert text in shown, text
    assert runner.invoke(app, ["--kind", "quiet"]).exit_code == 2
