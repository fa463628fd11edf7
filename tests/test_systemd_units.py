"""deploy/systemd: the shard and worker units, checked by `systemd-analyze verify` (systemd's own parser: an
unknown key, a bad signal or restart value, a missing program are each an error here, where systemd would
only warn and go on) and by reading their command lines as systemd expands them (specifiers, ${VAR} one
word, $VAR split) through the real CLI parser: every secret reaches the process through LoadCredential=,
the stop signal and timeout leave a worker time to hand in its pushes and write its checkpoint.

systemd-analyze comes with Debian's systemd (scripts/system-deps.sh installs it); only where it cannot
exist (not Linux) is this skipped. A fraction of a second.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "deploy" / "systemd"
SHARD, WORKER = UNITS / "streamdiloco-shard@.service", UNITS / "streamdiloco-worker@.service"
INSTALLED = "/opt/streamdiloco/bin/streamdiloco"  # where the units expect the virtual environment


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if sys.platform != "linux":
            pytest.skip(f"systemd-analyze does not exist on {sys.platform}: the units are checked on Linux")
        pytest.fail("systemd-analyze is missing: bash scripts/system-deps.sh (Debian's systemd) installs it")
    return path


def unit(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> its values, in order (continuation lines joined; comments dropped)."""
    out: dict[str, list[str]] = {}
    section, text = "", re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def env_file(path: Path) -> dict[str, str]:
    pairs = (
        ln.split("=", 1) for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    )
    return {k: v for k, v in pairs}


def command_line(path: Path, instance: str, env_files: list[Path]) -> tuple[list[str], dict[str, str]]:
    """ExecStart as systemd runs it for instance `instance` (a system unit): specifiers %i, %d, %S and %%
    resolved, ${VAR} replaced as one word and a lone $VAR split on white space, with Environment= and then
    the environment files (which win); also the credentials (LoadCredential= name -> source)."""
    u = unit(path)
    name = path.name.replace("@.", f"@{instance}.")

    def specifiers(s: str) -> str:
        table = {"i": instance, "d": f"/run/credentials/{name}", "S": "/var/lib", "%": "%"}
        return re.sub(r"%(.)", lambda m: table[m.group(1)], s)

    env: dict[str, str] = {}
    for line in u.get("Service.Environment", []):
        env.update(w.split("=", 1) for w in shlex.split(specifiers(line)))
    for f in env_files:
        env.update(env_file(f))
    (exec_start,) = u["Service.ExecStart"]
    argv: list[str] = []
    for word in shlex.split(specifiers(exec_start)):
        if re.fullmatch(r"\$\w+", word):
            argv += env[word[1:]].split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    credentials = dict(specifiers(c).split(":", 1) for c in u.get("Service.LoadCredential", []))
    return argv, credentials


def test_units_pass_systemd_analyze_verify(tmp_path):
    """systemd-analyze verify on an instance of each template, with ExecStart's program present (the venv's
    streamdiloco in place of /opt/streamdiloco's): nothing on stderr."""
    tool = systemd_analyze()
    program = Path(sys.executable).with_name("streamdiloco")
    assert program.exists(), program
    instances = []
    for path, instance in ((SHARD, "0"), (WORKER, "site-1")):
        text = path.read_text()
        assert INSTALLED in text
        (tmp_path / path.name).write_text(text.replace(INSTALLED, str(program)))
        link = tmp_path / path.name.replace("@.", f"@{instance}.")
        link.symlink_to(path.name)
        instances.append(str(link))
    r = subprocess.run([tool, "verify", "--man=no", *instances], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr


def test_verify_is_not_vacuous(tmp_path):
    """What this test relies on: systemd-analyze names a bad value (and an unknown key) on stderr."""
    tool = systemd_analyze()
    program = Path(sys.executable).with_name("streamdiloco")
    text = (
        WORKER.read_text()
        .replace(INSTALLED, str(program))
        .replace("KillSignal=SIGTERM", "KillSignal=SIGTERN")
    )
    (tmp_path / "bad@.service").write_text(text + "\n[Service]\nTimeoutStopSex=5\n")
    (tmp_path / "bad@x.service").symlink_to("bad@.service")
    r = subprocess.run(
        [tool, "verify", "--man=no", str(tmp_path / "bad@x.service")], capture_output=True, text=True
    )
    assert "SIGTERN" in r.stderr and "TimeoutStopSex" in r.stderr, r.stderr


def test_shard_unit_runs_shard_i_with_its_credentials():
    from streamdiloco.cli import build_parser

    argv, credentials = command_line(SHARD, "1", [UNITS / "run.env"])
    assert argv[0] == INSTALLED
    a = build_parser().parse_args(argv[1:])
    run = env_file(UNITS / "run.env")
    assert (a.command, a.shard, a.num_shards) == ("server", 1, int(run["STREAMDILOCO_NUM_SHARDS"]))
    assert a.peers == run["STREAMDILOCO_PEERS"] and a.config == "/etc/streamdiloco/run.toml"
    assert a.checkpoint_dir == "/var/lib/streamdiloco/shard-1", "the checkpoint in the shard's StateDirectory"
    assert "streamdiloco/shard-%i" in unit(SHARD)["Service.StateDirectory"]
    creds = "/run/credentials/streamdiloco-shard@1.service"
    # the private key, the read token and the CA through LoadCredential=; workers.txt (hashes) in place
    for value in (a.tls_key, a.tls_cert, a.read_token_file, a.peers_ca):
        assert value.startswith(creds + "/") and Path(value).name in credentials, value
    assert a.workers_file == "/etc/streamdiloco/certs/workers.txt" and not a.token_file
    assert set(credentials) == {"server.pem", "server.key", "ca.pem", "read.token"}
    assert not a.insecure and a.host == "0.0.0.0"


def test_worker_unit_runs_worker_named_i_with_its_credentials():
    from streamdiloco.cli import build_parser

    argv, credentials = command_line(WORKER, "site-3", [UNITS / "run.env", UNITS / "worker.env"])
    a = build_parser().parse_args(argv[1:])
    assert (a.command, a.name) == ("worker", "site-3")
    assert a.servers == env_file(UNITS / "run.env")["STREAMDILOCO_SERVERS"]
    assert a.checkpoint == "/var/lib/streamdiloco/worker-site-3/site-3.pt" and a.auto_resume
    creds = "/run/credentials/streamdiloco-worker@site-3.service"
    assert (a.token_file, a.tls_ca) == (f"{creds}/token", f"{creds}/ca.pem")
    assert credentials == {
        "token": "/etc/streamdiloco/workers/site-3.token",
        "ca.pem": "/etc/streamdiloco/certs/ca.pem",
    }
    assert a.device == "cuda", "worker-NAME.env's own flags (STREAMDILOCO_WORKER_ARGS) reach the command"


def test_units_restart_on_failure_and_stop_cleanly():
    """Restart=on-failure (a worker that finished exits 0 and stays down); SIGTERM to the main process only
    (KillMode=mixed: the worker's StopFlag finishes the step, flushes its pushes for up to 10 s and writes
    its checkpoint; a second signal would stop it at once); a stop timeout that leaves time for that."""
    flush = re.search(r"transport\.flush\(timeout=([\d.]+)\)", (ROOT / "worker" / "run.py").read_text())
    assert flush, "worker/run.py no longer flushes its pushes on stop with a timeout"
    for path, least in ((SHARD, 30), (WORKER, float(flush.group(1)) + 60)):
        u = unit(path)
        assert u["Service.Restart"] == ["on-failure"], path.name
        assert u["Service.KillSignal"] == ["SIGTERM"] and u["Service.KillMode"] == ["mixed"], path.name
        assert float(u["Service.TimeoutStopSec"][0]) >= least, f"{path.name}: TimeoutStopSec under {least} s"
        assert u["Service.User"] == ["streamdiloco"], "not as root"
        assert u["Install.WantedBy"] == ["multi-user.target"]
