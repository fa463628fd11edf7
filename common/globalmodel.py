"""The run's global model (the shards' masters, not any worker's α-mixed local parameters), read without the
model's code: `GlobalModel` (the fragments' flat vectors, the fingerprint that names their values, the rounds
they hold), gathered from the live shards (`from_servers`, `fetch_masters`: Fetch, as a worker reads them,
every chunk checked by common/fetch.py) and written as tensors (`GlobalModel.tensors`, `load_into_model`,
`model_tensors`, `write_safetensors`). The shards' checkpoint directories are read by
server/storage/export.py's `from_checkpoints`, which knows their format; `streamdiloco export` (cli/export.py)
is the command over both.

The names, shapes and dtypes come from the run's fingerprint (on the first chunk of a Fetch that asks to
`describe`), and the fragments' flat vectors are cut back into them with the same slice math the shards use.
A file written from a `GlobalModel` holds each parameter once, under its `named_parameters()` name (a tied
weight once, as the fingerprint lists it), and metadata a shard can start from (`server --init`):

    streamdiloco.fingerprint   the run's model fingerprint (JSON)
    streamdiloco.rounds        per fragment, the open round of the exported master (it holds rounds < it);
                               a list per shard when they differ (mixed rounds)

It must not import server/ or worker/ (it stands on common/ and protos/), nor write anything but the file it
is asked for, atomically.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamdiloco.common.atomic import atomic_save
from streamdiloco.common.fingerprint import MAX_FINGERPRINT_BYTES, layout_from_fingerprint
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.statefile import FINGERPRINT_KEY

if TYPE_CHECKING:
    from streamdiloco.common.tls import ClientTLS

ROUNDS_KEY = "streamdiloco.rounds"

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """A `Progress` that says nothing."""


@dataclass
class GlobalModel:
    """The run's global model as flat fragment vectors (fp32), the fingerprint that names their values, and
    the round of each fragment's master (one per shard when the shards differ)."""

    fingerprint: dict
    layout: FragmentLayout
    vectors: list[torch.Tensor]
    rounds: list[int | list[int]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each parameter under its name, in its own dtype: contiguous copies (no two share storage)."""
        out = {}
        for fragment, vec in zip(self.layout.fragments, self.vectors, strict=True):
            for e in fragment.entries:
                value = vec[e.offset : e.offset + e.numel].view(e.shape)
                out[e.name] = value.to(_dtype(e.dtype, e.name), copy=True)
        return out

    def metadata(self) -> dict[str, str]:
        # "format": "pt" is what transformers' loaders look for in a safetensors file's metadata
        return {
            "format": "pt",
            FINGERPRINT_KEY: json.dumps(self.fingerprint, sort_keys=True),
            ROUNDS_KEY: json.dumps(self.rounds),
        }


def _dtype(name: str, param: str, where: str = "the fingerprint") -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where} gives parameter {param[:80]!r} the dtype {name[:40]!r}, not a float dtype")
    return dtype


def empty_vector(numel: int, what: str) -> torch.Tensor:
    """An fp32 vector for `what`; a one-line error when this machine cannot hold it."""
    try:
        return torch.empty(numel, dtype=torch.float32)
    except RuntimeError as e:  # the size comes from a fingerprint: say so rather than print a traceback
        raise ValueError(f"cannot hold {what} ({numel:,} values) in memory: {str(e)[:120]}") from None


def size_text(values: int) -> str:
    return f"{values * 4 / 1e6:,.1f} MB"


def agree_rounds(
    per_shard: list[list[int]], mixed_ok: bool, where: Callable[[int], str]
) -> list[int | list[int]]:
    """Each fragment's round, from every shard's: one number when they agree; else a ValueError naming the
    rounds (or, with `mixed_ok`, the list of them)."""
    out: list[int | list[int]] = []
    for f, rounds in enumerate(zip(*per_shard, strict=True)):
        if len(set(rounds)) == 1:
            out.append(rounds[0])
            continue
        if not mixed_ok:
            at = ", ".join(f"{r} on shard {s} ({where(s)})" for s, r in enumerate(rounds))
            raise ValueError(
                f"the shards hold different rounds of fragment {f}: {at}; the round closed on some shards "
                "only (one stopped, or is behind): export anyway with --mixed-rounds (each slice as of its "
                "own shard's round)"
            )
        out.append(list(rounds))
    return out


# --- from a live run (Fetch) -----------------------------------------------------------------------------
class _ShardFetch:
    """Fetches from one shard, listed at place `shard` of `num_shards` in --servers."""

    def __init__(
        self, target: str, shard: int, num_shards: int, token: str, tls: ClientTLS | None, timeout: float
    ):
        self.target, self.shard, self.num_shards = target, shard, num_shards
        self.token, self.tls, self.timeout = token, tls, timeout
        self.fingerprint: dict | None = None  # as the shard described its run

    def _described(self, m) -> FragmentLayout:
        """The run's layout from the stream's first chunk; ValueError unless the shard is the one listed."""
        if not m.fingerprint_json:
            raise ValueError(
                f"the shard at {self.target} does not say which run it serves (an older streamdiloco?): "
                "export from its checkpoint directory instead"
            )
        if (m.shard, m.num_shards) != (self.shard, self.num_shards):
            raise ValueError(
                f"--servers lists the shard at {self.target} in place {self.shard} of {self.num_shards}, "
                f"but it is shard {m.shard} of {m.num_shards}: list every shard, in order"
            )
        if len(m.fingerprint_json) > MAX_FINGERPRINT_BYTES:
            raise ValueError(
                f"the shard at {self.target} sent a fingerprint of over {MAX_FINGERPRINT_BYTES:,} bytes"
            )
        try:
            self.fingerprint = json.loads(m.fingerprint_json)
        except ValueError as e:
            raise ValueError(
                f"the shard at {self.target} sent a fingerprint that is not JSON ({e})"
            ) from None
        return layout_from_fingerprint(self.fingerprint, f"the fingerprint of the shard at {self.target}")

    def fetch(
        self, layout: FragmentLayout | None = None, fragment: int | None = None, progress: Progress = quiet
    ) -> tuple[FragmentLayout, list[torch.Tensor], list[int]]:
        """The shard's slice of every fragment (or of `fragment`) and their rounds; without a `layout`, the
        shard is asked to describe its run first (`self.fingerprint`). Every chunk is checked (order,
        offsets, lengths, one round per fragment, finite values: common/fetch.py)."""
        import grpc

        from streamdiloco.common.fetch import FetchError, fetch_slices
        from streamdiloco.common.wire import make_channel, parse_target
        from streamdiloco.protos import streamdiloco_pb2 as pb
        from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

        described: list[FragmentLayout] = []

        def sizes_of(layout: FragmentLayout, fragments: list[int]) -> dict[int, int]:
            ranges = [slice_ranges(layout.fragments[f].numel, self.num_shards)[self.shard] for f in fragments]
            return {f: hi - lo for f, (lo, hi) in zip(fragments, ranges, strict=True)}

        def describe(m: pb.MasterChunk) -> dict[int, int]:
            described.append(self._described(m))
            return sizes_of(described[0], list(range(described[0].num_fragments)))

        received, last_said = [0], [time.monotonic()]

        def on_chunk(m: pb.MasterChunk) -> None:
            received[0] += len(m.values) // 4
            if time.monotonic() - last_said[0] > 2.0:
                progress(f"shard {self.shard} at {self.target}: {size_text(received[0])} received")
                last_said[0] = time.monotonic()

        wanted = None
        if layout is not None:
            wanted = sizes_of(layout, list(range(layout.num_fragments)) if fragment is None else [fragment])
        try:
            with make_channel(parse_target(self.target), self.tls) as channel:
                got = fetch_slices(
                    pb_grpc.ShardStub(channel),
                    wanted,
                    where=f"the shard at {self.target}",
                    describe=describe if layout is None else None,
                    token=self.token,
                    timeout=self.timeout,
                    on_chunk=on_chunk,
                )
        except FetchError as e:
            if e.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise ValueError(
                    f"the shard at {self.target} refused the credentials ({e.details}): Fetch needs a "
                    "worker's (--token or --token-file, and --tls-* as the workers)"
                ) from None
            raise
        layout = layout or described[0]
        return layout, list(got.slices.values()), list(got.rounds.values())


def from_servers(
    targets: list[str],
    token: str = "",
    tls: ClientTLS | None = None,
    timeout: float = 120.0,
    settle: float = 30.0,
    mixed_rounds: bool = False,
    progress: Progress = quiet,
) -> GlobalModel:
    """The global model from a live run: every shard, listed in order (shard s at targets[s]), Fetched with
    a worker's credentials. A fragment whose round closed on one shard and not yet on another is fetched
    again from the shards behind, for up to `settle` seconds, so that every slice is of the same round."""
    if not targets:
        raise ValueError("--servers: give every shard as HOST:PORT, comma-separated, in shard order")
    shards = [_ShardFetch(t, s, len(targets), token, tls, timeout) for s, t in enumerate(targets)]
    layout: FragmentLayout | None = None
    per_shard: list[list[torch.Tensor]] = []
    rounds: list[list[int]] = []
    for sh in shards:
        got, slices, rs = sh.fetch(progress=progress)
        first = shards[0]
        if layout is None:
            layout = got
        elif sh.fingerprint != first.fingerprint:
            from streamdiloco.common.fingerprint import fingerprint_diff

            them = f"shard at {first.target}"
            diff = fingerprint_diff(
                sh.fingerprint or {}, first.fingerprint or {}, f"shard at {sh.target}", them
            )
            raise ValueError(f"the shards at {first.target} and {sh.target} serve different runs: {diff}")
        per_shard.append(slices)
        rounds.append(rs)
        size = size_text(sum(x.numel() for x in slices))
        progress(f"shard {sh.shard} of {len(targets)} at {sh.target}: {size}, rounds {rs}")
    assert layout is not None and shards[0].fingerprint is not None
    deadline = time.monotonic() + settle
    for f in range(layout.num_fragments):
        while len({rs[f] for rs in rounds}) > 1 and time.monotonic() < deadline:
            top = max(rs[f] for rs in rounds)  # a round closing: fetch it again where it has not closed yet
            for s, sh in enumerate(shards):
                if rounds[s][f] < top:
                    _, [per_shard[s][f]], [rounds[s][f]] = sh.fetch(layout, f)
            if len({rs[f] for rs in rounds}) > 1:
                time.sleep(0.2)
    vectors = [torch.cat([per_shard[s][f] for s in range(len(shards))]) for f in range(layout.num_fragments)]
    fp = shards[0].fingerprint
    return GlobalModel(fp, layout, vectors, agree_rounds(rounds, mixed_rounds, lambda s: targets[s]))


def fetch_masters(
    targets: list[str], token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> list[torch.Tensor]:
    """The run's global parameters, fragment by fragment, read from the live shards listed in shard order
    (no Join: Fetch is read-only), every chunk checked as export checks it; the rounds may differ between
    shards (no waiting for a closing round). For tools, tests and benchmarks; workers fetch through their
    links."""
    return from_servers(targets, token, tls, timeout, settle=0.0, mixed_rounds=True).vectors


# --- writing -----------------------------------------------------------------------------------------------
def load_into_model(model: torch.nn.Module, gm: GlobalModel, spec: str) -> None:
    """Set the model's parameters to the global ones; ValueError (one line) unless the model's parameters
    are the run's: the same names, shapes and dtypes."""
    params = dict(model.named_parameters())
    ours = {e.name: e for f in gm.layout.fragments for e in f.entries}
    if missing := sorted(set(ours) - set(params)):
        raise ValueError(
            f"--model {spec} does not fit the run: it lacks parameter {missing[0]!r} ({len(missing)} missing)"
        )
    if extra := sorted(set(params) - set(ours)):
        raise ValueError(
            f"--model {spec} does not fit the run: it has parameter {extra[0]!r}, which the run has not"
        )
    for name, e in ours.items():
        p = params[name]
        dtype = str(p.dtype).removeprefix("torch.")
        if tuple(p.shape) != e.shape or dtype != e.dtype:
            raise ValueError(
                f"--model {spec} does not fit the run: {name} is {list(p.shape)} {dtype} there, "
                f"{list(e.shape)} {e.dtype} in the run"
            )
    with torch.no_grad():  # straight from the flat vectors (copy_ rounds to the dtype as .to() does)
        for fragment, vec in zip(gm.layout.fragments, gm.vectors, strict=True):
            for e in fragment.entries:
                params[e.name].copy_(vec[e.offset : e.offset + e.numel].view(e.shape))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with a tied tensor once, under its named_parameters() name (the fingerprint's):
    contiguous CPU copies, as safetensors takes them. `safetensors.torch.load_model` fills the other names."""
    params = {id(p): name for name, p in model.named_parameters()}
    out, seen = {}, set()
    for key, t in model.state_dict(keep_vars=True).items():
        name = params.get(id(t), key)
        if name in seen:
            continue
        seen.add(name)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write the file beside its final place and rename it there: a failure leaves no half file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
