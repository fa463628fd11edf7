"""A worker that is a torch.distributed process group: the ranks of one site train as ONE worker.

`torchrun --nproc-per-node 8 -m streamdiloco worker ...` (or your own loop with `connect_group()`) makes
one member of the run: one Join, one name, one set of gRPC sessions, one checkpoint. Its inner steps are
data-parallel across the ranks (each rank a slice of the worker's batch, gradients averaged by DDP).

How the sync engine spans the ranks: rank 0 of the group owns the SyncEngine and the network, and the other
ranks never talk to the shards. After every inner step, on every rank (`GroupEngine.step`):
1. one all_reduce of four numbers: the tokens and losses of the step, and whether any rank was asked to stop;
2. rank 0 does the engine's step (snapshots and sends, merges), exactly as a one-process worker;
3. rank 0 broadcasts which fragments it merged (a few integers), then those fragments' parameters as one flat
   vector, which every other rank writes into its own: all ranks' parameters are rank 0's, bit for bit.
Why not every rank pushing and merging its share of each slice (as FSDP shards parameters)? With DDP every
rank holds the whole model already, so one rank's engine sees everything; a fragment crosses the WAN once per
site either way, and the broadcast runs over the site's own links (NVLink, InfiniBand), which are 100-1000x
the WAN's; the shards' protocol, the membership, the identity and the checkpoint stay as they are (the group
is one member), and a single writer keeps the mirror bit-identical to the masters with no agreement between
ranks. The cost is one broadcast of a fragment per merge (every H/P steps), and the rank-0 host's memory for
the mirror, as in a one-process worker.

Failure: a rank that dies breaks the collectives of the others (gloo notices a closed connection at once;
NCCL at the group's timeout, and torchrun stops the other ranks as soon as one exits); each rank then stops
with one line (GroupError) and a non-zero status, and the worker resumes from rank 0's checkpoint. gloo on
the CPU, NCCL on CUDA devices (the NCCL path is not tested here: the test machines have no GPU).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, fragment_params
from streamdiloco.worker.engine import StopRequested, SyncEngine

log = logging.getLogger("streamdiloco.worker")

GO, STOP, FAILED = 0, 1, 2  # what rank 0 tells the others after each step


class GroupError(RuntimeError):
    """The worker's process group broke (a rank died, hung or failed): this rank cannot go on."""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _why(e: BaseException) -> str:
    """A collective's error, short: gloo's "[.../pair.cc:553] Connection closed by peer [ADDR]:PORT. This is
    typically caused by ..." becomes "Connection closed by peer [ADDR]:PORT"."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", _first_line(e))
    return text.split(". ")[0].rstrip(".")


def is_collective_error(e: BaseException) -> bool:
    """Whether an error raised by a step comes from the process group (DDP's all-reduce in backward(), ...)
    rather than from the model: gloo and NCCL raise RuntimeErrors whose text says so."""
    if isinstance(e, GroupError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "ProcessGroup")
    )


@dataclass(frozen=True)
class RankGroup:
    """The torch.distributed facts a group worker needs: its rank and size in the group, the global rank of
    the group's rank 0 (the source of broadcasts) and the device collectives use (CUDA for NCCL)."""

    rank: int
    size: int
    src: int
    device: torch.device
    pg: Any = None  # the ProcessGroup; None: the default group

    @classmethod
    def of(cls, pg: Any = None) -> RankGroup:
        """The group `pg` (default: the default group, which must be initialized)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "no process group: call torch.distributed.init_process_group() first (torchrun sets its "
                "environment), or use streamdiloco.worker.join.connect() for a one-process worker"
            )
        backend = dist.get_backend(pg)
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(
            rank=dist.get_rank(pg),
            size=dist.get_world_size(pg),
            src=dist.get_global_rank(pg, 0) if pg is not None else 0,
            device=device,
            pg=pg,
        )

    @property
    def leads(self) -> bool:
        """Rank 0: the one that joins, syncs, logs and writes the checkpoint."""
        return self.rank == 0

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a collective's failure into one line that says what to do."""
        try:
            yield
        except GroupError:
            raise
        except Exception as e:
            if not is_collective_error(e):
                raise
            raise GroupError(
                f"rank {self.rank} of {self.size}: the worker's process group broke during {what} "
                f"({_why(e)}): another rank died or hung; restart the worker (its ranks resume from "
                "rank 0's checkpoint with --auto-resume)"
            ) from None

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled: for small things, and state dicts at start)."""
        box = [obj if self.leads else None]
        with self.guard("start-up"):
            dist.broadcast_object_list(box, src=self.src, group=self.pg, device=self.device)
        return box[0]


def group_from_env(device: str, timeout: float) -> tuple[RankGroup | None, str]:
    """torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): the default process
    group, initialized with NCCL for a CUDA `device` (each rank takes cuda:LOCAL_RANK) and gloo otherwise,
    collectives giving up after `timeout` seconds. (None, device) when there is no group (WORLD_SIZE unset or
    1). Returns the group and the device this rank trains on."""
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        return None, device
    rank, local = _env_int("RANK", -1), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < size:
        raise ValueError(
            f"RANK={os.environ.get('RANK')} with WORLD_SIZE={size}: start the ranks with torchrun"
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE={size} but {name} is not set: start the ranks with torchrun")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device (use --device cpu: gloo)")
        if dev.index is None:
            dev = torch.device("cuda", local)  # one GPU per rank, as torchrun's local ranks number them
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return RankGroup.of(None), str(dev)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment's {name}={value!r} is not an integer") from None


def batch_slice(x: torch.Tensor, group: RankGroup | None) -> torch.Tensor:
    """This rank's slice of the worker's batch (rows rank*b .. rank*b + b of size*b): together the ranks
    train on exactly the batch a one-rank worker with size*b rows draws from the same stream."""
    if group is None:
        return x
    if x.shape[0] % group.size:
        raise ValueError(
            f"a batch of {x.shape[0]} rows does not split over {group.size} ranks: "
            f"draw a multiple of {group.size} rows"
        )
    b = x.shape[0] // group.size
    return x[group.rank * b : (group.rank + 1) * b]


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose parameter names are the model's: the shards know those);
    FSDP-wrapped models are refused, with what to do instead."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module
    kind = type(model).__name__
    if kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
        raise ValueError(
            "an FSDP-wrapped model: connect_group() syncs whole fragments from rank 0, which needs every "
            "parameter whole on each rank; wrap the model in DistributedDataParallel instead (FSDP is not "
            "supported yet)"
        )
    return model


class GroupEngine:
    """What every rank of a group worker calls `step(tokens, loss)` on right after every inner optimizer
    step (and `close()` at the end). On rank 0 it drives `engine` (the SyncEngine); on every rank it keeps
    the parameters equal to rank 0's (see the module's docstring). `tokens` and `loss` are this rank's
    own: the shards are told the group's (their sum, their mean)."""

    def __init__(
        self, group: RankGroup, model: nn.Module, engine: SyncEngine | None, layout: FragmentLayout, step: int
    ):
        self.group, self.model, self.engine, self.layout = group, model, engine, layout
        self.step_count = step
        self.total_steps = engine.total_steps if engine is not None else None
        self.params = [fragment_params(model, f) for f in layout.fragments]
        self._merged: list[int] = []
        if engine is not None:
            engine.on_merge(merged=self._merged.append)
        self.broadcast_bytes = 0  # parameters sent (rank 0) or received over the group's links
        self.group_seconds = 0.0  # in the group's collectives (waiting for the other ranks included)

    @property
    def size(self) -> int:
        return self.group.size

    def step(self, tokens: int = 0, loss: float | None = None, stop: bool = False) -> None:
        """One inner step done on every rank. `stop`: this rank was asked to stop (SIGTERM): the group then
        stops after this step, every rank raising StopRequested (rank 0's checkpoint holds the step)."""
        g = self.group
        t0 = time.perf_counter()
        with g.guard(f"step {self.step_count + 1}'s sync"):
            sums = torch.tensor(
                [float(tokens), float(loss or 0.0), float(loss is not None), float(stop)],
                dtype=torch.float64,
                device=g.device,
            )
            dist.all_reduce(sums, group=g.pg)
            total, loss_sum, losses, stops = sums.tolist()
        self.group_seconds += time.perf_counter() - t0
        self.step_count += 1
        error: BaseException | None = None
        status = STOP if stops > 0 else GO
        if self.engine is not None:
            try:
                self.engine.step(tokens=int(total), loss=loss_sum / losses if losses else None)
            except StopRequested:
                status = STOP
            except Exception as e:  # the others must hear of it, not wait for a broadcast that never comes
                status, error = FAILED, e
        self._share_merges(status)
        if error is not None:
            raise error
        if status == STOP:
            raise StopRequested()

    def drain(self) -> None:
        """Every rank, at the end of training: rank 0's engine merges what is still in flight."""
        error: BaseException | None = None
        status = GO
        if self.engine is not None:
            try:
                self.engine.drain()
            except Exception as e:
                status, error = FAILED, e
        self._share_merges(status)
        if error is not None:
            raise error

    def _share_merges(self, status: int) -> None:
        """Rank 0's status and the fragments it merged since the last call, to every rank: then the
        parameters of those fragments, as one flat vector."""
        g = self.group
        n = self.layout.num_fragments
        t0 = time.perf_counter()
        with g.guard(f"step {self.step_count}'s merge broadcast"):
            head = torch.zeros(2 + n, dtype=torch.int64, device=g.device)
            if g.leads:
                head[0] = status
                # the schedule's step: with --sync-schedule adaptive one takes several inner steps, which
                # rank 0's engine counts (common/pace.py); every rank follows its count (lr, the end)
                head[1] = self.engine.step_count if self.engine is not None else self.step_count
                for f in self._merged:
                    head[2 + f] = 1
                self._merged.clear()
            dist.broadcast(head, src=g.src, group=g.pg)
            got = head.tolist()
            self.step_count = got[1]
            merged = [f for f in range(n) if got[2 + f]]
            if merged:
                self._broadcast_params(merged)
        self.group_seconds += time.perf_counter() - t0
        if got[0] == FAILED and not g.leads:
            raise GroupError(
                f"rank {g.rank} of {g.size}: rank 0 failed at step {self.step_count} (its output says why); "
                "this rank stops too"
            )
        if got[0] == STOP and self.engine is None:
            raise StopRequested()

    def _broadcast_params(self, fragments: list[int]) -> None:
        params = [p for f in fragments for p in self.params[f]]
        if self.group.leads:
            flat = torch.cat([p.detach().reshape(-1).to(self.group.device, torch.float32) for p in params])
        else:
            numel = sum(p.numel() for p in params)
            flat = torch.empty(numel, dtype=torch.float32, device=self.group.device)
        dist.broadcast(flat, src=self.group.src, group=self.group.pg)
        self.broadcast_bytes += flat.numel() * 4
        if not self.group.leads:
            _write_flat(flat, params)

    def share_all(self) -> None:
        """Rank 0's parameters, every fragment, to every rank (at the start: the fetched masters, or the
        checkpoint's parameters on a resume)."""
        with self.group.guard("start-up"):
            for f in range(self.layout.num_fragments):
                self._broadcast_params([f])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _write_flat(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()


def connect_group(
    model: nn.Module,
    servers: list[str] | str,
    sync: SyncConfig | None = None,
    process_group: Any = None,
    connect: Callable[..., SyncEngine] | None = None,
    **kwargs: Any,
) -> GroupEngine:
    """Join a run as one worker made of a process group's ranks; call it on every rank, with the same
    arguments. `model` is the rank's model, bare or wrapped in DistributedDataParallel (the group is then
    DDP's unless `process_group` is given; default: the default group). Rank 0 joins as
    `streamdiloco.worker.join.connect()` does (`kwargs` are its: total_steps, name, token, seed, resume,
    ...; the other ranks ignore them); every rank then holds rank 0's parameters. Call the returned
    GroupEngine's `step(tokens, loss)` after every `inner_optimizer.step()` on every rank, and `close()`.
    Feed each rank its own slice of the worker's batch (`batch_slice`)."""
    from streamdiloco.worker.join import connect as connect_one

    module = unwrap(model)
    if process_group is None and module is not model:
        process_group = getattr(model, "process_group", None)
    group = RankGroup.of(process_group)
    engine: SyncEngine | None = None
    info: dict[str, Any]
    if group.leads:
        try:
            engine = (connect or connect_one)(module, servers, sync, **kwargs)
            info = {"error": None, "layout": engine.layout, "step": engine.step_count, "stop": False}
        except StopRequested:
            info = {"error": None, "stop": True}
        except BaseException as e:
            group.share({"error": f"rank 0 could not join the run: {_first_line(e)}"})
            raise
        if engine is not None:
            try:  # a resumed step's syncs that a stop interrupted: before the parameters are shared
                engine.finish_step()
            except StopRequested:
                info["stop"] = True
            except BaseException as e:  # the other ranks hear why, and the engine's threads end
                group.share({"error": f"rank 0 could not finish its resumed step: {_first_line(e)}"})
                engine.close()
                raise
    try:
        info = group.share(info if group.leads else None)
        if info["error"] is not None:
            raise GroupError(f"rank {group.rank} of {group.size}: {info['error']}")
        if info["stop"]:
            raise StopRequested()
        ge = GroupEngine(group, module, engine, info["layout"], info["step"])
        ge.share_all()
        return ge
    except BaseException:
        if engine is not None:
            engine.close()
        raise
