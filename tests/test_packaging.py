"""The distribution: folders at the top level import as streamdiloco.*, installed normally or editable."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_top_level_folders_into_the_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("streamdiloco-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "cli.py",
        "common/codecs.py",
        "common/schedule.py",
        "server/shard.py",
        "server/service.py",
        "server/main.py",
        "worker/engine.py",
        "worker/client.py",
        "worker/model.py",
        "sim/simulator.py",
        "launch.py",
        "common/wire.py",
        "protos/streamdiloco_pb2.py",
        "protos/streamdiloco_pb2_grpc.py",
    ):
        assert f"streamdiloco/{module}" in names
    assert not any(n.startswith(("common/", "tests/")) for n in names)
    # a plain (non-editable) install, imported from elsewhere, with the repo nowhere on the path
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    code = (
        "import streamdiloco.common.codecs as c, streamdiloco.sim.simulator, streamdiloco.cli;"
        "import streamdiloco.server.main, streamdiloco.worker.run, streamdiloco.launch;"
        "print(c.__file__)"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(target))


def test_editable_install_imports_from_any_directory(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import streamdiloco.common.codecs as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == ROOT / "common" / "codecs.py"


def test_console_command_exists():
    exe = Path(sys.executable).parent / "streamdiloco"
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("streamdiloco ")


def test_generated_protocol_code_is_up_to_date():
    """protos/*_pb2*.py must be what protos/generate.py makes from the .proto (run `make protos`)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_grpcio_tools_is_pinned_to_grpcios_version():
    """protoc's output must match the runtime: grpcio-tools and grpcio move together."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"(grpcio|grpcio-tools)==([^"]+)"', text))
    assert set(pins) == {"grpcio", "grpcio-tools"} and pins["grpcio"] == pins["grpcio-tools"], pins
