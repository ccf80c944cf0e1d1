"""The package's layout is its architecture: packages by job in an order, modules in layers inside each, as
docs/design.md's layout table lists them. A module imports (at its top or inside a function) only lower modules of
its own package and modules of lower packages; nothing imports in a circle; every package's `__init__.py` imports
nothing, and the names the top one offers exist where it says."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nmt_cli"
DESIGN = REPO / "docs" / "design.md"


def module_name(path: Path) -> str:
    """'decode.search' for nmt_cli/decode/search.py, 'errors' for nmt_cli/errors.py."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def package_of(module: str) -> str:
    """The module's package ('' for the root)."""
    return module.rpartition(".")[0]


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules that the file at `path` imports anywhere in its source (TYPE_CHECKING blocks too)."""
    here = ".".join(path.parent.relative_to(PACKAGE).parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("nmt_cli.") for a in node.names if a.name.startswith("nmt_cli.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1]) if here else ""
                base = ".".join(p for p in (base, node.module or "") if p)
            elif node.module == "nmt_cli" or (node.module or "").startswith("nmt_cli."):
                base = node.module.removeprefix("nmt_cli").lstrip(".")
            else:
                continue
            found.add(base)
            found |= {".".join(p for p in (base, a.name) if p) for a in node.names}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports; `__init__.py` files and `__main__` (the entry point) are not
    modules of a layer (test_package_inits_import_nothing checks the first)."""
    paths = [p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) - {module_name(p)} for p in paths}


def documented_layout() -> tuple[list[str], dict[str, int]]:
    """The packages in docs/design.md's layout table, lowest first ('' for the root), and module -> its layer
    in its package (from 1)."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    section = section[: section.index("\n## ", 1)]
    packages: list[str] = []
    layers: dict[str, int] = {}
    for row in re.findall(r"^\| `(?:nmt_cli|(\w+))/`[^|]*\|[^|]*\|([^|]+)\|$", section, flags=re.M):
        package, cells = row
        packages.append(package)
        for layer, body in enumerate(cells.split("<"), start=1):
            for name in re.findall(r"`(\w+)`", body):
                module = f"{package}.{name}" if package else name
                assert module not in layers, f"{module} is listed twice in docs/design.md's layout"
                layers[module] = layer
    return packages, layers


def upward_imports(graph: dict[str, set[str]], packages: list[str], layers: dict[str, int]) -> list[str]:
    """Each import that goes to a higher package, or within a package to the same or a higher layer."""
    rank = {p: i for i, p in enumerate(packages)}
    wrong = []
    for module, imported in graph.items():
        for dep in imported:
            mine, theirs = rank[package_of(module)], rank[package_of(dep)]
            if theirs > mine or (theirs == mine and layers[dep] >= layers[module]):
                wrong.append(f"{module} imports {dep}")
    return sorted(wrong)


def test_every_import_goes_to_a_lower_package_or_layer():
    graph, (packages, layers) = import_graph(), documented_layout()
    assert len(packages) == 9 and packages[0] == "" and packages[-1] == "cli", packages
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(packages) - {""} == on_disk, ("packages missing from docs/design.md's layout", on_disk)
    assert set(graph) == set(layers), ("modules missing from docs/design.md's layout", set(graph) ^ set(layers))
    wrong = upward_imports(graph, packages, layers)
    assert not wrong, wrong


def test_the_layout_check_finds_an_upward_import():
    """The check above reads the real table: an import of a higher package, or of a module of the same layer
    in its own package, is reported, and a downward one is not."""
    packages, layers = documented_layout()
    assert layers["errors"] == 1 and layers["decode.translate"] > layers["decode.search"] > layers["decode.sampling"]
    graph = import_graph()
    assert not upward_imports({"decode.search": {"model.ops", "decode.sampling"}}, packages, layers)
    assert upward_imports({"model.ops": {"decode.search"}}, packages, layers) == ["model.ops imports decode.search"]
    assert upward_imports({"decode.steering": {"decode.pipeline"}}, packages, layers)
    assert upward_imports({**graph, "errors": {"textio"}}, packages, layers) == ["errors imports textio"]


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


def test_no_import_circles_between_modules_or_packages():
    graph = import_graph()
    assert not cycles(graph), cycles(graph)
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(package_of(module), set()).update(package_of(d) for d in imported)
    packages = {p: deps - {p} for p, deps in packages.items()}
    assert not cycles(packages), cycles(packages)


def test_the_circle_check_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_every_import_of_the_package_names_what_exists():
    """Each `from ... import name` of the package, at a module's top or inside a function (where only running
    that function would find it wrong), names a module or an attribute that exists."""
    import importlib.util

    wrong = []
    for path in PACKAGE.rglob("*.py"):
        here = ".".join(path.parent.relative_to(PACKAGE).parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = here.split(".") if here else []
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
                target = "nmt_cli" + (f".{base}" if base else "")
            elif node.module == "nmt_cli" or (node.module or "").startswith("nmt_cli."):
                target = node.module
            else:
                continue
            module = importlib.import_module(target)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{target}.{alias.name}") is None:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {target} has no {alias.name}")
    assert not wrong, wrong


def test_package_inits_import_nothing_and_the_top_names_the_api():
    """A subpackage's `__init__.py` is its one-sentence docstring; the top one imports none of the package at
    import time (so `import nmt_cli` loads no torch), and each name of its API is defined where it says."""
    for init in PACKAGE.glob("*/__init__.py"):
        body = ast.parse(init.read_text(encoding="utf-8")).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), init
    top = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    own = [n for n in ast.walk(top) if isinstance(n, ast.ImportFrom) and (n.level or "nmt_cli" in (n.module or ""))]
    assert not own
    import nmt_cli

    for name, module in nmt_cli.API.items():
        assert getattr(importlib.import_module(module), name) is getattr(nmt_cli, name), name


def test_the_stated_torch_minimum_is_the_checked_one_and_older_torch_gets_one_line(monkeypatch):
    """pyproject.toml's torch requirement is commandline.MIN_TORCH (the newest API the code calls: see there), and
    a command run on an older torch stops with one line instead of an AttributeError mid-training."""
    import re

    import torch

    from nmt_cli.cli.commandline import MIN_TORCH

    from .conftest import expect_error, run_cli

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    stated = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert stated and tuple(map(int, stated.groups())) == MIN_TORCH
    assert hasattr(torch.nn.utils, "get_total_norm")
    monkeypatch.setattr("nmt_cli.cli.commandline.installed_torch_version", lambda: "2.5.1+cpu")
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
