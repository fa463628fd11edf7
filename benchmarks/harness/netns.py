"""Linux network namespaces for the benchmarks that need a network of their own (root, iproute2): the WAN
testbed (benchmarks/wan/testbed.py: a bridge, shaped links) and the chaos benchmark's dropped link
(benchmarks/chaos.py: one veth pair to this namespace).

Namespaces are named by a prefix of their own, so that `remove(prefix)` finds and deletes the leftovers of
a run that was killed (first killing any process still inside one: only the benchmark that made them starts
processes there) and separate users (a test beside a benchmark) never touch each other's. Deleting a
namespace deletes its end of every veth pair, and so the pair.

Commands only: this module decides no addresses, rates or names (its callers do) and starts no long-lived
process (procs.py does, wrapped in `in_ns`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time


def sh(*cmd: str, check: bool = True, stdin: str | None = None) -> str:
    """Run a command; its stdout. RuntimeError (with the command and its stderr) when it fails and `check`."""
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def missing(tools: tuple[str, ...] = ("ip",)) -> str | None:
    """Why namespaces cannot be made here (not root, a tool missing), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    lacking = [t for t in tools if shutil.which(t) is None]
    if lacking:
        return f"{', '.join(lacking)} missing: run scripts/system-deps.sh wan (Debian: iproute2, nftables)"
    return None


def in_ns(ns: str, *cmd: str) -> list[str]:
    """The command line that runs `cmd` inside namespace `ns`."""
    return ["ip", "netns", "exec", ns, *cmd]


def ns_flag(ns: str | None) -> list[str]:
    """`ip`'s and `tc`'s option for a namespace (none: this one)."""
    return ["-n", ns] if ns else []


def existing(prefix: str) -> list[str]:
    """The namespaces whose names start with `prefix`."""
    return [
        line.split()[0]
        for line in sh("ip", "netns", "list").splitlines()
        if line.split() and line.split()[0].startswith(prefix)
    ]


def remove(prefix: str) -> list[str]:
    """Delete every namespace whose name starts with `prefix` (and so its veths, qdiscs and nft tables),
    first killing any process still inside one. Returns the names deleted."""
    gone = existing(prefix)
    for ns in gone:
        for pid in sh("ip", "netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in gone:
        for _ in range(50):  # a killed process may hold the namespace a moment longer
            if not sh("ip", "netns", "pids", ns, check=False).split():
                break
            time.sleep(0.1)
        sh("ip", "netns", "del", ns, check=False)
    return gone


def add(ns: str) -> None:
    """A new namespace with its loopback up and no IPv6 (its chatter would count in the interfaces' bytes)."""
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh(
        *in_ns(ns, "sysctl", "-q", "-w"),
        "net.ipv6.conf.all.disable_ipv6=1",
        "net.ipv6.conf.default.disable_ipv6=1",
    )


def add_veth(name: str, peer: str, peer_ns: str, ns: str | None = None) -> None:
    """A veth pair: `name` in namespace `ns` (None: this one), `peer` in `peer_ns`."""
    sh("ip", *ns_flag(ns), "link", "add", name, "type", "veth", "peer", "name", peer, "netns", peer_ns)


def address(dev: str, cidr: str, ns: str | None = None) -> None:
    """Give `dev` the address `cidr` (e.g. 10.0.0.1/24) and bring it up."""
    sh("ip", *ns_flag(ns), "addr", "add", cidr, "dev", dev)
    set_link(dev, True, ns)


def set_link(dev: str, up: bool, ns: str | None = None) -> None:
    """Bring `dev` up or down."""
    sh("ip", *ns_flag(ns), "link", "set", dev, "up" if up else "down")


def link_bytes(dev: str, ns: str | None = None) -> dict[str, int]:
    """Bytes through `dev` so far: tx (sent), rx (received)."""
    link = json.loads(sh("ip", *ns_flag(ns), "-j", "-s", "link", "show", "dev", dev))[0]
    stats = link.get("stats64") or link["stats"]
    return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}
