"""docker/Dockerfile, built and run for real (slow: `make test-slow`), for each variant (VARIANT=cpu and
VARIANT=cuda): the entrypoint is the `streamdiloco` CLI, the image has the variant's PyTorch, and a shard
and a worker started from it in a Docker network train a short run to the end. Skipped where no Docker
engine answers (`docker info`).

Machines that reach no registry build from a local base image and a folder of wheels served over HTTP:
STREAMDILOCO_DOCKER_BUILD_ARGS="BASE=local/bookworm-python:3.11 PIP_FIND_LINKS=http://172.17.0.1:8765/
PIP_NO_INDEX=1", and STREAMDILOCO_DOCKER_BUILD_ARGS_CPU / _CUDA for one variant's own (its wheel folder;
docker/README.md, "Checked on a machine with no registry access", says how). The
classic builder is used (DOCKER_BUILDKIT=0) unless DOCKER_BUILDKIT says otherwise: BuildKit fetches the
Dockerfile's syntax image from Docker Hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a build installs gigabytes (the CUDA variant)

ROOT = Path(__file__).resolve().parents[1]
BUILD_ARGS = os.environ.get("STREAMDILOCO_DOCKER_BUILD_ARGS", "").split()  # and _CPU, _CUDA: one variant's
ENV = {**os.environ, "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0")}


def docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    exe = shutil.which("docker")
    if exe is None:
        pytest.skip("no docker command (Debian: apt-get install docker.io)")
    r = subprocess.run([exe, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"docker {' '.join(args)}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def engine() -> str:
    r = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"no Docker engine answers here: {r.stderr.strip()[:300]}")
    return r.stdout.strip()


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_image_builds_and_trains(engine, variant):
    tag = f"streamdiloco-test:{variant}"
    own = os.environ.get(f"STREAMDILOCO_DOCKER_BUILD_ARGS_{variant.upper()}", "").split()
    build_args = [x for a in [f"VARIANT={variant}", *BUILD_ARGS, *own] for x in ("--build-arg", a)]
    docker("build", "-f", "docker/Dockerfile", "-t", tag, *build_args, ".", timeout=3600)
    assert docker("run", "--rm", tag, "--version").stdout.startswith("streamdiloco ")
    probe = "import os, torch; print(os.environ['STREAMDILOCO_VARIANT'], torch.version.cuda or 'none')"
    seen_variant, cuda = docker("run", "--rm", "--entrypoint", "python", tag, "-c", probe).stdout.split()
    assert seen_variant == variant
    assert (cuda != "none") == (variant == "cuda"), f"the {variant} image has torch for CUDA {cuda}"
    assert docker("run", "--rm", "--entrypoint", "id", tag, "-u").stdout.strip() == "10001", "runs as root"

    net = f"streamdiloco-test-{uuid.uuid4().hex[:8]}"
    docker("network", "create", net)
    try:
        run = ["--model", "nano", "--sync-every", "6", "--num-fragments", "2"]
        docker(
            "run", "-d", "--name", f"{net}-shard", "--network", net, "--network-alias", "shard", tag,
            "server", "--host", "0.0.0.0", "--insecure", "--min-workers", "1", "--checkpoint-dir",
            "/checkpoints", *run,
        )  # fmt: skip
        worker = docker(
            "run", "--rm", "--network", net, tag,
            "worker", "--servers", "shard:7070", "--name", "w1", "--steps", "20", "--insecure", *run,
            timeout=600, check=False,
        )  # fmt: skip
        shard_log = docker("logs", f"{net}-shard", check=False)
        assert worker.returncode == 0, (worker.stdout + worker.stderr)[-3000:] + (shard_log.stderr)[-2000:]
        assert "w1 mirror fragment 1" in worker.stdout + worker.stderr
        health = docker("inspect", "--format", "{{.State.Health.Status}}", f"{net}-shard").stdout.strip()
        assert health in ("healthy", "starting"), health
    finally:
        docker("rm", "-f", f"{net}-shard", check=False)
        docker("network", "rm", net, check=False)
