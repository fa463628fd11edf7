"""What the shard's defenses (server/rounds/robust.py) cost on its hot path: the norm of each chunk as it
arrives (`sumsq`, on the event loop), and a round's close with the defaults, without them, and with the robust
aggregators; M pushes of N values in E3M0, cut into 1 MiB chunks as workers send them.

    python -m benchmarks.robust                 # N = 4M values, M = 4
    python -m benchmarks.robust --values 25000000 --workers 8
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

from streamdiloco.common.codecs import accumulate, chunk_values, encode, split, sumsq, warm_up
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import ShardState


class _Flat(nn.Module):
    """One fragment of n values (and a one-value block list, which a layout needs)."""

    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(1, 1, bias=False)])
        self.w = nn.Parameter(torch.zeros(n - 1))


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=1 << 22, help="N, values in the shard's slice")
    p.add_argument("--workers", type=int, default=4, help="M, pushes per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds per setup (the best is shown)")
    args = p.parse_args()
    n, m = args.values, args.workers
    torch.set_num_threads(1)
    warm_up(("e3m0",), 128)
    layout = build_layout(_Flat(n), 1)
    n = layout.fragments[0].numel
    g = torch.Generator().manual_seed(0)
    encs = [encode(torch.randn(n, generator=g) * 1e-2, "e3m0", 128) for _ in range(m)]
    chunks = [split(e, chunk_values("e3m0", 128)) for e in encs]
    acc = torch.zeros(n, dtype=torch.float64)
    ts, ta = best(lambda: sumsq(encs[0])), best(lambda: accumulate(encs[0], acc, 1.0))
    tc = best(lambda: [sumsq(part) for _, part in chunks[0]]) / len(chunks[0])
    print(f"N = {n:,} values, M = {m}, E3M0 in chunks of {chunks[0][0][1].numel:,} values (1 MiB)")
    print(
        f"sumsq of a push: {ts * 1e3:.1f} ms ({n / ts / 1e9:.2f} G values/s); of one chunk {tc * 1e3:.3f} ms"
    )
    print(
        f"accumulate (the fold's per-push work), for scale: {ta * 1e3:.1f} ms ({n / ta / 1e9:.2f} G values/s)"
    )
    cfg = SyncConfig(sync_every=2, num_fragments=1, fragment_sync_delay=0)
    setups = [
        ("defaults", RobustConfig()),
        ("no defenses", RobustConfig.off()),
        ("trimmed", RobustConfig(aggregator="trimmed")),
        ("centered-clip", RobustConfig(aggregator="centered-clip")),
    ]
    for label, robust in setups:
        st = ShardState(0, 1, layout, cfg, [torch.zeros(n)], robust=robust)
        names = [f"w{i}" for i in range(m)]
        for name in names:
            st.add_member(name)
        take, close = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for name, parts in zip(names, chunks, strict=True):
                for seq, (off, part) in enumerate(parts):
                    st.push_chunk(name, 0, r, seq, off, n, part, off + part.numel == n, 4096.0, 3.0)
            t1 = time.perf_counter()
            st.close_round(0)
            close.append(time.perf_counter() - t1)
            take.append(t1 - t0)
        took, closed = min(take) * 1e3, min(close) * 1e3
        print(f"{label:14s} taking the {m} pushes {took:7.1f} ms, closing the round {closed:7.1f} ms")


if __name__ == "__main__":
    main()
