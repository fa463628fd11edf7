"""The distribution: folders at the top level import as streamdiloco.*, installed normally or editable; it
asks for version ranges (it installs beside a user's torch) while `make` installs the exact, tested versions
of constraints.txt."""

import email
import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from the repository, as a user's pip would."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    return next(out.glob("streamdiloco-*.whl"))


def test_wheel_maps_top_level_folders_into_the_package(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "cli.py",
        "common/codecs.py",
        "common/schedule.py",
        "server/rounds/state.py",
        "server/edge/service.py",
        "server/main.py",
        "worker/engine.py",
        "worker/link.py",
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
    pins = constraints()
    assert pins["grpcio"] == pins["grpcio-tools"], pins


def constraints() -> dict[str, str]:
    """constraints.txt as {normalized name: exact version}; every line must be `name==version`."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([0-9][0-9A-Za-z.+!-]*)", line)
            assert m, f"constraints.txt: {line!r} is not name==version"
            name = canonicalize_name(m.group(1))
            assert name not in pins, f"constraints.txt pins {name} twice"
            pins[name] = m.group(2)
    return pins


def wheel_requirements(wheel: Path, extra: str = "") -> dict[str, Requirement]:
    """Requires-Dist of the wheel's METADATA, what pip asks of a user's environment: the run-time ones, or
    with `extra` those that the extra adds."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.message_from_bytes(z.read(meta))
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist")]
    if extra:
        assert extra in msg.get_all("Provides-Extra"), f"the wheel has no extra {extra!r}"

    def wanted(r: Requirement, x: str) -> bool:
        return r.marker is None or r.marker.evaluate({"extra": x})

    return {canonicalize_name(r.name): r for r in reqs if wanted(r, extra) and not (extra and wanted(r, ""))}


def test_the_wheel_asks_for_ranges_and_constraints_pin_a_version_inside_each(wheel):
    runtime, dev = wheel_requirements(wheel), wheel_requirements(wheel, "dev")
    assert {"torch", "grpcio", "protobuf", "numba"} <= set(runtime) and {"pytest", "mypy"} <= set(dev)
    with zipfile.ZipFile(wheel) as z:  # every extra's too
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith("/METADATA"))))
    every = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    for r in every:
        ops = {s.operator for s in r.specifier}
        assert not ops & {"==", "==="}, f"{r}: an exact pin in the wheel replaces a user's {r.name}"
        assert ">=" in ops, f"{r}: no lower bound"
    torch = runtime["torch"].specifier
    assert torch.contains("2.13.0") and torch.contains("2.12.0") and not torch.contains("3.0.0"), torch
    # the generated code's own floors (protos/*_pb2*.py refuse older runtimes)
    assert not runtime["grpcio"].specifier.contains("1.85.0")
    assert not runtime["protobuf"].specifier.contains("7.35.0")
    pins = constraints()
    for r in every:
        name = canonicalize_name(r.name)
        assert name in pins, f"constraints.txt does not pin {name}: `make` would install whatever is newest"
        assert r.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {r}"
    build = {
        "setuptools",
        "uv",
    }  # pyproject.toml's build-system (--build-constraint); the Makefile's installer
    named = {canonicalize_name(r.name) for r in every} | build
    assert set(pins) == named, f"constraints.txt pins what nothing requires: {sorted(set(pins) - named)}"


def test_make_installs_the_exact_versions_of_constraints(wheel):
    """The environment the tests run in is the one `make` built: every run-time and dev package at its pin."""
    stamp = re.search(r"^\$\(STAMP\): (.*)\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert stamp and "constraints.txt" in stamp.group(1).split(), (
        "the venv is not rebuilt when constraints change"
    )
    assert re.search(r"pip install .*-c constraints\.txt .*-e '\.\[dev\]'", stamp.group(2)), stamp.group(2)
    pins = constraints()
    for name in {**wheel_requirements(wheel), **wheel_requirements(wheel, "dev")}:
        installed = importlib.metadata.version(name)
        # 2.13.0+cpu is torch 2.13.0 from the CPU index: == ignores the local label
        assert Requirement(f"{name}=={pins[name]}").specifier.contains(installed), (
            f"{name} {installed}, not {pins[name]}"
        )


def _fake_torch_wheel(out: Path, version: str) -> Path:
    """A wheel of a distribution named torch at `version`: a stand-in for a user's torch (a real other torch
    here is half a gigabyte plus CUDA packages)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f'__version__ = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_the_wheel_installs_beside_another_torch_and_leaves_it_in_place(wheel, tmp_path):
    """A user's environment: a venv with torch 2.12.0 of its own, and the rest of our dependencies (this
    environment's, seen through a .pth file: outside the venv, so pip never touches them). pip resolves the
    wheel's requirements offline, from a folder with the wheel and a torch 2.13.0 stand-in: it must install
    streamdiloco alone and keep 2.12.0. With constraints.txt's exact pins it must refuse, as the old
    `torch==2.13.0` requirement did (or replace the user's torch, given the index)."""
    venv = tmp_path / "user-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # the rest of the stack: this environment's packages less torch and streamdiloco (and .pth hooks)
    stack = tmp_path / "stack"
    stack.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    skip = re.compile(r"^(torch|functorch|torchgen|streamdiloco|__editable__)|\.pth$", re.I)
    for entry in ours.iterdir():
        if not skip.search(entry.name):
            (stack / entry.name).symlink_to(entry)
    (site / "the-stack.pth").write_text(f"{stack}\n")
    links = tmp_path / "links"
    _fake_torch_wheel(tmp_path / "user", "2.12.0")
    _fake_torch_wheel(links, "2.13.0")  # what pip would take, were it to replace the user's torch
    (links / wheel.name).symlink_to(wheel)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def pip(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(py), "-m", "pip", "install", "--no-index", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    r = pip("--find-links", str(tmp_path / "user"), "torch==2.12.0")
    assert r.returncode == 0, r.stdout + r.stderr

    def versions() -> list[str]:
        code = (
            "import importlib.metadata as m, torch; "
            "print(m.version('torch'), torch.__version__, torch.__file__)"
        )
        return subprocess.check_output([str(py), "-c", code], env=env, cwd=tmp_path, text=True).split()

    assert versions() == ["2.12.0", "2.12.0", str(site / "torch" / "__init__.py")]
    # the exact pins: pip would have to replace the user's torch (dry run: nothing changes)
    r = pip(
        "--dry-run", "--find-links", str(links), "-c", str(ROOT / "constraints.txt"), str(links / wheel.name)
    )
    assert r.returncode == 0 and re.search(r"Would install .*torch-2\.13\.0", r.stdout), r.stdout + r.stderr
    # the wheel as it is: installed, its requirements met by what the environment has
    r = pip("--find-links", str(links), str(links / wheel.name))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successfully installed streamdiloco-0.1.0" in r.stdout and "torch-2.13.0" not in r.stdout, (
        r.stdout
    )
    assert versions()[:2] == ["2.12.0", "2.12.0"], "pip replaced the user's torch"
    code = "import importlib.metadata as m; print(m.distribution('streamdiloco').locate_file(''))"
    where = subprocess.check_output([str(py), "-c", code], env=env, cwd=tmp_path, text=True).strip()
    assert Path(where) == site, where
