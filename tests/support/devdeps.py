"""The rule that a test of a `[dev]` dependency never skips quietly: `pytest.importorskip` of a module that
pyproject.toml's dev extra installs (transformers, wandb, playwright, tensorboard, ...) fails the test
instead of skipping it, since `make test` installs that extra and a skip there means a broken install, not
an optional feature. STREAMDILOCO_TEST_ALLOW_MISSING_DEV=1 lets such tests skip (a partial install, on
purpose). Skips for what the machine lacks (a GPU, root, a docker engine, a browser binary) are untouched.

tests/conftest.py installs `strict_importorskip` in place of `pytest.importorskip`. The dev extra is read
from pyproject.toml when the tests start, so that a dependency added there is covered at once. What this
module must not do: skip or fail anything by itself, or import the dependencies it names.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ALLOW_ENV = "STREAMDILOCO_TEST_ALLOW_MISSING_DEV"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# modules whose distribution is named otherwise, for when it is not installed (nothing to look it up in)
IMPORT_ALIASES = {
    "yaml": "pyyaml",
    "grpc_tools": "grpcio-tools",
    "xdist": "pytest-xdist",
    "material": "mkdocs-material",
}


@cache
def dev_distributions() -> frozenset[str]:
    """The canonical names of pyproject.toml's `[dev]` extra (mkdocstrings[python] is mkdocstrings)."""
    with open(PYPROJECT, "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    return frozenset(canonicalize_name(Requirement(r).name) for r in extra)


@cache
def installed_packages() -> dict[str, list[str]]:
    """Top-level package -> the installed distributions that provide it (read once: it walks them all)."""
    return dict(importlib.metadata.packages_distributions())


def distribution_of(modname: str) -> str:
    """The canonical name of the distribution that installs the top-level package of `modname`: the
    installed one's metadata says; else the alias table, else the module's own name."""
    top = modname.split(".")[0]
    installed = installed_packages().get(top)
    if installed:
        return canonicalize_name(installed[0])
    return canonicalize_name(IMPORT_ALIASES.get(top, top))


def is_dev_module(modname: str) -> bool:
    return distribution_of(modname) in dev_distributions()


def missing_dev_message(modname: str, skip: BaseException) -> str:
    reason = re.sub(r"\s+", " ", str(skip)).strip()
    return (
        f"{modname} comes with the [dev] extra (pip install -e '.[dev]'), but it did not import: {reason}. "
        f"A test of a dev dependency does not skip; {ALLOW_ENV}=1 lets it skip on a partial install."
    )


def strict_importorskip(importorskip: Callable[..., Any]) -> Callable[..., Any]:
    """`importorskip` that fails, instead of skipping, for a module of the dev extra (see the docstring)."""

    def strict(modname: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return importorskip(modname, *args, **kwargs)
        except pytest.skip.Exception as skip:
            if os.environ.get(ALLOW_ENV) == "1" or not is_dev_module(modname):
                raise
            pytest.fail(missing_dev_message(modname, skip), pytrace=False)

    strict.__doc__ = importorskip.__doc__
    strict.__wrapped__ = importorskip  # type: ignore[attr-defined]
    return strict
