"""The link planner: one run of the event model (sim/eventmodel.py) per pair of codecs.

`plan_codecs` runs one model with several pairs of codecs and gives, for each, the bytes per parameter per
outer step and the link each way a target utilization needs; `format_plan` is the table that the `plan`
command of `python -m streamdiloco.sim.utilization` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from streamdiloco.common.codecspec import canonical_codec, lookup_codec
from streamdiloco.sim.eventmodel import RunModel, needed_links, simulate

# What `plan` compares by default: the dense codecs, sq2 at two block sizes, and top-k up at two densities
# with a dense downlink (M workers' top-k pushes add up to a dense update, so the downlink stays dense).
PLAN_CODECS = (
    "fp32",
    "e3m0",
    "sq2",
    "sq2@1024",
    "topk64_4096/e3m0",
    "topk64_4096/sq2",
    "topk64_4096/sq2@1024",
    "topk256_4096/sq2@1024",
)


def parse_codecs(spec: str, block_size: int) -> tuple[str, str, int]:
    """(uplink codec, downlink codec, block size) of `UP[/DOWN][@BLOCK]`: `sq2@1024` is sq2 both ways at
    1024 values per codebook, `topk/e3m0` top-k up and e3m0 down at `block_size`. ValueError in one line."""
    codecs, _, block = spec.strip().partition("@")
    up, _, down = codecs.partition("/")
    if block:
        if not block.isdigit():
            raise ValueError(f"codecs {spec!r}: the block size after @ must be a number of values")
        block_size = int(block)
    try:
        return canonical_codec(up.strip()), canonical_codec((down or up).strip()), block_size
    except ValueError as e:
        raise ValueError(f"codecs {spec!r}: {e}") from None


@dataclass(frozen=True)
class PlanRow:
    """One pair of codecs on the planner's run: its bytes, its traffic and the link it needs, each way."""

    model: RunModel  # the run with these codecs and block size (its links unlimited)
    up_bytes: int  # each worker's pushes per H inner steps (every fragment once)
    down_bytes: int  # the updates each worker receives per H inner steps
    average_bps: tuple[float, float]  # (up, down) traffic at full compute
    needed_bps: tuple[float, float]  # (up, down) link for the target utilization
    at: tuple[float, ...]  # the utilization on each of the links asked about

    @property
    def label(self) -> str:
        m = self.model
        dense = [
            c
            for c in (m.uplink_codec, m.downlink_codec)
            if lookup_codec(c).scaled and not lookup_codec(c).sparse
        ]
        return f"{m.uplink_codec} / {m.downlink_codec}" + (f" (block {m.codec_block_size})" if dense else "")

    @property
    def bytes_per_value(self) -> tuple[float, float]:
        """(up, down) bytes per parameter per outer step."""
        n = sum(self.model.fragment_values)
        return self.up_bytes / n, self.down_bytes / n


def plan_codecs(
    base: RunModel,
    codecs: Sequence[tuple[str, str, int]],
    target: float,
    links: Sequence[tuple[float, float]] = (),
    rel_tol: float = 1e-3,
) -> list[PlanRow]:
    """For each (uplink codec, downlink codec, block size), `base` run with those codecs: its bytes per
    outer step, its traffic each way, the link each way it needs for `target` utilization (`needed_links`)
    and its utilization on each (uplink, downlink) of `links` (bit/s)."""
    rows = []
    for up, down, block in codecs:
        m = replace(
            base,
            uplink_codec=up,
            downlink_codec=down,
            codec_block_size=block,
            uplink_bps=math.inf,
            downlink_bps=math.inf,
        )
        up_bytes, down_bytes = m.outer_step_bytes()
        at = tuple(simulate(replace(m, uplink_bps=u, downlink_bps=d)).utilization for u, d in links)
        rows.append(PlanRow(m, up_bytes, down_bytes, m.average_bps(), needed_links(m, target, rel_tol), at))
    return rows


def format_plan(rows: Sequence[PlanRow], target: float, links: Sequence[tuple[float, float]] = ()) -> str:
    """The planner's rows as a markdown table, bandwidths in Mbit/s (up / down)."""

    def mbit(pair: tuple[float, float]) -> str:
        return " / ".join("unreachable" if math.isinf(b) else f"{b / 1e6:.3g}" for b in pair)

    def link(u: float, d: float) -> str:
        return f"{u / 1e6:g}" if u == d else f"{u / 1e6:g} / {d / 1e6:g}"

    head = [
        "codecs up / down",
        "bits per value",
        "bytes per parameter per outer step",
        "largest push / update",
        "average Mbit/s",
        f"needed for {100 * target:g} %, Mbit/s",
        *(f"on {link(u, d)} Mbit/s" for u, d in links),
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        m = r.model
        bpv = r.bytes_per_value
        largest = max(range(m.num_fragments), key=lambda f: m.fragment_values[f])
        cells = [
            r.label,
            f"{8 * bpv[0]:.4g} / {8 * bpv[1]:.4g}",
            f"{bpv[0]:.3g} / {bpv[1]:.3g}",
            f"{_fmt_bytes(m.push_bytes(largest))} / {_fmt_bytes(m.update_bytes(largest))}",
            mbit(r.average_bps),
            mbit(r.needed_bps),
            *(f"{100 * u:.1f} %" for u in r.at),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt_bps(bps: float) -> str:
    if math.isinf(bps):
        return "unreachable"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
