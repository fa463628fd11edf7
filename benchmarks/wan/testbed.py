"""The WAN testbed's network (see the package's docstring): its namespaces, addresses and ports, the bridge
that joins every site's veth pair, the nftables rule that sends a worker's connections through its
delaying proxy, and the tbf shaping of each worker's link.

Built with the harness's namespace commands (benchmarks/harness/netns.py); tests/test_slow_link.py builds one
under a prefix of its own. It starts no process: the proxies and the runs are sweep.py's.
"""

from __future__ import annotations

from benchmarks.harness import bench, netns
from benchmarks.harness.netns import in_ns, sh

PREFIX = "sdlwan-"  # every namespace of the testbed; leftovers with it are removed at the start
SUBNET = "10.213.77"  # the testbed's /24, only inside its namespaces
HUB, DC = PREFIX + "hub", PREFIX + "dc"
QUEUE = 0.1  # seconds of the link's rate that its tbf queue holds (--queue-ms)
DC_ADDR = f"{SUBNET}.10"
IFACE = "wan0"  # each site's end of its veth pair
BRIDGE = "br0"
PROXY_PORT = 15001  # the delaying proxy, on 127.0.0.1 in each worker namespace
CHECK_PORT = 15002  # the self-check's echo/sink server
SHARD_PORT = 7070
DDP_PORT = 29500
MARK = 0x5D1  # the proxy's own connections: the redirect rule skips them
FRAME = 1514  # a full Ethernet frame as tbf counts it
MiB = 1 << 20


def wan_py(*args: str) -> list[str]:
    """The command line of `python -m benchmarks.wan ARGS` (its internal roles: the proxy, the self-check)."""
    return bench("wan", *args)


def tbf_params(rate_mbit: float, queue: float = QUEUE) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at this rate whose queue holds `queue` seconds of it: see the
    package's docstring."""
    bps = rate_mbit * 1e6 / 8
    burst = max(2 * FRAME, int(bps * 0.002))
    return burst, burst + max(int(bps * queue), 8 * FRAME)


class Testbed:
    """The namespaces, the bridge, the veth pairs, the redirect rules and the shaping of one testbed. Its
    namespaces' names start with `prefix`: testbeds of other prefixes (a test's, beside a benchmark) are
    separate networks, each with the same addresses."""

    def __init__(self, workers: int, prefix: str = PREFIX):
        self.workers, self.prefix = workers, prefix
        self.hub, self.dc = prefix + "hub", prefix + "dc"
        self.ns = [f"{prefix}w{i}" for i in range(workers)]
        self.addr = [f"{SUBNET}.{11 + i}" for i in range(workers)]

    @staticmethod
    def leftovers(prefix: str = PREFIX) -> list[str]:
        """The namespaces of testbeds of this prefix that exist now."""
        return netns.existing(prefix)

    @staticmethod
    def remove_all(prefix: str = PREFIX) -> list[str]:
        """Delete every namespace of ours (and so its veths, qdiscs and nft tables), first killing any
        process still inside one (ours: only this testbed starts processes there)."""
        return netns.remove(prefix)

    def create(self) -> None:
        if self.workers > 100:
            raise ValueError(f"--workers {self.workers}: the testbed's /24 has room for 100 workers")
        netns.add(self.hub)
        sh("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        netns.set_link(BRIDGE, True, self.hub)
        sites = [(self.dc, DC_ADDR, "p-dc")]
        sites += [(ns, addr, f"p-w{i}") for i, (ns, addr) in enumerate(zip(self.ns, self.addr, strict=True))]
        for ns, addr, port in sites:
            netns.add(ns)
            netns.add_veth(port, IFACE, ns, ns=self.hub)
            sh("ip", "-n", self.hub, "link", "set", port, "master", BRIDGE, "up")
            netns.address(IFACE, f"{addr}/24", ns)
        for ns in self.ns:  # a worker's outgoing TCP to the testbed goes to its delaying proxy
            rules = f"""
            table ip sdlwan {{
                chain out {{
                    type nat hook output priority -100; policy accept;
                    oifname "{IFACE}" ip daddr {SUBNET}.0/24 meta l4proto tcp meta mark != {MARK:#x} \
redirect to :{PROXY_PORT}
                }}
            }}
            """
            sh(*in_ns(ns, "nft", "-f", "-"), stdin=rules)

    def shape(self, rate_mbit: float | None, queue: float = QUEUE) -> None:
        """rate_mbit each way on every worker's link (None: unshaped), behind a queue of `queue` seconds."""
        for i, ns in enumerate(self.ns):
            for where, dev in ((["-n", ns], IFACE), (["-n", self.hub], f"p-w{i}")):
                if rate_mbit is None:
                    sh("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    burst, limit = tbf_params(rate_mbit, queue)
                    sh(
                        *("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf"),
                        *("rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)),
                    )

    def counters(self, i: int) -> dict:
        """Bytes through worker i's interface so far: tx (up), rx (down)."""
        return netns.link_bytes(IFACE, self.ns[i])
