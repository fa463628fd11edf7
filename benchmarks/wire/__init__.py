"""Wire benchmark: what the gRPC wire costs, how fast one shard takes in pushes, and how much of a demo
worker's time goes to training. Each figure is measured beside a reference in the same run.

(a) framing   Real shard and worker processes talk through counting TCP proxies (asyncio, in this
              process, on 127.0.0.1). The proxies count every byte each way and parse the HTTP/2 frames
              and gRPC messages they forward, so the bytes split into: the codec's payload and scales,
              protobuf fields, gRPC's 5-byte message prefixes, HTTP/2 frame headers, HEADERS, flow
              control, pings and settings, and the Join and Fetch calls. Reference: the codec bytes the
              config predicts (encoded_nbytes of every slice pushed or received), cross-checked against
              the workers' summaries, the shards' counters and the chunks the proxy saw. A proxy sees the
              TCP payload only: TCP/IP headers (about 52 B per segment) are not in these figures.
(b) ingest    One shard process (--min-workers 8) and 8 client processes that Join with
              worker.link.ShardLink and push the same E3M0 fragment slice every round, each waiting for
              the round's update before its next push: MB/s of 4-bit payload the shard accepts. Then 2 shard
              processes (--num-shards 2, --b-shards): each client holds a ShardLink per shard, pushes each
              its slice of the fragment (slice_ranges) and waits for both shards' updates before its next
              push: MB/s summed over both shards, against 1 shard. Reference:
              the same 8 senders and bytes over plain TCP sockets to one asyncio receiver process that
              (1) reads and discards, (2) also dequantizes and sums in fp64 like the shard, (3) also runs
              the outer step and sends the E3M0 update back to all 8, as the shard does; each round ends
              with the receiver's reply to all 8 senders. Also: the shards' CPU by thread, and a cProfile of
              one shard's event loop in a separate pass.
(c) demo      `streamdiloco launch --shards 2 --workers 2 --steps 400 --log-every 50` (`make demo`, at half
              its 800 steps): per worker compute utilization (training time / wall time of training), blocked
              seconds, tokens/s. Reference: the same cluster with H = steps (each fragment syncs at most
              once before the final sync). Both again with every worker on all the cores (--threads),
              torch's default, where launch gives each worker cores / M threads and each shard one.

pushframing.py (`python -m benchmarks.wire.pushframing`, apart from the three parts): one push's framing
beyond its codec bytes counted without a network, per fragment, codec and number of shards (issue 38's
small top-k pushes); the bytes benchmark (benchmarks/bytes.py) sets it beside a counting proxy's figures.

Timings suffer from anything else running on the machine: before each timed run the benchmark waits (up to
--max-wait s) for the CPUs to be nearly idle, and it reports the CPU that other processes used.

    python -m benchmarks.wire                 # the recorded run (see BENCHMARKS.md), about 9 minutes
    python -m benchmarks.wire --quick         # a quick look (about 7 minutes)
    python -m benchmarks.wire --parts b       # one part

(from the repository's root: the benchmarks are the modules of the package `benchmarks`; benchmarks/harness/
starts and stops the processes and writes the results.) This package: main.py (the command line, the parts
in order), framing.py and proxy.py (a), ingest.py, ingest_report.py and clients.py (b), demo.py (c).

Writes results.md, results.json and run.log under --out (default benchmarks/results/wire). Every process
it starts is stopped at the end, on an error and on Ctrl+C.
"""
