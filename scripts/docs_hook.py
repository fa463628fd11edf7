"""The docs build's hook (mkdocs.yml `hooks:`): the package laid out as it imports, for mkdocstrings.

The code sits in top-level folders that pyproject.toml's package-dir maps into `streamdiloco.*`; griffe
(mkdocstrings' reader, static analysis: nothing is imported) cannot follow that mapping. So, as the type
check does, the build makes build/docs/streamdiloco/, a tree of symlinks to the real files, which
mkdocs.yml's `paths:` points at. Made anew on every build. It must not import the package (nor torch).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "docs"


def _build_tree() -> None:
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
    assert spec and spec.loader
    typecheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(typecheck)
    typecheck.build_tree(ROOT, TREE)


def on_startup(command: str, dirty: bool) -> None:
    """Before the config's plugins read anything: the tree mkdocstrings' `paths: [build/docs]` names."""
    _build_tree()


def on_config(config: Any) -> Any:
    """`mkdocs serve` rebuilds call this again: files added or removed since are seen."""
    _build_tree()
    return config
