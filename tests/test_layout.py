"""The package's modules form layers: each module imports, at its top or inside a function, only modules of
lower layers, in the order docs/design.md lists them; and nothing imports in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nmt_cli"


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (TYPE_CHECKING blocks included)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nmt_cli."):
                found.add(node.module.split(".")[1])
        graph[name] = found & modules
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles a depth-first search meets, each as the path that closes it (none found: none exist)."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                found.append(path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt])
            elif state[nxt] == 0:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node, [])
    return found


DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def documented_layers() -> dict[str, int]:
    """module -> its layer number in docs/design.md's numbered list ("3. `precision`, `commandline` ...")."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("Layers, lowest first"):]
    section = section[: section.index("\n## ")]
    layers: dict[str, int] = {}
    for number, body in re.findall(r"^(\d+)\. (.+(?:\n   .+)*)", section, flags=re.M):
        for name in re.findall(r"`(\w+)`", body):
            assert name not in layers, f"{name} is listed twice in docs/design.md's layers"
            layers[name] = int(number)
    return layers


def test_every_import_goes_to_a_lower_documented_layer():
    graph, layers = import_graph(), documented_layers()
    assert set(graph) == set(layers), ("modules missing from docs/design.md's layers", set(graph) ^ set(layers))
    wrong = [f"{m} (layer {layers[m]}) imports {d} (layer {layers[d]})" for m in graph for d in graph[m]
             if layers[d] >= layers[m]]
    assert not wrong, wrong


def test_the_layer_check_finds_an_upward_import():
    """The check above reads the real list: an import of a module from its own layer is reported."""
    layers = documented_layers()
    assert layers["errors"] == 1 and layers["cli"] > layers["train"] > layers["update"] > layers["model"]
    graph = {**import_graph(), "errors": {"ops"}}
    assert any(layers[d] >= layers[m] for m in graph for d in graph[m])


def test_no_import_circles():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_circle_check_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_stated_torch_minimum_is_the_checked_one_and_older_torch_gets_one_line(monkeypatch):
    """pyproject.toml's torch requirement is commandline.MIN_TORCH (the newest API the code calls: see there), and
    a command run on an older torch stops with one line instead of an AttributeError mid-training."""
    import re

    import torch

    from nmt_cli.commandline import MIN_TORCH

    from .conftest import expect_error, run_cli

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    stated = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert stated and tuple(map(int, stated.groups())) == MIN_TORCH
    assert hasattr(torch.nn.utils, "get_total_norm")
    monkeypatch.setattr("nmt_cli.commandline.installed_torch_version", lambda: "2.5.1+cpu")
    expect_error(run_cli("average", "x.pt", "-o", "y.pt"), "nmt needs torch 2.6 or newer, found 2.5.1+cpu")


def test_tests_import_nothing_from_benchmarks():
    """Benchmarks hold measurements only: no test imports a benchmarks/ script or puts the folder on sys.path
    (the toy task and `make gpu-check` live in the package)."""
    tests = Path(__file__).resolve().parent
    scripts = {p.stem for p in (tests.parent / "benchmarks").glob("*.py")}
    found = []
    for path in tests.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        if re.search(r"sys\.path\.\w+\(.*benchmarks", source):
            found.append(f"{path.name}: puts benchmarks/ on sys.path")
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found += [f"{path.name}: imports {n}" for n in names if n.split(".")[0] in scripts]
    assert not found, found
