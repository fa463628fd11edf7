"""A shard's byte and message counters: what its sessions and Fetch calls moved, and the messages that did
not parse. Counted by the gRPC edge (server/edge/), read by status, metrics and the dashboard's samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """The servicer's byte and message counters (status, metrics, the dashboard's samples)."""

    codec_out: int = 0  # payload + scales of updates, summed over the members they went to
    msg_in: int = 0  # serialized protobuf bytes of every message received on sessions
    msg_out: int = 0
    fetch_out: int = 0
    bad_messages: int = 0  # session messages that were not pushes (refused pushes: ShardState counts them)
    fetch_waits: int = 0  # times a Fetch waited for a closing round's new master
