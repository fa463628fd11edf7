"""What one push costs on the wire beyond its codec bytes, counted without a network (issue 38, part 6: a
top-k push of a small fragment is a few KB; its framing must stay under 5 % of the payload).

A push's messages are built as a worker builds them (worker/link.py's Pushes.send: one WorkerMessage per
chunk of the shard's `chunk_values` values, the first carrying the PushHeader that common/progress.py
fills), then counted: the codec's bytes (Chunk.payload and Chunk.scales), the protobuf fields around them
(the Chunk's other fields, the header, the Push and WorkerMessage wrappers), gRPC's 5-byte prefix per
message and HTTP/2's 9-byte DATA frame header per frame of at most MAX_FRAME bytes (gRPC's default; the
counting proxy of part (a) sees the same frames: benchmarks/bytes.py checks the two agree). The push's
answer down (a PushResult) is counted the same way. TCP/IP headers are not counted here or by the proxy;
`tcp_ip_bytes` estimates them apart (52 B per segment of at most MSS bytes: IPv4, TCP with timestamps).

    python -m benchmarks.wire.pushframing            # tiny's fragments, top-k, sq2, e3m0; 1 and 2 shards
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from streamdiloco.common.codecs import chunk_values, encode, lookup_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, slice_ranges
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.progress import Progress, progress_to_proto
from streamdiloco.common.wire import to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb

GRPC_PREFIX = 5  # compressed flag and length, before every message
FRAME_HEADER = 9  # HTTP/2's frame header
MAX_FRAME = 16384  # HTTP/2 DATA frames' payload at most (SETTINGS_MAX_FRAME_SIZE's default, gRPC's)
MSS, TCP_IP = 1448, 52  # a 1500-byte MTU's segment with TCP timestamps; IPv4 (20) + TCP (32) headers
LIMIT_PCT = 5.0  # the bound on a small push's framing

# what a worker's push header reports late in a 1,200-step run (every field set: the largest header)
PROGRESS = Progress(
    step=1190,
    blocked_seconds=12.5,
    total_steps=1200,
    tokens=1190 * 16 * 128,
    compute_utilization=0.93,
    eval_loss=3.21,
    eval_step=1100,
    step_seconds=0.21,
)
PUSH_WEIGHT, PUSH_LOSS = 30 * 16 * 128, 3.3  # tokens since the fragment's last push (H = 30), its loss


@dataclass(frozen=True)
class PushBytes:
    """One push's bytes on the wire, up (its chunk messages) and down (its answer)."""

    codec: int  # payload and scales: encoded_nbytes
    chunk_fields: int  # the Chunk messages' other fields
    header: int  # the PushHeader with its field tag and length
    wrappers: int  # Push and WorkerMessage around each chunk
    grpc: int  # gRPC prefixes
    http2: int  # DATA frame headers
    messages: int
    answer: int  # the PushResult message, its prefix and frame header

    @property
    def protobuf(self) -> int:
        return self.chunk_fields + self.header + self.wrappers

    @property
    def framing(self) -> int:
        """Bytes up beyond the codec's, above TCP."""
        return self.protobuf + self.grpc + self.http2

    @property
    def framing_pct(self) -> float:
        return 100 * self.framing / self.codec

    @property
    def tcp_ip_bytes(self) -> int:
        """An estimate of the TCP/IP headers of the push alone (its messages sent back to back)."""
        return TCP_IP * -(-(self.codec + self.framing) // MSS)


def frames(n: int) -> int:
    """HTTP/2 DATA frames that carry a message of n bytes with its gRPC prefix."""
    return -(-(n + GRPC_PREFIX) // MAX_FRAME)


def push_bytes(
    values: torch.Tensor,
    codec: str,
    block_size: int,
    fragment: int = 0,
    round: int = 1000,
    progress: Progress = PROGRESS,
) -> PushBytes:
    """The bytes of a push of `values` in `codec`, its messages built as a worker builds them."""
    enc = encode(values, codec, block_size)
    header = progress_to_proto(progress, PUSH_WEIGHT, PUSH_LOSS)
    chunks = to_chunks(enc, fragment, round, chunk_values(codec, block_size))
    codec_b = chunk_fields = header_b = wrappers = grpc = http2 = 0
    for c in chunks:
        msg = pb.WorkerMessage(push=pb.Push(chunk=c, header=header if c.seq == 0 else None))
        size = msg.ByteSize()
        codec_b += len(c.payload) + len(c.scales)
        chunk_fields += c.ByteSize() - len(c.payload) - len(c.scales)
        h = pb.Push(header=header).ByteSize() if c.seq == 0 else 0
        header_b += h
        wrappers += size - c.ByteSize() - h
        grpc += GRPC_PREFIX
        http2 += FRAME_HEADER * frames(size)
    result = pb.ShardMessage(
        result=pb.PushResult(fragment=fragment, round=round, accepted=True, pace_seconds=0.21)
    ).ByteSize()
    answer = result + GRPC_PREFIX + FRAME_HEADER * frames(result)
    return PushBytes(codec_b, chunk_fields, header_b, wrappers, grpc, http2, len(chunks), answer)


def fragment_pushes(
    model: str, codec: str, block_size: int, shards: int = 1, cfg: SyncConfig | None = None
) -> list[dict]:
    """Each fragment's push of seeded deltas of about 1e-3 in `codec` to the first of `shards` shards (its
    slice of the fragment: common/fragments.py's slice_ranges): its size and framing."""
    cfg = cfg or SyncConfig()
    layout = build_layout(build_model(model, 0), cfg.num_fragments, cfg.fragment_pattern)
    g = torch.Generator().manual_seed(0)
    out = []
    for f, frag in enumerate(layout.fragments):
        lo, hi = slice_ranges(frag.numel, shards)[0]
        p = push_bytes(torch.randn(hi - lo, generator=g) * 1e-3, codec, block_size, f)
        assert p.codec == lookup_codec(codec).encoded_nbytes(hi - lo, block_size)
        out.append(
            {
                "model": model,
                "shards": shards,
                "codec": codec,
                "block": block_size,
                "fragment": f,
                "values": hi - lo,
                "codec_bytes": p.codec,
                "chunk_fields": p.chunk_fields,
                "header": p.header,
                "wrappers": p.wrappers,
                "protobuf": p.protobuf,
                "grpc_http2": p.grpc + p.http2,
                "framing": p.framing,
                "framing_pct": p.framing_pct,
                "answer_down": p.answer,
                "tcp_ip_estimate": p.tcp_ip_bytes,
                "tcp_ip_pct": 100 * p.tcp_ip_bytes / p.codec,
            }
        )
    return out


COLUMNS = [  # (heading, the cell's format over a row of fragment_pushes)
    ("model", "{model}"),
    ("shards", "{shards}"),
    ("codec", "{codec}"),
    ("block", "{block}"),
    ("fragment (values)", "{fragment} ({values:,})"),
    ("codec B", "{codec_bytes:,}"),
    ("Chunk fields B", "{chunk_fields}"),
    ("PushHeader B", "{header}"),
    ("wrappers B", "{wrappers}"),
    ("gRPC + HTTP/2 B", "{grpc_http2}"),
    ("framing B", "{framing}"),
    ("framing %", "{framing_pct:.2f} %"),
    ("answer down B", "{answer_down}"),
    ("TCP/IP est. B (%)", "{tcp_ip_estimate} ({tcp_ip_pct:.1f} %)"),
]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|---|---:|---|" + "---:|" * (len(COLUMNS) - 3)]
    lines += ["| " + " | ".join(cell.format(**r) for _, cell in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--codecs", default="topk64_4096,topk256_4096,sq2,e3m0")
    ap.add_argument("--block-size", type=int, default=1024, help="--codec-block-size (top-k: its chunk)")
    ap.add_argument("--shards", default="1,2", help="numbers of shards (each push: one shard's slice)")
    a = ap.parse_args(argv)
    rows = [
        r
        for n in (int(x) for x in a.shards.split(","))
        for c in a.codecs.split(",")
        for r in fragment_pushes(a.model, c, a.block_size, n)
    ]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
