#!/usr/bin/env python3
"""Give the compose stack N shards: writes docker-compose.shards.yml (shard-2 .. shard-(N-1), each extending
docker-compose.yml's shard-0 with its own index, ports and checkpoint volume, and the workers waiting for
them) and sets the shards' names in .env, from which every command, the certificate and Prometheus read
them. Python's standard library only: it runs on the Docker host, outside the package.

    cp .env.example .env                                   # once, with the two secrets set
    python3 docker/shards.py 4                             # shard-0 .. shard-3
    python3 docker/shards.py 4 --public-names host.example.org   # and its certificate names the host
    docker compose up -d                                   # .env's COMPOSE_FILE adds the override

Shard s publishes gRPC on 7070+s and HTTPS on 8080+s (on STREAMDILOCO_BIND, 127.0.0.1 by default).
`python3 docker/shards.py 2` goes back to the file's own two. A running run keeps its shard count: change
it for a new run (`docker compose down -v` first), as shards refuse a checkpoint of another layout.
Needs docker compose >= 2.24.4 (`!override`). It must not touch anything but those two files.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = 2  # shard-0 and shard-1 are in docker-compose.yml
GRPC, HTTP = 7070, 8080


def env_lines(n: int, public_names: str, override: Path | None, env_dir: Path) -> dict[str, str]:
    """The .env settings for n shards (COMPOSE_FILE: the override beside the stack's file, if any)."""
    names = [f"shard-{s}" for s in range(n)]
    lines = {
        "STREAMDILOCO_NUM_SHARDS": str(n),
        "STREAMDILOCO_SHARD_NAMES": ",".join(names),
        "STREAMDILOCO_SERVERS": ",".join(f"{h}:{GRPC}" for h in names),
        "STREAMDILOCO_PEERS": ",".join(f"https://{h}:{HTTP}" for h in names),
        "STREAMDILOCO_PUBLIC_NAMES": public_names,
    }
    files = [ROOT / "docker-compose.yml", *([override] if override else [])]
    lines["COMPOSE_FILE"] = ":".join(os.path.relpath(f, env_dir) for f in files)
    return lines


def override_text(n: int, compose_file: str) -> str:
    out = [
        f"# Written by `python3 docker/shards.py {n}`: shard-{BUILT_IN} .. shard-{n - 1} beside",
        "# docker-compose.yml's shard-0 and shard-1 (again to change the count); .env has their names.",
        "services:",
    ]
    for s in range(BUILT_IN, n):
        out += [
            f"  shard-{s}:",
            f"    extends: {{file: {compose_file}, service: shard-0}}",
            "    environment:",
            f'      STREAMDILOCO_SHARD: "{s}"',
            "    ports: !override",
            f"      - ${{STREAMDILOCO_BIND:-127.0.0.1}}:{GRPC + s}:{GRPC}",
            f"      - ${{STREAMDILOCO_BIND:-127.0.0.1}}:{HTTP + s}:{HTTP}",
            "    volumes:",
            f"      - shard-{s}-checkpoints:/checkpoints",
        ]
    out += ["  worker:", "    depends_on:"]
    out += [f"      shard-{s}: {{condition: service_healthy}}" for s in range(BUILT_IN, n)]
    out += ["volumes:"] + [f"  shard-{s}-checkpoints:" for s in range(BUILT_IN, n)]
    return "\n".join(out) + "\n"


def update_env(path: Path, settings: dict[str, str]) -> None:
    """Set these keys in the .env file (replaced where they are, appended where not); the rest is kept."""
    lines = path.read_text().splitlines()
    done = set()
    for i, line in enumerate(lines):
        key = line.split("=", 1)[0].strip()
        if "=" in line and not line.lstrip().startswith("#") and key in settings:
            lines[i] = f"{key}={settings[key]}"
            done.add(key)
    lines += [f"{k}={v}" for k, v in settings.items() if k not in done]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="docker/shards.py")
    p.add_argument("shards", type=int, help="how many shards (2 to 64)")
    p.add_argument(
        "--public-names",
        default="",
        metavar="HOST,...",
        help="names (or addresses) by which workers on other machines reach this host: the shards' "
        "certificate holds them too (set STREAMDILOCO_BIND=0.0.0.0 in .env to publish the shards' ports)",
    )
    p.add_argument(
        "--env", type=Path, default=ROOT / ".env", help="the .env to update (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docker-compose.shards.yml",
        help="the override (default: %(default)s)",
    )
    a = p.parse_args(argv)
    if not 2 <= a.shards <= 64:
        p.error(f"{a.shards} shards: give 2 to 64 (the stack's file has shard-0 and shard-1)")
    if not a.env.exists():
        p.error(f"{a.env} does not exist: cp .env.example .env and set the two secrets first")
    out = a.out.resolve()
    if a.shards > BUILT_IN:
        # extends' file is read from the project's folder (docker-compose.yml's): beside it, its own name
        base = "docker-compose.yml" if out.parent == ROOT else str(ROOT / "docker-compose.yml")
        out.write_text(override_text(a.shards, base))
        print(f"wrote {out}")
    elif out.exists():
        out.unlink()
        print(f"removed {out}")
    settings = env_lines(
        a.shards, a.public_names, out if a.shards > BUILT_IN else None, a.env.resolve().parent
    )
    update_env(a.env, settings)
    print(f"set in {a.env}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
