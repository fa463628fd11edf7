"""The README and the manual (docs/*.md) say what the code does: every command in them is parsed by the real
CLI, every `make` target they name exists, the README's links lead somewhere, and the library example runs
as written against a real shard process."""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from pathlib import Path

import pytest

from tests.support.procs import shard_process

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# what ends a command on a line: a pipe, a redirect, the next command
_ENDS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def _logical_lines(body: str) -> list[str]:
    """A block's shell lines: continuations joined, a quote left open joined with the next line."""
    out: list[str] = []
    pending = ""
    for line in body.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # "No closing quotation": the value goes on on the next line
            continue
        out.append(pending)
        pending = ""
    return out


def _tokens(line: str, env: dict[str, str]) -> list[str]:
    """A shell line's words, with command substitutions and unknown variables as a placeholder word."""
    line = re.sub(r"\$\(\((.*?)\)\)", "1", line)  # $((16 * 128 * 30))
    line = re.sub(r"\$\([^)]*\)", "X", line)  # $(cat run-certs/read.token), $(hostname)
    line = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), "X"), line)
    return shlex.split(line, comments=True)


def commands(text: str) -> list[tuple[list[str], bool]]:
    """Every command line a page shows, as its words from the program on (`streamdiloco`, `python -m ...`),
    and whether it is whole: shell blocks' lines and `$ `-prompted lines of any block are; inline
    `streamdiloco ...` code in the prose may leave out what a real command needs (`--servers`)."""
    lines: list[tuple[str, bool]] = []
    for lang, body in _blocks(text):
        if lang in ("bash", "sh", "shell", "console"):
            lines += [(line, True) for line in _logical_lines(body)]
        else:
            lines += [(m[2:], True) for m in body.splitlines() if m.startswith("$ ")]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines += [(m, False) for m in re.findall(r"`((?:streamdiloco|torchrun|make) [^`]*)`", prose)]
    out: list[tuple[list[str], bool]] = []
    env: dict[str, str] = {}
    for line, whole in lines:
        words = _tokens(line, env)
        if words and all(re.fullmatch(r"[A-Za-z_]\w*=.*", w, flags=re.S) for w in words):
            env.update(w.split("=", 1) for w in words)  # SECURITY="--tls-cert ... --read-token-file ..."
            continue
        for i, word in enumerate(words):
            cmd = None
            if word in ("streamdiloco", ".venv/bin/streamdiloco", "make"):
                cmd = words[i:]
            elif word == "-m" and i + 1 < len(words) and words[i + 1].startswith("streamdiloco"):
                cmd = words[i + 1 :]
            if cmd is not None:
                end = next((j for j, w in enumerate(cmd) if w in _ENDS), len(cmd))
                out.append(([w for w in cmd[:end] if w != "..."], whole))
                break
    return out


class _Parsed(Exception):
    pass


class _Refused(Exception):
    pass


def _refuse(self: argparse.ArgumentParser, message: str) -> None:
    raise _Refused(f"{self.prog}: {message}")


@functools.cache
def _cli_parser() -> argparse.ArgumentParser:
    from streamdiloco.cli import build_parser

    return build_parser()


def _parse(argv: list[str], monkeypatch) -> None:
    """argv through the parser its program builds; argparse's error is _Refused with argparse's message."""
    monkeypatch.setattr(argparse.ArgumentParser, "error", _refuse)
    program, args = argv[0], argv[1:]
    if program.endswith("streamdiloco") and program != "streamdiloco.sim.utilization":
        _cli_parser().parse_args(args)
        return
    if program == "streamdiloco.sim.utilization":  # its parser lives inside main(): stop right after parsing
        from streamdiloco.sim import utilization

        original = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, *a, **k):
            original(self, *a, **k)
            raise _Parsed

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            utilization.main(args)
        except _Parsed:
            return
        finally:
            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
        raise AssertionError(f"{program} {args}: main() did not parse")
    raise AssertionError(f"no parser for {program!r}")


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_scanner_finds_commands_across_lines_variables_and_prompts():
    text = (
        "```bash\n"
        'FLAGS="--tls-cert a.pem\n  --tls-key a.key"\n'
        "streamdiloco server --port 7070 $FLAGS \\\n    --min-workers 2   # a comment\n"
        "torchrun --nproc-per-node 2 -m streamdiloco worker --name $(hostname) ...\n"
        "streamdiloco token site-5 --out site-5.token >> workers.txt\n"
        "```\n"
        "```\n$ streamdiloco simulate --sync-every 32\nstreamdiloco: error: ...\n```\n"
        "Then `make demo`, or `streamdiloco export --out m.safetensors`.\n"
    )
    assert commands(text) == [
        (
            ["streamdiloco", "server", "--port", "7070", "--tls-cert", "a.pem", "--tls-key", "a.key"]
            + ["--min-workers", "2"],
            True,
        ),
        (["streamdiloco", "worker", "--name", "X"], True),
        (["streamdiloco", "token", "site-5", "--out", "site-5.token"], True),
        (["streamdiloco", "simulate", "--sync-every", "32"], True),
        (["make", "demo"], False),
        (["streamdiloco", "export", "--out", "m.safetensors"], False),
    ]


def test_a_flag_the_cli_does_not_have_is_caught(monkeypatch):
    with pytest.raises(_Refused, match="unrecognized arguments: --fragment-patern"):
        _parse(["streamdiloco", "server", "--fragment-patern", "strided"], monkeypatch)
    with pytest.raises(_Refused, match="invalid float value"):
        _parse(["streamdiloco.sim.utilization", "need", "--step-time", "fast"], monkeypatch)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_on_the_page_is_one_the_cli_takes(page, monkeypatch):
    found = commands(page.read_text())
    targets = _make_targets()
    bad = []
    for argv, whole in found:
        if len(argv) == 1:  # the program named in prose (`streamdiloco ...`), not a command
            continue
        if argv[0] == "make":
            bad += [f"make {t}: no such target" for t in argv[1:] if "=" not in t and t not in targets]
            continue
        try:
            _parse(argv, monkeypatch)
        except SystemExit as e:  # --help exits 0
            if e.code != 0:
                bad.append(f"{shlex.join(argv)}: exit {e.code}")
        except _Refused as e:
            if whole or "the following arguments are required" not in str(e):
                bad.append(f"{shlex.join(argv)}: {e}")
    assert not bad, "\n".join(bad)
    if page.name in ("README.md", "operations.md"):
        assert sum(whole and a[0] != "make" for a, whole in found) >= 5, (
            f"{page.name}: found too few commands"
        )


def test_the_readmes_links_lead_to_files_of_the_repository():
    text = (ROOT / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t)]
    assert "docs/operations.md" in links and "LICENSE" in links
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_the_readme_names_the_two_commands_and_stays_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text and "make test-slow" in text
    assert len(text.splitlines()) <= 200, "the README is the front door: the manual is docs/"


def test_the_library_page_shows_the_readmes_example():
    """The README's example runs below; the manual's copy must be the same code."""
    readme = [b for lang, b in _blocks((ROOT / "README.md").read_text()) if lang == "python"]
    library = [b for lang, b in _blocks((ROOT / "docs" / "library.md").read_text()) if lang == "python"]
    assert readme and readme[0] in library


def test_readme_python_example_runs(capsys, tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    # the shard the README starts "in another terminal", with the same flags
    start = re.search(r"streamdiloco server (--model nano .*?--port 7070)", text).group(1)
    flags = start.replace("--port 7070", "").split()
    with shard_process(tmp_path, *flags) as (target, _, _):
        for code in blocks:
            exec(compile(code.replace("127.0.0.1:7070", target), "README.md", "exec"), {})
    out = capsys.readouterr().out
    m = re.search(r"sent (\d+) bytes in (\d+) pushes", out)
    # 3 fragments, each every 30 of 90 steps, and the final sync of the two not sent at step 90
    assert m and int(m.group(2)) == 9 + 2
