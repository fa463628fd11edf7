"""WAN testbed: Streaming DiLoCo against data-parallel (DDP over gloo) across emulated internet links.

Sites joined by slow links, on one Linux machine (run as root):

    namespace sdlwan-dc   the shard (a datacenter: its link is not shaped)          10.213.77.10
    namespace sdlwan-w0   worker 0 (a site: shaped link, delaying proxy)            10.213.77.11
    namespace sdlwan-w1   worker 1 ...                                              10.213.77.12
    namespace sdlwan-hub  a Linux bridge (br0) joining every site's veth pair

The network 10.213.77.0/24 exists only inside these namespaces; the testbed touches nothing outside them.

Bandwidth: `tc qdisc tbf` on both ends of each worker's veth pair: the worker side's egress is its uplink,
the bridge port's egress its downlink (the same rate each way). burst = max(2 full frames (3028 B), 2 ms at
the rate): the bucket refills in 2 ms, so the timer never has to fire per packet at the high rates; limit =
burst + max(100 ms at the rate, 8 full frames): a queue of about 100 ms (`--queue-ms`: a home modem's often
holds a second or more), that the lowest rates stretch to a few frames so that TCP's first flight is not
dropped. tbf counts Ethernet frames: TCP's payload
(1448 B in a 1514 B frame) gets about 95.6% of the rate. "unlimited": no qdisc (veth speed).

Delay: the kernel has no netem, so each worker namespace runs a delaying TCP proxy (linkproxy.py's `_proxy`,
asyncio). An nftables rule (table ip sdlwan, nat output) redirects every TCP connection that the worker's
processes open through wan0 to the testbed's /24 to the proxy on 127.0.0.1; the proxy reads the original
destination (SO_ORIGINAL_DST), connects there itself (its socket carries SO_MARK 0x5d1, which the rule
skips), and forwards each chunk, each way, d seconds after it arrived, in order (a time-stamped queue per
direction). So every round trip from a worker is 2d, whatever the other end; worker-to-worker connections
(gloo) pass through the connecting side's proxy once (round trip 2d) and through both workers' tbf links.
The proxy holds at most max(256 KiB, 2 x rate x (d + 50 ms)) bytes per direction (64 MiB unlimited): about
what a real path holds in flight, so it never limits throughput and backpressure reaches the sender's socket.
Not emulated: the TCP handshake's extra round trip (connect() returns at once: connections here are long
lived), packet loss, and TCP's own reaction to a long RTT (the proxy's legs have short ones).

Each (rate, delay) point starts with a self-check printed before its runs: the round trip of a 1-byte echo
from every worker to the shard's namespace and from worker 0 to worker 1, and a bulk transfer up and down
through worker 0's link. Then the reference: the training loop without any communication (wan_ddp.py
--no-comm), in every worker namespace at once (the same CPU contention as a run): its mean step time t_ref.
Then the runs:

  sdl  one shard (`streamdiloco server --min-workers M --no-checkpoint`) and M `streamdiloco worker`s
  ddp  benchmarks/wan_ddp.py: DDP over gloo, one rank per worker namespace, the same model, seed, data
       streams (rank r), batch, AdamW and learning-rate schedule as the workers

every process with 1 torch thread. Per run: compute utilization = steps x t_ref / wall time of the training
loop (the same definition for both; the workers' own compute_utilization, compute time / training time, is
shown beside it), steps/s, bytes per step at the worker's interface (tx = up, rx = down; during training, and
in results.json also for the whole run with the shard's Fetch or DDP's first broadcast), streamdiloco's
blocked seconds, eval loss of the global model. A run past its time bound (--timeout, --ddp-timeout) is
stopped and reported from the steps it did (eval loss "—").

    make bench-wan                                    # the full sweep (hours; a quiet machine)
    python -m benchmarks.wan --quick                  # 1 and unlimited Mbit/s at 25 ms, 60 steps
    python -m benchmarks.wan --rates 1,unlimited --delays 25 --systems sdl \\
        --sdl-flags "--fragment-sync-delay 3"         # flags for shard and workers both
    python -m benchmarks.wan --check-only             # the network and its self-checks, no training
    GRPC_TRACE=http2_ping GRPC_VERBOSITY=debug python -m benchmarks.wan --workers 1 --rates 1 --delays 25 \\
        --systems sdl --steps 40 --queue-ms 1000 --keep  # then: python -m benchmarks.wan pings KEPT/*.log

This package: main.py (the command line, the sweep in order), testbed.py (the namespaces, the bridge, the
redirect rule, the shaping: the harness's netns commands), linkproxy.py (the delaying proxy and the
self-check, the processes inside the namespaces), sweep.py (each point's checks, reference and runs),
report.py (tables, plot, `combine`, `pings`). Its names that tests/test_slow_link.py uses are below.

Writes results.md, results.json (after every run), utilization.png and run.log under --out. Every process,
namespace, qdisc and nftables table it makes is removed at the end, on an error, on Ctrl+C and on SIGTERM;
leftovers of a run that was killed are removed at the start.
"""

from benchmarks.wan.linkproxy import proxy_limit
from benchmarks.wan.report import ping_answers
from benchmarks.wan.testbed import DC_ADDR, PROXY_PORT, SHARD_PORT, Testbed, in_ns, wan_py

__all__ = ["DC_ADDR", "PROXY_PORT", "SHARD_PORT", "Testbed", "in_ns", "ping_answers", "proxy_limit", "wan_py"]
