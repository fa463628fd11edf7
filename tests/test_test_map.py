"""Tests found by module: every module of the package (cli/, common/, server/ and its subpackages, worker/,
sim/) is imported by a test file, or docs/testing.md's table names the test files that cover it (a module
that tests reach only through processes, say). The package is read as it is when the test runs, so a module
added, moved or renamed is checked at once; the table's rows must name modules and test files that exist.

`python tests/test_test_map.py` prints the map as the imports give it (module | test files), to fill the
table with.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "streamdiloco"
FOLDERS = ("cli", "common", "server", "worker", "sim")  # protos/ is generated code
TESTING_MD = ROOT / "docs" / "testing.md"
ROW = re.compile(r"^\|\s*`([\w/]+\.py)`\s*\|(.*)\|\s*$")  # | `server/shard.py` | `tests/test_shard.py`, ... |
TEST_FILE = re.compile(r"`(tests/[\w/]+\.py)`")


@cache
def package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir: {"streamdiloco": "cli", "streamdiloco.common": "common", ...}."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def modules() -> dict[str, str]:
    """Every module of the package in FOLDERS, as it is on disk now: dotted name -> path (cli/launch.py).
    A package's __init__.py counts where it holds more than a docstring and imports."""
    folder_of = {folder: name for name, folder in package_dirs().items()}
    out = {}
    for folder in FOLDERS:
        base = folder_of[folder]
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                if not _has_code(path):
                    continue
                parts = parts[:-1]
            if parts[-1:] == ["__main__"]:
                continue  # `python -m streamdiloco`: cli.py's main, run by every process a test starts
            out[".".join([base, *parts])] = path.relative_to(ROOT).as_posix()
    return out


def _has_code(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return any(not isinstance(n, ast.Import | ast.ImportFrom | ast.Assign) for n in body)


def files_of_the_tests() -> list[Path]:
    """The test files and the tests' own tools (tests/support/), whose imports the tests run."""
    return sorted((ROOT / "tests").glob("test_*.py")) + sorted((ROOT / "tests" / "support").glob("*.py"))


def imported_by(path: Path) -> set[str]:
    """Every streamdiloco module a file imports, at the top or inside a function: for `from A import b`
    both A and A.b (b may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    out = set()
    for name in names:
        while name.startswith(PACKAGE):  # a module's import is also its packages'
            out.add(name)
            name = name.rpartition(".")[0]
    return out


def import_map() -> dict[str, list[str]]:
    """module path -> the test files (tests/...) that import it."""
    mods = modules()
    found: dict[str, list[str]] = {path: [] for path in mods.values()}
    for test in files_of_the_tests():
        for name in imported_by(test) & mods.keys():
            found[mods[name]].append(test.relative_to(ROOT).as_posix())
    return found


def table() -> dict[str, list[str]]:
    """docs/testing.md's table: module path -> the test files its row names."""
    rows = {}
    for line in TESTING_MD.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = TEST_FILE.findall(m.group(2))
    return rows


def test_every_module_is_imported_by_a_test_or_named_in_the_testing_page():
    rows = table()
    untested = [path for path, tests in import_map().items() if not tests and not rows.get(path)]
    assert not untested, (
        f"no test file imports {', '.join(untested)}: import it in the test that covers it, or add a row "
        f"`| `{untested[0]}` | `tests/test_....py` |` to the table in docs/testing.md"
    )


def test_the_testing_pages_table_names_modules_and_test_files_that_exist():
    rows = table()
    assert len(rows) > 20, "docs/testing.md has lost its table of modules and tests"
    gone = [path for path in rows if not (ROOT / path).is_file()]
    assert not gone, f"docs/testing.md's table names modules that do not exist (moved or renamed?): {gone}"
    missing = sorted({t for tests in rows.values() for t in tests if not (ROOT / t).is_file()})
    assert not missing, f"docs/testing.md's table names test files that do not exist: {missing}"
    empty = [path for path, tests in rows.items() if not tests]
    assert not empty, f"docs/testing.md's table has rows without a test file: {empty}"


def test_the_map_reads_the_package_as_it_is():
    mods = modules()
    assert mods["streamdiloco.server.rounds.staging"] == "server/rounds/staging.py"
    assert mods["streamdiloco.common.codecs"] == "common/codecs.py"
    assert "streamdiloco" not in mods  # cli/__init__.py holds the docstring and the version
    assert "streamdiloco.__main__" not in mods
    assert "tests/test_staging.py" in import_map()["server/rounds/staging.py"]


if __name__ == "__main__":
    for path, tests in import_map().items():
        shown = ", ".join(f"`{t}`" for t in tests[:4]) + (f" (+{len(tests) - 4})" if len(tests) > 4 else "")
        print(f"| `{path}` | {shown or '(none)'} |", file=sys.stdout)
