"""Atomic writes (common/atomic.py): after a write that fails at any point the path holds the old file or
the new one, complete, and no temporary file is left; the new file is fsynced before the rename and the
directory after it; modes and path-taking writers (safetensors) as the callers use them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamdiloco.common.atomic import atomic_save, atomic_write, atomic_write_bytes, atomic_write_text


class Crash(OSError):
    pass


def test_a_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"first"))
    assert path.read_bytes() == b"first"
    atomic_write(path, lambda f: f.write(b"second, longer"))
    assert path.read_bytes() == b"second, longer"
    atomic_write_text(tmp_path / "t.json", '{"é": 1}')
    assert (tmp_path / "t.json").read_text(encoding="utf-8") == '{"é": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "t.json"]


def test_a_write_that_fails_midway_keeps_the_old_file_and_removes_its_temporary_file(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half of the new")
        raise Crash("disk gone")

    with pytest.raises(Crash, match="disk gone"):
        atomic_write(path, broken)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_first_write_that_fails_leaves_no_file_at_all(tmp_path):
    path = tmp_path / "new.pt"

    def broken(f):
        torch.save({"w": torch.ones(1000)}, f)
        raise KeyboardInterrupt  # not only OSError: Ctrl+C midway cleans up too

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, broken)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["fsync", "replace", "before_rename"])
def test_a_failure_at_the_commit_keeps_the_old_file_complete_and_cleans_up(tmp_path, monkeypatch, where):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")
    hook = None
    if where == "before_rename":

        def hook():
            raise Crash("killed before the rename")

    else:
        monkeypatch.setattr(os, where, lambda *a: (_ for _ in ()).throw(Crash(where)))
    with pytest.raises(Crash):
        atomic_write(path, lambda f: f.write(b"new, complete"), before_rename=hook)
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    path, events = tmp_path / "f.bin", []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(path, lambda f: f.write(b"x"), before_rename=lambda: events.append(("before_rename", "")))
    atomic_save(tmp_path / "g.bin", lambda tmp: Path(tmp).write_bytes(b"y"))
    assert events == [
        ("fsync", "file"),
        ("before_rename", ""),
        ("replace", "f.bin"),
        ("fsync", "dir"),
        ("fsync", "file"),
        ("replace", "g.bin"),
        ("fsync", "dir"),
    ]


def test_modes_are_set_at_creation_less_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "secret", b"k", mode=0o600)
        atomic_write_bytes(tmp_path / "public", b"c", mode=0o644)
        atomic_write_bytes(tmp_path / "default", b"d")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "public").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "default").stat().st_mode) == 0o644  # as open(): 0o666 less the umask


def test_a_secret_overwritten_stays_owner_only_even_if_a_stale_temporary_file_is_there(tmp_path):
    path = tmp_path / "ca.key"
    stale = tmp_path / f".{path.name}.deadbeef.tmp"  # a writer killed midway left one, world-readable
    stale.write_bytes(b"junk")
    os.chmod(stale, 0o644)
    atomic_write_bytes(path, b"key", mode=0o600)
    assert path.read_bytes() == b"key" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stale.read_bytes() == b"junk"  # another writer's file is not touched


def test_a_path_taking_writer_gets_a_complete_file_or_none(tmp_path):
    path = tmp_path / "model.safetensors"
    atomic_save(path, lambda tmp: save_file({"w": torch.arange(4.0)}, tmp, metadata={"k": "v"}))
    assert torch.equal(load_file(str(path))["w"], torch.arange(4.0))

    def broken(tmp):
        save_file({"w": torch.zeros(4)}, tmp)
        raise Crash("killed after the write")

    with pytest.raises(Crash):
        atomic_save(path, broken)
    assert torch.equal(load_file(str(path))["w"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
