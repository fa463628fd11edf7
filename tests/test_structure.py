"""The package's shape, held: no import cycle (imports inside functions included; `if TYPE_CHECKING:` blocks,
which never run, excepted), no function over 80 lines and no class over 300 lines or 20 attributes (the
settings dataclasses, tables of declared fields, excepted), cli/ imported by nothing of the library, and
the shard's round logic (server/rounds/) pure: no grpc, asyncio or file I/O.

Read from the source with `ast`: nothing is imported, so a failure names the file and line to look at."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: the folders of the package and the names they import as
FOLDERS = {
    "cli": "streamdiloco",
    "common": "streamdiloco.common",
    "server": "streamdiloco.server",
    "worker": "streamdiloco.worker",
    "sim": "streamdiloco.sim",
    "protos": "streamdiloco.protos",
}
LIBRARY = ("common", "server", "worker", "sim", "protos")  # what the commands stand on
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
MAX_ATTRIBUTES = 20
IMPURE = {"grpc", "asyncio", "os", "pathlib", "shutil", "tempfile", "io", "socket"}  # not in server/rounds/


def modules() -> dict[str, Path]:
    """Every module of the package by its import name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if _type_checking(child):
            yield from (n for e in child.orelse for n in [e, *_walk(e)])
            continue
        yield child
        yield from _walk(child)


def imports(name: str) -> set[str]:
    """The package's modules that module `name` imports when it runs (at the top or in a function)."""
    is_package = MODULES[name].name == "__init__.py"
    found = set()
    for node in _walk(TREES[name]):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    found.add(f"{base}.{a.name}")
                elif base in MODULES:
                    found.add(base)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = {name: imports(name) for name in MODULES}
    assert cycles(graph) == []


def test_the_library_imports_nothing_of_cli():
    """cli/ holds the commands: server/, worker/, common/ and sim/ import no module of it (the root
    package's own __init__, with __version__, aside)."""
    cli_modules = {m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in FOLDERS} - {
        "streamdiloco"
    }
    library = {m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in LIBRARY}
    wrong = {name: sorted(imports(name) & cli_modules) for name in library if imports(name) & cli_modules}
    assert wrong == {}


def test_the_round_logic_is_pure():
    """server/rounds/ (ShardState and its collaborators): no grpc, asyncio or file I/O, so that it runs the
    same in the simulator and is tested without a network."""
    wrong = []
    for name, tree in TREES.items():
        if not name.startswith("streamdiloco.server.rounds"):
            continue
        for node in _walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                roots = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else set()
                if isinstance(node, ast.ImportFrom) and not node.level:
                    roots = {(node.module or "").split(".")[0]}
                if roots & IMPURE:
                    wrong.append(
                        f"{MODULES[name].relative_to(ROOT)}:{node.lineno} imports {sorted(roots & IMPURE)}"
                    )
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} opens a file")
    assert wrong == []


def _settings_table(node: ast.ClassDef) -> bool:
    """A dataclass whose body declares fields (a config, a record): a table of data, not behaviour."""
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return decorated and sum(len(m.body) for m in methods) <= 3 * max(1, len(methods)) + 20


def _attributes(node: ast.ClassDef) -> set[str]:
    names = {
        n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id == "self":
                names.add(n.attr)
    return names


@pytest.mark.parametrize("name", sorted(MODULES))
def test_functions_and_classes_stay_small(name):
    where = MODULES[name].relative_to(ROOT)
    wrong = []
    for node in ast.walk(TREES[name]):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
            wrong.append(f"{where}:{node.lineno} {node.name}() is {lines} lines")
        if isinstance(node, ast.ClassDef) and not _settings_table(node):
            if lines > MAX_CLASS_LINES:
                wrong.append(f"{where}:{node.lineno} class {node.name} is {lines} lines")
            if len(attributes := _attributes(node)) > MAX_ATTRIBUTES:
                wrong.append(f"{where}:{node.lineno} class {node.name} has {len(attributes)} attributes")
    assert wrong == []


def test_the_checks_see_what_they_look_for():
    """The reader finds a cycle, a lazy import and a long function where there are some (a check that
    could not fail would hold nothing)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    import x\nif TYPE_CHECKING:\n    import y\n")
    walked = [ast.unparse(n) for n in _walk(tree) if isinstance(n, ast.Import)]
    assert walked == ["import x"]
    assert "streamdiloco.server.shard" in imports("streamdiloco.server.startup")


def test_the_library_imports_without_the_commands():
    """The public library (connect, the sync engine, the global model's readers, a shard built and served
    from its config) imports no module of cli/ when it is imported (the package root, with its version,
    aside): checked in a fresh interpreter, as a user's program would import it."""
    cli_modules = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in FOLDERS)
    library = [
        "streamdiloco.worker.join",
        "streamdiloco.worker.engine",
        "streamdiloco.worker.group",
        "streamdiloco.common.globalmodel",
        "streamdiloco.server.storage.export",
        "streamdiloco.server.startup",
        "streamdiloco.server.main",
    ]
    code = (
        "import importlib, json, sys\n"
        f"for m in {library!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(m for m in {cli_modules!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == []
