"""Flags made from dataclasses, for the commands' parsers: the run's settings sections (`add_settings`: one
group of flags per section, cli/settings.py), and a process's own fields (`add_own_flags`, `own_values`).

A process's config (worker/config.py's `WorkerConfig`) is composed of the run's sections and of fields of
its own, which differ from one process to the next and stay out of the config file (a worker's name, its
TLS files). Such a field is a flag when its metadata has a "help": `--the-name-with-dashes` (or the
metadata's "flag"), with that help as written (argparse's `%(default)s` may appear in it), the field's
default, and the metadata's "metavar" and "choices"; an int, float or str field (or one that may be None)
takes that type, a bool is `--x` (`--x/--no-x` when it defaults to True), a `tuple[str, ...]` is one
comma-separated value, and a field without a default is a required flag. A field whose default comes from a
factory (a worker's name, host-pid) has the flag default None: not given, the dataclass makes it.
`own_values` reads the fields back from the parsed flags, as keywords for the dataclass.

Nothing here lists fields by hand: a field added to the dataclass with a "help" is a flag. This module
imports neither torch nor the code that runs a command (`--help` stays light: tests/test_help.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

# Each section of the config file (cli/settings.py) as a group of flags in --help
SECTION_TITLES = {
    "model": "model (the same on shards and workers)",
    "run": "run",
    "sync": "Streaming DiLoCo (shards and workers must agree)",
    "inner": "inner optimizer (AdamW)",
    "server": "rounds (every shard of a run alike)",
    "robust": "defenses against workers' pushes (on by default)",
    "limits": "limits: what clients may make the shard hold",
    "link": "liveness and flow control (each end's own: shards and workers)",
    "worker": "worker (every worker of a run alike)",
    "pieces": "run-wide data assignment (shard 0's ledger of pieces)",
}

Group = argparse.ArgumentParser | argparse._ArgumentGroup


def add_settings(
    p: argparse.ArgumentParser,
    sections: tuple[str, ...],
    titles: dict[str, str] | None = None,
    help_for: dict[str, str] | None = None,
) -> None:
    """--config and one group of flags per section (each field of its dataclass, cli/settings.py); main()
    resolves them (command line > config file > default) before the command runs."""
    from streamdiloco.settings import add_flags, section_classes

    p.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="read the run's settings from this file (sections "
        + ", ".join(f"[{s}]" for s in sections)
        + "; `streamdiloco config` writes one); flags given here override it",
    )
    classes = section_classes()
    for section in sections:
        title = (titles or {}).get(section) or SECTION_TITLES[section]
        add_flags(p.add_argument_group(f"{title} [{section}]"), classes[section], help_for=help_for)
    p.set_defaults(sections=sections)


def own_fields(cls: type, only: tuple[str, ...] | None = None) -> list[dataclasses.Field]:
    """The fields of the dataclass `cls` that are flags (their metadata has a "help"), in its order; with
    `only`, those of them named there."""
    return [
        f
        for f in dataclasses.fields(cls)
        if f.init and "help" in f.metadata and (only is None or f.name in only)
    ]


def _flag_type(cls: type, f: dataclasses.Field) -> type:
    """int, float, str or bool (a tuple[str, ...] is a str: comma-separated); a TypeError for a field of
    another type, which cannot be a flag."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple and args[:1] == [str]:
        return str
    base = args[0] if len(args) == 1 else hint
    if base not in (bool, int, float, str):
        raise TypeError(f"{cls.__name__}.{f.name}: a {hint} field cannot be a flag")
    return base


def add_own_flags(
    group: Group,
    cls: type,
    only: tuple[str, ...] | None = None,
    then: Mapping[str, Callable[[Group], None]] | None = None,
) -> None:
    """One flag per own field of the dataclass `cls` (see the module's docstring), or of those named in
    `only`, in the dataclass's order. `then[name](group)` adds the command's flags that follow the field's
    flag in --help (a flag that feeds the field but is not one, such as --token-file after --token)."""
    for f in own_fields(cls, only):
        kind = _flag_type(cls, f)
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = None if f.default is dataclasses.MISSING else f.default
        if kind is bool:
            kw["action"] = "store_true" if kw.get("default") is False else argparse.BooleanOptionalAction
        else:
            if kind is not str:
                kw["type"] = kind
            for key in ("metavar", "choices"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
        group.add_argument(f.metadata.get("flag") or "--" + f.name.replace("_", "-"), **kw)
        if then and f.name in then:
            then[f.name](group)


def own_values(cls: type, args: argparse.Namespace, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The own fields of `cls` from the parsed flags, as keywords for the dataclass: a tuple field split at
    the commas; a field with a default factory left out when its flag was not given (None)."""
    out: dict[str, Any] = {}
    for f in own_fields(cls, only):
        value = getattr(args, f.name)
        if value is None and f.default_factory is not dataclasses.MISSING:
            continue
        if isinstance(value, str) and typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple:
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        out[f.name] = value
    return out


def add_token_file_flag(group: Group) -> None:
    """--token-file: a worker's token (the worker's, and export's as a worker), read from a file."""
    group.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (workers/NAME.token): not on the command line, where ps shows it",
    )
