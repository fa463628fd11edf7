"""One fragment of a worker's model and everything the sync engine keeps for it, in one object.

A `FragmentSync` holds, for one fragment (as torchft's `_StreamingDiLoCoFragment` does): the parameters'
tensors, the fp32 mirror of the global parameters and the rounds it holds, the buffers its sends and merges
reuse, the uplink's error-feedback residual (--uplink-feedback), the tokens and losses since its last
send, the round in flight and the step that sent it, its latest send job and one future per round that
says the round's update is in the mirror. Its methods are the mechanics of one sync, each on the thread
that runs it:
- training thread: `prepare_send` (a snapshot of the parameters, and what the push reports) at the send
  step, `merge` (one multi-tensor lerp on the parameters' device) at the merge step;
- sync thread: `encode` (the outer gradient, mirror - snapshot, plus the decayed residual of the uplink's
  error feedback when it is on, encoded per shard slice; the residual keeps what the codec left out) and
  `apply` (the round's update added into the mirror; on CUDA also staged on the device for the lerp).
On CUDA the snapshot is a device-side copy that the sync thread brings to a pinned host buffer on its own
stream, and what the lerp reads is copied to the device there too (`Placement`). It saves and loads its own
part of a worker checkpoint (`state_dict`, `load_state_dict`), as torchft's fragment does.

What an update brings for one shard slice is a `SliceUpdate`: the parts of an update to add, a fetched
`Master` to take instead, or None (the mirror holds that round already).

What it must not do: decide when (the schedule, the merge policy, the waits and the engine's counters are
worker/engine.py's) or talk to a transport.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeAlias

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded, add_into, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import Fragment, slice_ranges
from streamdiloco.common.outer import merge_local_, outer_gradient, rebase_local_
from streamdiloco.worker.linkstate import Master

# What a round's update brings for one shard slice of a fragment (an entry of the list that
# engine.Transport.update's future gives; FragmentSync.apply takes one per slice):
# - an Encoded update to add into the mirror's slice (the simulator's), or its (offset, Encoded) parts as
#   they came over the wire (the link's: added part by part, never joined);
# - a Master fetched after a reconnect: its values replace the slice (they hold this round and any missed);
# - None: the mirror holds this round already (fetched when the worker joined).
SliceUpdate: TypeAlias = Encoded | list[tuple[int, Encoded]] | Master | None


class Placement:
    """Where a worker's fragments live: the parameters' device and, on CUDA, the sync thread's stream (one
    per engine) and pinned host buffers, so that copies between host and device run beside the training."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._side: Any = None

    def host(self, numel: int) -> torch.Tensor:
        """A flat fp32 buffer on the CPU (pinned on CUDA, for asynchronous copies)."""
        return torch.empty(numel, dtype=torch.float32, pin_memory=self.cuda and torch.cuda.is_available())

    def side_stream(self) -> Any:
        """CUDA: the sync thread's stream."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side


class PushBuffers:
    """A fragment's buffers on the sync thread's side of its pushes, in host memory beside the mirror (pinned
    on CUDA): the outer gradient (reused by the rebase's correction once the push is through) and the
    uplink's error-feedback residual e (cfg.uplink_decay > 0 only: 4 bytes per parameter, zeros at first)."""

    def __init__(self, place: Placement, numel: int):
        self.place, self.numel = place, numel
        self.delta: torch.Tensor | None = None
        self.feedback: torch.Tensor | None = None

    def delta_buffer(self) -> torch.Tensor:
        if self.delta is None:
            self.delta = self.place.host(self.numel)
        return self.delta

    def feedback_buffer(self) -> torch.Tensor:
        if self.feedback is None:
            self.feedback = self.place.host(self.numel).zero_()
        return self.feedback

    def keep_residual(
        self, v: torch.Tensor, encoded: Sequence[Encoded], ranges: Sequence[tuple[int, int]]
    ) -> None:
        """e = v - decode(enc(v)) slice by slice, `encoded` being enc(v)'s slices: what the shards will not
        see of what this push meant to send."""
        residual = self.feedback_buffer()
        for (lo, hi), enc in zip(ranges, encoded, strict=True):
            decode(enc, out=residual[lo:hi])  # what the shard will add ...
            torch.sub(v[lo:hi], residual[lo:hi], out=residual[lo:hi])  # ... and what it will not


class FragmentSync:
    """One fragment's sync state and the mechanics of its sends and merges (see the module's docstring)."""

    def __init__(
        self, spec: Fragment, params: list[torch.Tensor], cfg: SyncConfig, num_shards: int, place: Placement
    ):
        self.index, self.spec, self.params, self.cfg, self.place = spec.index, spec, params, cfg, place
        self.ranges = slice_ranges(spec.numel, num_shards)  # the shards' slices of the flat vector
        # fp32 copy of the global parameters as of the last sync, on the CPU (pinned for async copies)
        self.mirror = place.host(spec.numel)
        _copy_into(self.views(self.mirror), params)
        self.mirror_views = self.views(self.mirror)  # where the lerp reads the mirror on the CPU
        # rounds < mirror_rounds[s] are in slice s of the mirror (what a checkpoint holds)
        self.mirror_rounds = [0] * num_shards
        self.lock = threading.Lock()  # apply jobs vs a checkpoint's copy of the mirror and its rounds
        self.tokens = 0  # since the last send: its push's weight
        self.loss = (0.0, 0)  # (sum, count) of the inner losses since the last send
        self.in_flight: int | None = None  # the round sent and not merged yet
        self.sent_at: dict[int, int] = {}  # round -> the step that sent it
        self.send_job: Future | None = None  # the latest send's job on the sync thread
        self.applied: dict[int, Future] = {}  # round -> its update is in the mirror
        self.snapshot: torch.Tensor | None = None  # host buffer of the parameters at the send, reused
        # the round whose send the snapshot holds (merge_rule "rebase" mixes against it; a round this
        # process did not send, or one sent before a restart, is mixed as it is at the merge)
        self.snapshot_round: int | None = None
        # the sync thread's outer gradient (reused) and the uplink's error-feedback residual
        self.buffers = PushBuffers(place, spec.numel)
        self._staged: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # CUDA: on the device

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' shapes as views of a flat fp32 vector."""
        out, off = [], 0
        for p in self.params:
            out.append(flat[off : off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def count(self, tokens: int, loss: float | None) -> None:
        """An inner step's tokens and loss, for the next push's weight and reported loss."""
        self.tokens += tokens
        if loss is not None:
            total, count = self.loss
            self.loss = (total + loss, count + 1)

    # --- send: a snapshot on the training thread, the outer gradient on the sync thread ----------------
    def prepare_send(self, round: int, step: int) -> tuple[Any, float, float | None]:
        """Training thread, at the send of `round` at `step`: the parameters as of now (the snapshot that
        `encode` takes), the push's weight (the tokens since the last send) and mean loss."""
        if self.send_job is not None:  # its snapshot buffer is ours again (the job is long done, normally)
            self.send_job.result()
        snapshot = self._snapshot()
        weight = float(max(1, self.tokens))
        total, count = self.loss
        loss = total / count if count else None
        self.tokens, self.loss = 0, (0.0, 0)
        self.in_flight = round
        self.sent_at[round] = step
        self.snapshot_round = round
        return snapshot, weight, loss

    def sending(self, job: Future) -> None:
        """The send's job on the sync thread (encode, push): the snapshot buffer is its until it is done."""
        self.send_job = job

    def _snapshot(self) -> Any:
        """The parameters as of now. On the CPU, copied into the fragment's buffer; on CUDA, a device-side
        copy (the sync thread brings it to the host) and the event that marks it done."""
        if self.place.cuda:
            dev = torch.empty(self.spec.numel, dtype=torch.float32, device=self.place.device)
            _copy_into(self.views(dev), self.params)
            ev = torch.cuda.Event()
            ev.record()
            return dev, ev
        buf = self._host_buffer()
        _copy_into(self.views(buf), self.params)
        return buf

    def _host_buffer(self) -> torch.Tensor:
        if self.snapshot is None:
            self.snapshot = self.place.host(self.spec.numel)
        return self.snapshot

    def _host_snapshot(self, snapshot: Any) -> torch.Tensor:
        if not self.place.cuda:
            return snapshot
        dev, ev = snapshot
        buf = self._host_buffer()
        side = self.place.side_stream()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            buf.copy_(dev, non_blocking=True)
            dev.record_stream(side)
        side.synchronize()
        return buf

    def _delta_buffer(self) -> torch.Tensor:
        return self.buffers.delta_buffer()

    @property
    def feedback(self) -> torch.Tensor | None:
        """The uplink's error-feedback residual: what the pushes so far left out (None while off)."""
        return self.buffers.feedback

    def encode(self, snapshot: Any, generator: torch.Generator) -> list[Encoded]:
        """Sync thread: the outer gradient (mirror - snapshot), encoded with the uplink codec, one Encoded
        per shard slice; with the uplink's error feedback (decay d = cfg.uplink_decay > 0) what is encoded
        is v = delta + d * e, and e becomes v - decode(enc(v)), what the shards will not see of it."""
        local = self._host_snapshot(snapshot)
        delta = outer_gradient(self.mirror, local, out=self._delta_buffer())
        cfg = self.cfg
        decay = cfg.uplink_decay
        if decay > 0:  # v = delta + d * e, in the delta buffer (free once the push is encoded)
            delta.add_(self.buffers.feedback_buffer(), alpha=decay)
        out = [
            encode(delta[lo:hi], cfg.uplink_codec, cfg.codec_block_size, cfg.uplink_rounding, generator)
            for lo, hi in self.ranges
        ]
        if decay > 0:
            self.buffers.keep_residual(delta, out, self.ranges)
        return out

    # --- merge: the update into the mirror on the sync thread, a lerp on the training thread ----------
    def apply(self, round: int, slices: Sequence[SliceUpdate]) -> int:
        """Sync thread: the round's update into the mirror, one SliceUpdate per shard slice; returns the
        bytes of the updates added."""
        if len(slices) != len(self.ranges):
            raise RuntimeError(f"update for fragment {self.index} has {len(slices)} slices")
        received = 0
        with self.lock:
            held, mirror = self.mirror_rounds, self.mirror
            for s, ((lo, hi), part) in enumerate(zip(self.ranges, slices, strict=True)):
                if part is None:  # the mirror holds this round already (fetched when we joined)
                    held[s] = max(held[s], round + 1)
                elif isinstance(part, Master):  # it holds this round's update (and any missed)
                    if part.values.numel() != hi - lo:
                        raise RuntimeError(
                            f"fetched master of fragment {self.index} has {part.values.numel()} values"
                        )
                    mirror[lo:hi] = part.values
                    held[s] = max(held[s], part.round)
                else:
                    received += self._add(round, s, [(0, part)] if isinstance(part, Encoded) else part)
        if self.place.cuda:
            self._stage(round)
        return received

    def _add(self, round: int, s: int, parts: list[tuple[int, Encoded]]) -> int:
        """The parts of an update's slice `s`, added into the mirror (the lock held); returns their bytes."""
        lo, hi = self.ranges[s]
        n = sum(p.numel for _, p in parts)
        if n != hi - lo:
            raise RuntimeError(f"update for fragment {self.index} has {n} values in a slice of {hi - lo}")
        for off, p in parts:
            add_into(p, self.mirror[lo + off : lo + off + p.numel])  # the master's fp32 addition
        self.mirror_rounds[s] = max(self.mirror_rounds[s], round + 1)
        return sum(p.nbytes for _, p in parts)

    def rebases(self, round: int) -> bool:
        """Whether the merge of `round` is a rebase: merge_rule "rebase", and the snapshot of its send is
        here."""
        return self.cfg.merge_rule == "rebase" and self.snapshot_round == round

    def _correction(self) -> torch.Tensor:
        """The rebase's correction, mirror minus the parameters at the send (the host snapshot, which
        `encode` filled), in the outer-gradient buffer: free until the fragment's next send, which comes
        after this merge, so no fragment-sized allocation per merge."""
        if self.send_job is not None:  # none after a resume from a checkpoint
            self.send_job.result()  # the push that used the buffer is through (its update is in)
        assert self.snapshot is not None, "a rebase needs the snapshot of its send (rebases)"
        return torch.sub(self.mirror, self.snapshot, out=self._delta_buffer())

    def _stage(self, round: int) -> None:
        """CUDA: what the training thread's merge needs, copied to the device: the mirror (mix), or the
        mirror minus the parameters at the send (rebase)."""
        side = self.place.side_stream()
        src = self._correction() if self.rebases(round) else self.mirror
        with torch.cuda.stream(side):
            dev = torch.empty(self.spec.numel, dtype=torch.float32, device=self.place.device)
            dev.copy_(src, non_blocking=True)
        side.synchronize()  # the pinned mirror may change again once this returns
        self._staged = (dev, self.views(dev))

    def merge(self, round: int) -> int | None:
        """Training thread, once the round's update is in the mirror: mix it into the parameters (local +=
        (1 - alpha) * (mirror - local at the send) with merge_rule "rebase", else local = lerp(local, mirror,
        1 - alpha)). Returns the steps since the round's send (None: not sent by this process)."""
        alpha = self.cfg.fragment_update_alpha
        rebase = self.rebases(round)
        if self.place.cuda:
            if self._staged is None:  # nothing was applied in this process (came with a fetch)
                self._stage(round)
            assert self._staged is not None
            dev, views = self._staged
            self._staged = None
            (rebase_local_ if rebase else merge_local_)(self.params, views, alpha)
            dev.record_stream(torch.cuda.current_stream(self.place.device))  # allocated on the side stream
        elif rebase:
            rebase_local_(self.params, self.views(self._correction()), alpha)
        else:
            merge_local_(self.params, self.mirror_views, alpha)
        self.snapshot_round = None
        self.applied.pop(round, None)
        self.in_flight = None
        return self.sent_at.pop(round, None)

    def take_mirror(self) -> None:
        """Training thread, nothing in flight: the parameters become the mirror (the run's global ones, as a
        joiner's), and the tokens and losses counted since the last send are dropped."""
        assert self.in_flight is None, "take_mirror with a round in flight"
        with self.lock:
            _copy_into(self.params, self.mirror_views)
        self.tokens, self.loss = 0, (0.0, 0)
        self._staged = None
        if self.feedback is not None:  # what the old pushes left out goes with the steps that made them
            self.feedback.zero_()

    # --- the rounds the mirror holds, and the futures that say an update is in --------------------------
    def hold_rounds(self, rounds: list[int]) -> None:
        """What the mirror holds as it is set up (a joiner's fetch): rounds[s] per shard slice."""
        with self.lock:
            self.mirror_rounds = list(rounds)

    def update_future(self, round: int) -> tuple[Future, bool]:
        """The future that says the round's update is in the mirror, and whether it was made just now (the
        engine then asks the transport for the update)."""
        fut = self.applied.get(round)
        if fut is not None:
            return fut, False
        fut = self.applied[round] = Future()
        return fut, True

    def cancel_waits(self) -> None:
        """A stop request: every merge that waits (or would wait) for an update of this fragment gives up."""
        for fut in list(self.applied.values()):
            fut.cancel()

    # --- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This fragment's part of a worker checkpoint, once the latest send's push is in the transport: a
        copy of the mirror and the rounds it holds (taken as one: updates may be added meanwhile), the round
        in flight and the steps that sent its rounds, the snapshot of the send not merged yet (round,
        copy), the tokens and losses since the last send, and the uplink's error-feedback residual (a copy,
        or None without error feedback)."""
        if self.send_job is not None:
            self.send_job.result()
        with self.lock:
            mirror, rounds = self.mirror.clone(), list(self.mirror_rounds)
        snapshot = None
        if self.snapshot_round is not None:
            assert self.snapshot is not None, "a send's snapshot is in its buffer once its job is done"
            snapshot = (self.snapshot_round, self.snapshot.clone())
        return {
            "mirror": mirror,
            "mirror_rounds": rounds,
            "in_flight": self.in_flight,
            "sent_at": dict(self.sent_at),
            "snapshot": snapshot,
            "tokens": self.tokens,
            "loss": list(self.loss),
            "feedback": None if self.feedback is None else self.feedback.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What state_dict wrote (a checkpoint written before send steps and snapshots were kept lacks them:
        nothing sent, none kept)."""
        snapshot = state.get("snapshot")
        if snapshot is not None and snapshot[1].shape != (self.spec.numel,):
            raise ValueError(
                f"the checkpoint's send snapshot of fragment {self.index} does not fit this model"
            )
        feedback = state.get("feedback")  # none before the uplink had error feedback: zeros
        if feedback is not None and (feedback.shape != (self.spec.numel,) or feedback.dtype != torch.float32):
            raise ValueError(
                f"the checkpoint's uplink error feedback of fragment {self.index} does not fit this model"
            )
        with self.lock:
            self.mirror.copy_(state["mirror"])
            self.mirror_rounds = [int(x) for x in state["mirror_rounds"]]
        loss = state["loss"]
        self.tokens, self.loss = state["tokens"], (float(loss[0]), int(loss[1]))
        in_flight = state.get("in_flight")
        self.in_flight = None if in_flight is None else int(in_flight)
        self.sent_at = {int(r): int(t) for r, t in state.get("sent_at", {}).items()}
        self.snapshot_round = None
        if snapshot is not None:
            self._host_buffer().copy_(snapshot[1])
            self.snapshot_round = int(snapshot[0])
        if feedback is not None:
            self.buffers.feedback_buffer().copy_(feedback)
        elif self.feedback is not None:
            self.feedback.zero_()


def global_state_dict(model: nn.Module, fragments: Sequence[FragmentSync]) -> dict[str, torch.Tensor]:
    """The model's state_dict with every parameter's value taken from its fragment's mirror (on the CPU,
    each parameter in its own dtype, buffers as the model holds them); a parameter under several names
    (tied weights) gets its global value under every name."""
    out = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    names_of: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(key)
    params = dict(model.named_parameters())
    for frag in fragments:
        with frag.lock:
            for e in frag.spec.entries:
                value = frag.mirror[e.offset : e.offset + e.numel].view(e.shape)
                for key in names_of.get(id(params[e.name]), [e.name]):
                    out[key] = value.to(out[key].dtype, copy=True)
    return out


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        if all(d.dtype == s.dtype and d.device == s.device for d, s in zip(dst, src, strict=True)):
            torch._foreach_copy_(dst, src)
        else:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
