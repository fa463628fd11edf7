"""deploy/helm/streamdiloco, checked offline for every values file: rendered as `helm template` renders it
(support/helm_render.py: Go templates and the Sprig functions the chart uses), every object validated against
the Kubernetes API's schemas (kubernetes-validate, strict: an unknown field fails) for the oldest and the
newest Kubernetes the chart is checked for, every command line through the real CLI parser, and what ties
the objects together (the shards' names in --servers, --peers and the certificate, the Secrets mounted
where the flags read them, the probes on ports that exist, the Services' selectors on the pods).

No cluster and no helm binary needed; about a second.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.helm_render import TemplateError, go_str, render_chart

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "streamdiloco"
VALUES = {"default": [], "cpu-demo": [CHART / "values-cpu-demo.yaml"], "gpu": [CHART / "values-gpu.yaml"]}
KUBERNETES = ["1.25.0", kubernetes_validate.latest_version()]  # the chart's kubeVersion floor, the newest
RUN_FLAGS = ("--model", "--seed", "--sync-every", "--num-fragments")
CRDS = {"monitoring.coreos.com/v1", "cert-manager.io/v1"}  # not in the Kubernetes schemas: checked below


def render(name: str, **kw) -> dict[str, list[dict]]:
    out, _ = render_chart(CHART, VALUES[name], api_versions=tuple(CRDS), **kw)
    return out


def objects(rendered: dict[str, list[dict]]) -> list[dict]:
    return [o for docs in rendered.values() for o in docs]


def one(objs: list[dict], kind: str, suffix: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {len(found)}"
    return found[0]


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def shard_argv(sts: dict, pod: str) -> list[str]:
    """What the shard's shell entrypoint hands `streamdiloco` in pod `pod`: run by sh, as the pod does."""
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["/bin/sh", "-c"]
    printer = 'streamdiloco() { for a in "$@"; do printf "%s\\0" "$a"; done; }; '
    script = printer + c["command"][2].replace("exec ", "", 1)
    r = subprocess.run(
        ["/bin/sh", "-c", script, *c["command"][3:], *c["args"]],
        env={"POD_NAME": pod, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\0")[:-1]


def worker_argv(sts: dict, pod: str) -> list[str]:
    """The worker's arguments as the kubelet expands them: $(POD_NAME) from the env var of that name."""
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in c, "the image's entrypoint (streamdiloco) runs the worker"
    assert any(
        e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        for e in c["env"]
    )
    return [a.replace("$(POD_NAME)", pod) for a in c["args"]]


@pytest.fixture(scope="module", params=list(VALUES))
def chart(request) -> tuple[str, list[dict]]:
    return request.param, objects(render(request.param))


def test_every_object_passes_the_kubernetes_schemas(chart):
    name, objs = chart
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Service"} <= kinds
    for o in objs:
        if o["apiVersion"] in CRDS:
            continue
        for version in KUBERNETES:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {o['kind']} {o['metadata']['name']} (Kubernetes {version}): {e}")


def test_the_schema_check_is_not_vacuous():
    sts = one(objects(render("default")), "StatefulSet", "-shard")
    sts["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES[0], strict=True)
    sts["spec"]["replicas"] = 2
    sts["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # a typo: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES[0], strict=True)


def test_shards_and_workers_form_one_run(chart):
    """--shard from the pod's ordinal, --num-shards the replicas, every shard in --peers and the workers'
    --servers under its stable name, the same run flags everywhere, every command line taken by the CLI."""
    from streamdiloco.cli import build_parser

    name, objs = chart
    parser = build_parser()
    shards, workers = one(objs, "StatefulSet", "-shard"), one(objs, "StatefulSet", "-worker")
    service = one(objs, "Service", "-shards")
    n = shards["spec"]["replicas"]
    assert shards["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    prefix = shards["metadata"]["name"].removesuffix("-shard")
    hosts = [f"{prefix}-shard-{i}.{service['metadata']['name']}" for i in range(n)]
    run_flags = None
    for i in range(n):
        argv = shard_argv(shards, f"{prefix}-shard-{i}")
        args = parser.parse_args(argv)
        assert (args.command, args.shard, args.num_shards) == ("server", i, n)
        assert args.peers.split(",") == [f"https://{h}:{args.http_port}" for h in hosts]
        assert args.host == "0.0.0.0" and args.checkpoint_dir == "/checkpoints" and not args.insecure
        flags = {f: flag(argv, f) for f in RUN_FLAGS}
        assert run_flags in (None, flags)
        run_flags = flags
    grpc = flag(shard_argv(shards, f"{prefix}-shard-0"), "--port")
    for i in range(workers["spec"]["replicas"]):
        pod = f"{prefix}-worker-{i}"
        argv = worker_argv(workers, pod)
        args = parser.parse_args(argv)
        assert args.command == "worker" and args.name == pod and args.checkpoint == f"/checkpoints/{pod}.pt"
        assert args.auto_resume and args.tls_ca == "/certs/ca.crt"
        assert args.servers.split(",") == [f"{h}:{grpc}" for h in hosts]
        assert {f: flag(argv, f) for f in RUN_FLAGS} == run_flags, f"{name}: workers' run flags differ"
    assert workers["spec"]["serviceName"] == one(objs, "Service", "-workers")["metadata"]["name"]


def mounts(sts: dict) -> dict[str, tuple[str, set[str]]]:
    """mount path -> (the Secret's name, the file names there) for every Secret volume of the pod"""
    spec = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for m in spec["containers"][0]["volumeMounts"]:
        v = volumes.get(m["name"])
        if v is None:
            claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
            assert m["name"] in claims, f"{m['name']} is neither a volume nor a claim"
            continue
        if "secret" in v:
            assert m.get("readOnly")
            files = {i["path"] for i in v["secret"].get("items", [])} or {"*"}
            out[m["mountPath"]] = (v["secret"]["secretName"], files)
    return out


def read_from_secret(sts: dict, path: str) -> str:
    for where, (secret, files) in mounts(sts).items():
        if path.startswith(where + "/") and ("*" in files or path[len(where) + 1 :] in files):
            return secret
    pytest.fail(f"{sts['metadata']['name']} reads {path}, which no Secret volume holds")


def test_credentials_come_from_secrets(chart):
    """Every file a flag names is in a mounted Secret; a worker mounts the CA, never the shards' key."""
    name, objs = chart
    shards, workers = one(objs, "StatefulSet", "-shard"), one(objs, "StatefulSet", "-worker")
    prefix = shards["metadata"]["name"].removesuffix("-shard")
    argv = shard_argv(shards, f"{prefix}-shard-0")
    tls = read_from_secret(shards, flag(argv, "--tls-cert"))
    assert (
        read_from_secret(shards, flag(argv, "--tls-key"))
        == tls
        == read_from_secret(shards, flag(argv, "--peers-ca"))
    )
    read_from_secret(shards, flag(argv, "--read-token-file"))
    per_worker = "--workers-file" in argv
    read_from_secret(shards, flag(argv, "--workers-file" if per_worker else "--token-file"))
    wargv = worker_argv(workers, f"{prefix}-worker-1")
    assert read_from_secret(workers, flag(wargv, "--tls-ca")) == tls
    token = read_from_secret(workers, flag(wargv, "--token-file"))
    if per_worker:
        assert flag(wargv, "--token-file").endswith(f"/{prefix}-worker-1.token"), (
            "a worker reads its own token"
        )
    else:
        assert token == read_from_secret(shards, flag(argv, "--token-file")), "the run token: one Secret"
    assert all(files == {"ca.crt"} for s, files in mounts(workers).values() if s == tls)
    assert not [o for o in objs if o["kind"] == "Secret"], "the chart makes no Secret from a value"
    for sts in (shards, workers):
        pod = sts["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001


def test_probes_volumes_and_resources(chart):
    name, objs = chart
    shards, workers = one(objs, "StatefulSet", "-shard"), one(objs, "StatefulSet", "-worker")
    c = shards["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    http = int(flag(shard_argv(shards, "x-shard-0"), "--http-port"))
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ):
        get = c[probe]["httpGet"]
        # the shard serves HTTPS (--tls-cert): the kubelet speaks TLS to it without checking the certificate
        assert (get["path"], ports[get["port"]], get["scheme"]) == (path, http, "HTTPS"), probe
    w = workers["spec"]["template"]["spec"]["containers"][0]
    wports = {p["name"]: p["containerPort"] for p in w["ports"]}
    assert wports[w["livenessProbe"]["httpGet"]["port"]] == int(
        flag(worker_argv(workers, "p"), "--metrics-port")
    )
    for sts in (shards, workers):
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        mount = next(
            m
            for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            if m["name"] == claim["metadata"]["name"]
        )
        assert mount["mountPath"] == "/checkpoints", "each pod's checkpoint on its own volume"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in (o for o in objs if o["kind"] == "Service"):
        sts = shards if svc["metadata"]["name"].endswith("-shards") else workers
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        container_ports = {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    limits = w["resources"].get("limits", {})
    if name == "gpu":
        assert limits.get("nvidia.com/gpu") == 1 and flag(worker_argv(workers, "p"), "--device") == "cuda"
        assert workers["spec"]["template"]["spec"]["tolerations"]
    else:
        assert "nvidia.com/gpu" not in limits and flag(worker_argv(workers, "p"), "--device") == "cpu"


def test_certificate_and_monitoring_when_enabled():
    """values-gpu.yaml turns on cert-manager, the ServiceMonitors and the dashboard: the certificate names
    every shard the workers dial, Prometheus scrapes the shards' HTTPS with the read token and the CA,
    and the dashboard is the compose stack's, with its datasource a variable."""
    objs = objects(render("gpu"))
    shards, workers = one(objs, "StatefulSet", "-shard"), one(objs, "StatefulSet", "-worker")
    cert = one(objs, "Certificate", "-shards")
    assert cert["spec"]["secretName"] == read_from_secret(shards, "/certs/tls.crt")
    assert cert["spec"]["issuerRef"]["name"]
    servers = flag(worker_argv(workers, "p"), "--servers").split(",")
    assert {s.rsplit(":", 1)[0] for s in servers} <= set(cert["spec"]["dnsNames"])
    sm = one(objs, "ServiceMonitor", "-shards")
    (ep,) = sm["spec"]["endpoints"]
    assert ep["scheme"] == "https" and ep["port"] == "https"
    assert ep["bearerTokenSecret"]["name"] == read_from_secret(shards, "/read-token/token")
    assert ep["tlsConfig"]["serverName"] in cert["spec"]["dnsNames"]
    assert ep["tlsConfig"]["ca"]["secret"] == {"name": cert["spec"]["secretName"], "key": "ca.crt"}
    (wep,) = one(objs, "ServiceMonitor", "-workers")["spec"]["endpoints"]
    assert wep["port"] == "metrics"
    cm = one(objs, "ConfigMap", "-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["streamdiloco.json"])
    docker = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "streamdiloco.json").read_text())
    assert dashboard == docker, "the chart's dashboard copy differs from docker/grafana/dashboards/"
    assert any(
        v["name"] == "datasource" and v["type"] == "datasource" for v in dashboard["templating"]["list"]
    )


def test_defaults_leave_the_optional_parts_out():
    kinds = {o["kind"] for o in objects(render("default"))}
    assert kinds == {"StatefulSet", "Service"}


def test_bad_values_are_refused_with_the_fix():
    with pytest.raises(TemplateError, match="auth.mode is both: give runToken or perWorker"):
        render("default", extra_values={"auth": {"mode": "both"}})
    with pytest.raises(TemplateError, match="workers.gpus > 0 needs workers.device: cuda"):
        render("default", extra_values={"workers": {"gpus": 1}})
    with pytest.raises(TemplateError, match="issuerRef.name"):
        render("default", extra_values={"tls": {"certManager": {"enabled": True}}})


def test_notes_name_the_certificate_and_the_stop():
    _, notes = render_chart(CHART, [], release="demo", namespace="ml")
    assert "--server-names demo-shard-0.demo-shards,demo-shard-0.demo-shards.ml.svc," in notes
    assert "scale statefulset demo-worker --replicas 0" in notes


def test_the_renderer_keeps_go_semantics():
    """What a chart could depend on, as Go's text/template and Helm do it (so that the chart renders the
    same under helm): values' numbers are float64 (1e+06 printed raw), `eq` of a float and an int is an
    error, a field of nil is an error, an unknown function is an error, `{{-`/`-}}` trim."""
    from tests.support.helm_render import Renderer

    def run(src: str, values: dict | None = None) -> str:
        from tests.support.helm_render import floats

        return Renderer({"t": src}).render("t", {"Values": floats(values or {})})

    assert go_str(1e6) == "1e+06" and run("{{ .Values.n }}", {"n": 1000000}) == "1e+06"
    assert run("{{ int .Values.n }}", {"n": 1000000}) == "1000000"
    with pytest.raises(TemplateError, match="incompatible types"):
        run("{{ eq .Values.n 2 }}", {"n": 2})
    with pytest.raises(TemplateError, match="nil pointer"):
        run("{{ .Values.a.b }}")
    with pytest.raises(TemplateError, match='function "nope" not defined'):
        run("{{ nope 1 }}")
    assert run("a  {{- 1 -}}  b\n{{ if false }}x{{ else if true }}y{{ end }}") == "a1b\ny"
    assert run("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}") == "2"
    assert run("{{ range $i, $v := list 5 6 }}{{ $i }}={{ $v }} {{ end }}") == "0=5 1=6 "
    assert run('{{ and 0 "x" }} {{ or 0 "x" }} {{ .Values.missing }}.') == "0 x ."
