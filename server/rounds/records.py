"""What a shard's checkpoint keeps of a fragment, and the checks of what it reads back: the fragment's
state (`fragment_record`, checked by `checked_fragment`) and the log of a round that closed after it
(CloseJob.record, checked by `checked_round`). One place for the format, so that a shard resumes from a
checkpoint that an earlier version wrote.

Split from server/rounds/state.py (ShardState, which saves and restores through these) by job. Pure: dicts and
tensors in, checked values or ValueError out; what it must not do: change a shard
(server/storage/checkpoint.py writes and reads the files).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.codecs import Encoded
from streamdiloco.server.rounds.jobs import ClosingRound, Push, checked_history
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.staging import MAX_WEIGHT


def fragment_record(
    fragment: int, slice: tuple[int, int], round: int, members: list[str], history: dict
) -> dict:
    """A fragment's checkpointed state but its outer optimizer's (the caller adds "outer")."""
    return {
        "fragment": fragment,
        "slice": list(slice),
        "round": round,
        "members": members,
        # what the caps and clips of the next rounds are relative to: a restart goes on bit for bit
        "history": history,
    }


def checked_fragment(
    fragment: int, saved: object, slice: tuple[int, int]
) -> tuple[dict, int, list[str], dict]:
    """A fragment's checkpointed state (`fragment_record` with "outer"), checked against this shard's slice of
    it: (outer optimizer's state, open round, members, history); ValueError if it does not fit."""
    if not isinstance(saved, dict) or not isinstance(saved.get("outer"), dict):
        raise ValueError(f"checkpoint of fragment {fragment} is not a fragment's state")
    if saved.get("fragment") != fragment or list(saved.get("slice", [])) != list(slice):
        raise ValueError(
            f"checkpoint of fragment {saved.get('fragment')} slice {saved.get('slice')} does not fit "
            f"fragment {fragment} slice {list(slice)}"
        )
    lo, hi = slice
    outer = saved["outer"]
    try:
        tensors = [("master", outer["master"]), ("residual", outer["residual"])]
        for s in outer["sgd"]["state"].values():
            if s.get("momentum_buffer") is not None:
                tensors.append(("momentum", s["momentum_buffer"]))
        rnd = int(saved["round"])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(
            f"checkpoint of fragment {fragment} is incomplete ({type(e).__name__}: {e})"
        ) from None
    for name, t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (hi - lo,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"checkpoint of fragment {fragment} holds a {name} of {got}, want ({hi - lo},)")
    if rnd < 0:
        raise ValueError(f"checkpoint of fragment {fragment} has round {rnd}")
    members = saved.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ValueError(f"checkpoint of fragment {fragment} has a malformed member list")
    history = checked_history(saved.get("history", {"weights": [], "norms": []}))
    if history is None:
        raise ValueError(f"checkpoint of fragment {fragment} has a malformed history of weights, norms")
    return outer, rnd, members, history


def checked_round(
    record: object, fragment: int, number: int, numel: int, assembly: Callable[[], Assembly]
) -> ClosingRound:
    """The log of round `number` of the fragment's slice of `numel` values (CloseJob.record), its pushes
    assembled again (`assembly`: an empty one) and checked: what a CloseJob is made of again. ValueError when
    the record is damaged or is of another round."""
    if not isinstance(record, dict):
        raise ValueError(f"it is a {type(record).__name__}, not a round's record")
    try:
        return _logged_round(record, number, numel, assembly)
    except (KeyError, TypeError, AttributeError, ValueError, ChunkError) as e:
        raise ValueError(
            f"the log of fragment {fragment} round {number} is damaged ({type(e).__name__}: {e})"
        ) from None


def _logged_round(record: dict, number: int, numel: int, assembly: Callable[[], Assembly]) -> ClosingRound:
    if int(record["round"]) != number:
        raise ValueError(f"it is of round {record['round']}, the open round is {number}")
    pushes = []
    for p in record["pushes"]:
        asm = assembly()
        parts = p["parts"]
        for seq, part in enumerate(parts):
            enc = Encoded(
                str(part["codec"]),
                int(part["numel"]),
                part["payload"],
                part["scales"],
                int(part["block_size"]),
            )
            asm.add(seq, int(part["offset"]), numel, enc, seq == len(parts) - 1)
        if not asm.done:
            raise ValueError(f"the push of {p['worker']} is incomplete")
        weight = float(p["weight"])
        if not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"a push's weight is {weight}")
        # rounds logged before the defenses: taken as reported, unclipped
        share, scale = float(p.get("share", weight)), float(p.get("scale", 1.0))
        mult = float(p.get("mult", share * scale))
        if not (0 < share <= weight and 0 <= scale <= 1 and 0 <= mult <= share):
            raise ValueError(f"a push's share {share}, scale {scale} or mult {mult} is out of range")
        pushes.append(Push(str(p["worker"]), weight, asm, 0.0, share, scale, mult))
    partial = record["partial"]
    if partial is not None and not (
        isinstance(partial, torch.Tensor) and partial.dtype == torch.float64 and partial.shape == (numel,)
    ):
        raise ValueError("its partial sum is not an fp64 tensor of the slice's length")
    weight = float(record["weight"])
    contributors = tuple(str(c) for c in record["contributors"])
    mean_loss = None if record["mean_loss"] is None else float(record["mean_loss"])
    why = str(record["why"])
    history = checked_history(record.get("history", {"weights": [], "norms": []}), rounds=False)
    if history is None:
        raise ValueError("its weights and norms are malformed")
    name, trim, iters = record.get("aggregator", ("mean", 0.0, 1))
    aggregator = (str(name), float(trim), int(iters))
    RobustConfig(aggregator=aggregator[0], trim=aggregator[1], center_iters=aggregator[2])  # checks
    return ClosingRound(
        number=number,
        why=why,
        pushes=pushes,
        partial=partial,
        weight=weight,
        contributors=contributors,
        mean_loss=mean_loss,
        aggregator=aggregator,
        history=history,
    )
