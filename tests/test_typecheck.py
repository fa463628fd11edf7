"""The type check sees the package as it imports: a wrong call across modules fails it (scripts/typecheck.py).

With pyproject.toml's package-dir mapping, a plain `mypy common` typed every `streamdiloco.*` import as Any,
so a call with wrong arguments into another module passed. These tests run the real script, mypy and all,
on a copy of the sources with wrong calls added, and on the project itself.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("cli", "common", "server", "worker", "protos", "sim", "benchmarks", "examples")


def _copy_project(dest: Path) -> Path:
    for folder in SOURCES:
        shutil.copytree(
            ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "static", "results")
        )
    (dest / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "typecheck.py", dest / "scripts" / "typecheck.py")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _typecheck(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "typecheck.py")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )


# ~20 s of mypy runs; `make test` runs the check itself on the real tree: this one is in `make test-slow`
@pytest.mark.slow
def test_wrong_calls_across_modules_fail_the_check_with_the_real_paths(tmp_path):
    root = _copy_project(tmp_path / "project")
    # in a sub-package, into another sub-package: the call the issue found passing
    (root / "server" / "wrong_call.py").write_text(
        "from streamdiloco.common.schedule import send_step\n"
        "\n\n"
        "def wrong() -> int:\n"
        '    return send_step("a", None, 3)\n'
    )
    # in the root package (cli/), into a sub-package: a dataclass field of the wrong type, an unknown one
    (root / "cli" / "wrong_call.py").write_text(
        "from streamdiloco.common.config import SyncConfig\n"
        "\n"
        'cfg = SyncConfig(sync_every="30", no_such_field=1)\n'
    )
    # a script beside the package (examples/, benchmarks/) is checked against it too
    (root / "examples" / "wrong_call.py").write_text(
        "from streamdiloco.worker.model import build_gpt\n\nmodel = build_gpt(3)\n"
    )
    # an import of a first-party module that does not exist: an error, where it used to be Any
    (root / "common" / "missing.py").write_text("from streamdiloco.common.no_such_module import x  # noqa\n")
    r = _typecheck(root)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if ": error: " in line]
    # only these files fail, and the report names the repository's files, not the symlink tree's
    files = sorted({e.split(":")[0] for e in errors})
    assert files == [
        "cli/wrong_call.py",
        "common/missing.py",
        "examples/wrong_call.py",
        "server/wrong_call.py",
    ], r.stdout
    text = "\n".join(errors)
    assert 'Argument 1 to "send_step" has incompatible type "str"; expected "int"' in text
    assert 'Argument 2 to "send_step" has incompatible type "None"; expected "int"' in text
    assert 'Argument 3 to "send_step" has incompatible type "int"; expected "SyncConfig"' in text
    assert 'Argument "sync_every" to "SyncConfig" has incompatible type "str"; expected "int"' in text
    assert 'Unexpected keyword argument "no_such_field" for "SyncConfig"' in text
    assert 'Argument 1 to "build_gpt" has incompatible type "int"; expected "str"' in text
    assert 'Cannot find implementation or library stub for module named "streamdiloco.common.no_such' in text
    assert "build/typecheck" not in r.stdout + r.stderr


# `make test` runs this very check (scripts/typecheck.py) beside pytest: here it ran it a second time
@pytest.mark.slow
def test_the_project_passes_the_check():
    r = _typecheck(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("Success: no issues found"), r.stdout
