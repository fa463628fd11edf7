"""The type check of the whole package: mypy over `streamdiloco.*` as it is installed, not folder by folder.

The code sits in top-level folders (cli/ is the package `streamdiloco`, common/ is `streamdiloco.common`, ...)
that pyproject.toml's `package-dir` maps into one package. mypy cannot follow that mapping (nor the editable
install's import hook), so a plain `mypy common` types every `streamdiloco.*` import as Any and a wrong call
across modules passes. This script builds the package as a tree of symlinks to the real files
(build/typecheck/streamdiloco/), runs mypy on it and on the scripts that use the package (benchmarks/,
examples/: modules `benchmarks.wire`, ..., so that benchmarks/codecs.py is not taken for the standard
library's codecs), and prints mypy's report with the real paths (common/schedule.py, not
build/typecheck/streamdiloco/common/schedule.py). Any extra arguments go to mypy (e.g.
`--disallow-untyped-defs`). The exit status is mypy's.

    python scripts/typecheck.py            # `make typecheck`; `make test` runs it too
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "streamdiloco"
SCRIPTS = ("benchmarks", "examples")  # folders of scripts that import the package, checked with it


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject.toml's package-dir: {"streamdiloco": "cli", "streamdiloco.common": "common", ...}."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    if PACKAGE not in mapping:
        raise SystemExit(f"streamdiloco: error: pyproject.toml's package-dir has no {PACKAGE!r}")
    return dict(mapping)


def build_tree(root: Path, base: Path | None = None) -> Path:
    """build/typecheck/streamdiloco/ (or BASE/streamdiloco/): a symlink per file of the root package's
    folder, one per sub-package. The docs build (scripts/docs_hook.py) makes its own for mkdocstrings.

    Made anew on every run, so that files added or removed since the last run are seen as they are.
    """
    base = base or root / "build" / "typecheck"
    pkg = base / PACKAGE
    shutil.rmtree(base, ignore_errors=True)
    pkg.mkdir(parents=True)
    mapping = package_dirs(root)
    for entry in sorted((root / mapping[PACKAGE]).iterdir()):
        if entry.is_file() and entry.suffix in (".py", ".pyi"):
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name == PACKAGE:
            continue
        parts = name.split(".")
        if parts[0] != PACKAGE or len(parts) != 2:
            raise SystemExit(f"streamdiloco: error: package-dir entry {name!r} is not streamdiloco.<name>")
        (pkg / parts[1]).symlink_to(root / folder, target_is_directory=True)
    return base


def real_paths(text: str, root: Path, base: Path) -> str:
    """mypy's report with every path inside the symlink tree replaced by the repository's own file."""
    prefixes = "|".join(re.escape(str(p)) for p in (base, base.relative_to(root)))
    pattern = re.compile(rf"(?:{prefixes})/(\S+?\.pyi?)")

    def real(m: re.Match[str]) -> str:
        target = (base / m.group(1)).resolve()
        try:
            return str(target.relative_to(root))
        except ValueError:
            return str(target)

    return pattern.sub(real, text)


def main(argv: list[str]) -> int:
    base = build_tree(ROOT)
    env = dict(os.environ, MYPYPATH=str(base))
    # module names from the folders given (streamdiloco.* from MYPYPATH, benchmarks.* from the root)
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--explicit-package-bases",
    ]
    cmd += [str((base / PACKAGE).relative_to(ROOT)), *SCRIPTS, *argv]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    sys.stdout.write(real_paths(r.stdout, ROOT, base))
    sys.stderr.write(real_paths(r.stderr, ROOT, base))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
