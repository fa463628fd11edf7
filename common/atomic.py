"""Atomic file writes: whatever happens while a file is written (an error, a full disk, the process killed,
the machine losing power), the path holds the old file or the new one, never a part of either.

One way, for every file the package writes in place of another (a shard's checkpoint, a worker's, an
exported model, a run's certificates and keys, a shard's ready file): the bytes go to a temporary file in
the same directory (same file system, so the rename is atomic), which is flushed and fsynced, renamed over
the path, and then the directory is fsynced so that the rename itself survives a power loss. On an error
the temporary file is removed and the error raised; the path is untouched. Only a process killed while it
writes leaves its temporary file behind (`.NAME.XXXXXXXX.tmp`, hidden, never read by anything).

    atomic_write(path, lambda f: torch.save(state, f))      # a writer that takes a binary file object
    atomic_write_bytes(path, data, mode=0o600)              # bytes; a secret readable by its owner only
    atomic_write_text(path, json.dumps(meta))               # text (UTF-8)
    atomic_save(path, lambda tmp: save_file(tensors, tmp))  # a writer that wants a path (safetensors)

Must not: import anything of the package (common/ is the bottom layer) or know any file format.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_save", "atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename into it, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temporary(path: Path, mode: int) -> Iterator[Path]:
    """A new, empty temporary file beside `path` (its name unique: two writers of one path never share it),
    created with `mode` (less the umask, as open() does). Removed if the block fails; the caller renames it
    otherwise."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _commit(tmp: Path, path: Path, before_rename: Callable[[], object] | None) -> None:
    """The temporary file (already fsynced) takes the path's place, durably; removed if that fails."""
    try:
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    *,
    mode: int = 0o666,
    before_rename: Callable[[], object] | None = None,
) -> None:
    """`write(f)` fills a binary file object; its bytes replace `path` atomically and durably (see the
    module's docstring). `mode`: the new file's permissions (less the umask). `before_rename()`, if given,
    runs once the new bytes are durable and before they replace the old file (a shard's checkpoint lists
    the new file's hash there); if it raises, the old file stays."""
    path = Path(path)
    with _temporary(path, mode) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    _commit(tmp, path, before_rename)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o666) -> None:
    """Replace `path` with `data`, atomically and durably."""
    atomic_write(path, lambda f: f.write(data), mode=mode)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, mode: int = 0o666, encoding: str = "utf-8"
) -> None:
    """Replace `path` with `text` (encoded with `encoding`), atomically and durably."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode)


def atomic_save(path: str | os.PathLike[str], save: Callable[[str], object], *, mode: int = 0o666) -> None:
    """For a writer that takes a path, not a file object (safetensors' `save_file`): `save(tmp)` writes the
    temporary file by its name (it may replace it); it is then fsynced and renamed over `path`, and the
    directory fsynced. On an error the temporary file is removed and `path` is untouched."""
    path = Path(path)
    with _temporary(path, mode) as tmp:
        save(str(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _commit(tmp, path, None)
