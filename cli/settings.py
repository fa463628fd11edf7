"""The run's settings as flags and as a config file: each section's dataclass (declared once, in
common/config.py, or beside the code it configures: server/rounds/robust.py, server/trust/bounds.py) gives
both the command-line flags and the keys of one section of a TOML config file (`--config run.toml`).

A field `sync_every` of the section [sync] (SyncConfig) is the flag `--sync-every` (its metadata's "flag"
names another), with the field's metadata "help" and its default shown, and its "choices" listed (the
dataclass checks them, with a one-line error); a bool is `--x/--no-x`. A value comes from the command
line, else the config file, else the field's default, and `Settings.given` says which fields the user set
(on the command line or in the file): a worker takes the Streaming DiLoCo settings it did not set from the
shard (the `sync_set`). Renaming a field renames its flag and its key; nothing here lists fields by hand.
Per-process flags (a shard's index and ports, a worker's name) stay out of the file: they differ from one
process to the next.

This module parses nothing from the network; it only reads the user's own file, with one-line errors that
name the file, the section and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import shlex
import sys
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamdiloco.common.config import (
    InnerConfig,
    ModelSettings,
    PieceSettings,
    RunSettings,
    ShardSettings,
    SyncConfig,
    WorkerSettings,
)
from streamdiloco.common.keepalive import LinkSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (Python 3.10)
    import tomli as tomllib


def section_classes() -> dict[str, type]:
    """Every section of the config file and its dataclass, in the order the file lists them."""
    from streamdiloco.server.rounds.robust import RobustConfig
    from streamdiloco.server.trust.bounds import Limits

    return {
        "model": ModelSettings,
        "run": RunSettings,
        "sync": SyncConfig,
        "inner": InnerConfig,
        "server": ShardSettings,
        "robust": RobustConfig,
        "limits": Limits,
        "link": LinkSettings,
        "worker": WorkerSettings,
        "pieces": PieceSettings,
    }


_SCALARS = (bool, int, float, str)


def _kind(cls: type, f: dataclasses.Field) -> tuple[type, bool]:
    """(bool, int, float or str; whether None is allowed) of a field: the only kinds a flag or a TOML key
    can carry. A field of another type is a TypeError: such a dataclass does not fit this module."""
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if base not in _SCALARS or (args and len(args) != 2):
        raise TypeError(f"{cls.__name__}.{f.name}: a {hint} field cannot be a flag")
    return base, optional


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: it cannot be a setting")


def flag_of(f: dataclasses.Field) -> str:
    """The field's flag: its metadata's "flag", else --the-name-with-dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


GIVEN = "flags_given"  # the namespace's set of the settings' dests given on the command line


class _Store(argparse.Action):
    """Stores the value, and notes that the user gave this flag (its default is already in the namespace,
    so that a parse without resolve() still has every setting)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _note(namespace, self.dest)


class _StoreBool(argparse.BooleanOptionalAction):
    """--x/--no-x, noting that the user gave one of them."""

    def __init__(self, *args: Any, help: str | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.help = help  # as written: some Pythons append their own "(default: ...)"

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note(namespace, self.dest)


def _note(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, GIVEN, None)
    if given is None:
        given = set()
        setattr(namespace, GIVEN, given)
    given.add(dest)


def add_flags(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: tuple[str, ...] = (),
    help_for: dict[str, str] | None = None,
) -> None:
    """One flag per field of the dataclass `cls` (but `skip`), with the field's name as dest, its default,
    its help (or `help_for`'s, with the default shown) and its choices listed as the flag's metavar
    (checked by the dataclass, whose error is one line, not argparse's usage). The flags the user gives are
    noted (args.flags_given): `resolve` then knows which values came from the command line."""
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        kind, _ = _kind(cls, f)
        default = _default(f)
        text = (help_for or {}).get(f.name) or f.metadata.get("help", "")
        if "default" not in text:
            shown = "on" if default is True else "off" if default is False else default
            text += f" (default {shown})"
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text.replace("%", "%%")}
        if kind is bool:
            kw["action"] = _StoreBool
        else:
            choices = f.metadata.get("choices")
            metavar = "{" + ",".join(choices) + "}" if choices else f.metadata.get("metavar")
            kw.update(action=_Store, type=kind, metavar=metavar)
        group.add_argument(flag_of(f), **kw)


@dataclass
class Settings:
    """Every field of the chosen sections, resolved: values[section][field], and given[section], the fields
    the user set (the command line or the config file)."""

    values: dict[str, dict[str, Any]]
    given: dict[str, frozenset[str]]

    def build(self, section: str) -> Any:
        """The section's dataclass (its own checks raise a one-line ValueError)."""
        return section_classes()[section](**self.values[section])

    def to_toml(self, comments: bool = False) -> str:
        return dump_toml(self.values, comments)


def read_config(path: str | Path) -> dict[str, dict[str, Any]]:
    """The file's sections, every key checked against its dataclass's fields and types (ints are taken
    where floats are asked for). ValueError in one line naming the file, the section and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    classes = section_classes()
    out: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            home = _home(classes, section)
            where = f"put it under [{home}]" if home else f"the sections are {', '.join(classes)}"
            raise ValueError(f"{path}: {section} = ... is in no section: {where}")
        if section not in classes:
            hint = _close(section, classes)
            raise ValueError(
                f"{path}: unknown section [{section}]{hint}; the sections are {', '.join(classes)}"
            )
        cls = classes[section]
        known = {f.name: f for f in dataclasses.fields(cls) if f.init}
        out[section] = {}
        for key, value in table.items():
            if key not in known:
                home = _home(classes, key)
                where = f" (it belongs under [{home}])" if home else _close(key, known)
                raise ValueError(f"{path}: [{section}] has no key {key!r}{where}")
            out[section][key] = _check_value(path, section, key, value, *_kind(cls, known[key]))
    return out


def _home(classes: dict[str, type], key: str) -> str | None:
    """The section whose dataclass has a field named `key`, if one has."""
    return next((s for s, c in classes.items() if key in {f.name for f in dataclasses.fields(c)}), None)


def _close(name: str, choices) -> str:
    near = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_value(path: Path, section: str, key: str, value: Any, kind: type, optional: bool) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    shown = json.dumps(value, default=str)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    unset = " (leave it out for the default)" if optional else ""
    raise ValueError(f"{path}: [{section}] {key} must be {_NAMES[kind]}{unset}, got {shown}")


def resolve(args: argparse.Namespace, sections: tuple[str, ...], config: str | None = None) -> Settings:
    """Each field of `sections`: the command line's value, else the config file's, else its default. The
    values are also set on `args` (so a command reads args.sync_every as before), and args.sync_set holds
    the [sync] fields the user set."""
    from_file = read_config(config) if config else {}
    on_command_line = getattr(args, GIVEN, None) or set()
    classes = section_classes()
    values: dict[str, dict[str, Any]] = {}
    given: dict[str, frozenset[str]] = {}
    for section in sections:
        cls = classes[section]
        values[section], set_here = {}, set()
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in on_command_line:
                value = getattr(args, f.name)
                set_here.add(f.name)
            elif f.name in from_file.get(section, {}):
                value = from_file[section][f.name]
                set_here.add(f.name)
            else:
                # the parser's default: the field's, unless a script's set_defaults() changed it
                value = getattr(args, f.name) if hasattr(args, f.name) else _default(f)
            values[section][f.name] = value
            setattr(args, f.name, value)
        given[section] = frozenset(set_here)
    args.sync_set = given.get("sync", frozenset())
    return Settings(values, given)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (same escapes)
    raise TypeError(f"{type(value).__name__} is not a setting's value")


def dump_toml(values: dict[str, dict[str, Any]], comments: bool = False) -> str:
    """TOML for resolved settings (read_config reads it back to the same values). A None (no value: the
    field's own default) is left out, or written as a commented-out key with `comments`, which also puts
    each field's help above it."""
    classes = section_classes()
    lines: list[str] = []
    for section, table in values.items():
        cls = classes[section]
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            if f.name not in table:
                continue
            value = table[f.name]
            if comments and f.metadata.get("help"):
                lines += [f"# {line}" for line in textwrap.wrap(f.metadata["help"], 100)]
                if f.metadata.get("choices"):
                    lines.append(f"# one of: {', '.join(f.metadata['choices'])}")
            if value is None:
                if comments:
                    lines.append(f"# {f.name} =")
                continue
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


# The head of every file `streamdiloco config` writes: how to use it, and how to make it again
CONFIG_HEADER = """\
# A run's settings: `streamdiloco server|worker|launch|simulate --config FILE` reads the sections it needs.
# A flag given on the command line overrides the file; a key left out takes its default.
# Made with `{made_with}`.

"""


def config_file(settings: Settings) -> str:
    """What `streamdiloco config` writes: every setting with its help as a comment, under a header that
    names the flags that make the file again. ValueError (one line) for settings that would not start a
    run."""
    for section in settings.values:
        settings.build(section)
    made_with = shlex.join(["streamdiloco", "config", *given_flags(settings)])
    return CONFIG_HEADER.format(made_with=made_with) + settings.to_toml(comments=True)


def given_flags(settings: Settings) -> list[str]:
    """The flags that give `settings`' user-set values (command line or file), in the file's order: what
    `streamdiloco config` writes in its header so that the file can be made again."""
    classes = section_classes()
    argv: list[str] = []
    for section, table in settings.values.items():
        for f in dataclasses.fields(classes[section]):
            if f.name not in settings.given.get(section, ()):
                continue
            value, flag = table[f.name], flag_of(f)
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif value is not None:
                argv += [flag, str(value)]
    return argv
