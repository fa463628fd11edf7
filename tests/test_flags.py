"""Flags made from a process's own fields (cli/flags.py) and the worker's config they are made from
(worker/config.py): every own field of WorkerConfig is a flag of `streamdiloco worker`, with the field's
help and default, read back by `own_values`; the rules on a dataclass of any process (a required field, a
bool that defaults to True, choices, a comma-separated tuple, a flag that follows another, a type that cannot
be a flag); WorkerConfig imports neither torch nor grpc; `credits` and its old name `ledger` are one command.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from streamdiloco.cli import build_parser
from streamdiloco.flags import add_own_flags, own_fields, own_values
from streamdiloco.worker.config import WorkerConfig


def test_worker_config_imports_neither_torch_nor_grpc():
    probe = (
        "import sys; import streamdiloco.worker.config; "
        "print([m for m in ('torch', 'grpc', 'cryptography') if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def _worker_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    worker = parser._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    return {a.dest: a for a in worker._actions}


def test_every_own_field_of_worker_config_is_a_worker_flag_with_its_help_and_default():
    actions = _worker_actions()
    fields = own_fields(WorkerConfig)
    assert [f.name for f in fields] == [
        "servers",
        "name",
        "rank",
        "token",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "summary",
        "save_global",
        "checkpoint",
        "resume",
        "auto_resume",
        "metrics_port",
        "metrics_host",
        "wandb_run_name",
    ]
    for f in fields:
        action = actions[f.name]
        assert action.help == f.metadata["help"]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        if f.default is not dataclasses.MISSING:
            assert action.default == f.default, f.name
        else:  # servers (required) and name (the dataclass makes host-pid)
            assert action.default is None, f.name
    assert actions["servers"].required and not actions["name"].required
    assert actions["rank"].type is int and actions["metrics_port"].type is int
    assert actions["tls_ca"].metavar == "PEM" and actions["summary"].metavar == "PATH"
    # the sections and the config's own bookkeeping are not own flags
    assert all(s not in {f.name for f in fields} for s in ("model", "sync", "sync_set", "worker"))


def test_the_worker_flags_read_back_into_a_worker_config(tmp_path):
    argv = ["worker", "--servers", " 127.0.0.1:1, 127.0.0.1:2 ,", "--rank", "3", "--resume"]
    args = build_parser().parse_args([*argv, "--metrics-port", "0", "--checkpoint", str(tmp_path / "w.pt")])
    own = own_values(WorkerConfig, args)
    assert own["servers"] == ("127.0.0.1:1", "127.0.0.1:2")
    assert "name" not in own  # not given: WorkerConfig makes host-pid
    assert (own["rank"], own["resume"], own["auto_resume"], own["metrics_port"]) == (3, True, False, 0)
    cfg = WorkerConfig(**own)
    assert cfg.checkpoint_path == tmp_path / "w.pt" and cfg.data_rank == 3 and cfg.name


@dataclass(frozen=True)
class Toy:
    """A process's config of the kinds the generator takes."""

    where: tuple[str, ...] = field(metadata={"help": "places, comma-separated"})
    section: dict = field(default_factory=dict)  # no help: not a flag
    level: str = field(default="low", metadata={"help": "how much", "choices": ("low", "high")})
    ratio: float | None = field(default=None, metadata={"help": "a share", "metavar": "R"})
    verbose: bool = field(default=True, metadata={"help": "say more"})
    fast: bool = field(default=False, metadata={"help": "go (default %(default)s)", "flag": "--go"})


def test_any_dataclass_of_own_fields_makes_its_flags():
    p = argparse.ArgumentParser()
    followers: list[str] = []

    def after_level(group) -> None:
        followers.append("level")
        group.add_argument("--level-file", default=None)

    add_own_flags(p, Toy, then={"level": after_level})
    flags = [a.option_strings[0] for a in p._actions[1:]]
    assert flags == ["--where", "--level", "--level-file", "--ratio", "--verbose", "--go"] and followers
    args = p.parse_args(["--where", "a,b", "--no-verbose", "--go", "--ratio", "0.5"])
    assert own_values(Toy, args) == {
        "where": ("a", "b"),
        "level": "low",
        "ratio": 0.5,
        "verbose": False,
        "fast": True,
    }
    assert Toy(**own_values(Toy, args)).fast
    with pytest.raises(SystemExit):
        p.parse_args(["--where", "a", "--level", "middling"])  # choices
    with pytest.raises(SystemExit):
        p.parse_args([])  # --where: required (no default)
    assert "go (default False)" in p.format_help()  # help as written, argparse's %(default)s filled in
    only = argparse.ArgumentParser()
    add_own_flags(only, Toy, only=("ratio",))
    assert [a.dest for a in only._actions[1:]] == ["ratio"]


def test_a_field_of_another_type_cannot_be_a_flag():
    @dataclass
    class Bad:
        table: dict = field(default_factory=dict, metadata={"help": "no"})

    with pytest.raises(TypeError, match="cannot be a flag"):
        add_own_flags(argparse.ArgumentParser(), Bad)


def test_credits_is_the_command_and_ledger_its_old_name():
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert choices["credits"] is choices["ledger"]
    args = build_parser().parse_args(["ledger", "--checkpoint-dir", "d"])
    assert args.func.__name__ == "_cmd_credits" and args.checkpoint_dir == ["d"]
