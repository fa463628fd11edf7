"""The worker's checkpoint: what it holds, where it is read and written, and when a worker resumes from it;
and the digests (mirror, parameters, inner optimizer) that compare a worker's state with the shards' and
its ranks'.

A checkpoint is one torch file per worker (`WorkerConfig.checkpoint_path`), written atomically: the format
number, the worker's name and data rank, the key of the settings it must be resumed with (`checkpoint_key`),
the model's parameters, the inner optimizer, the data stream, the engine (with its fragments' mirrors,
send snapshots and, with --uplink-feedback, the uplink's error-feedback residuals: a checkpoint written
before those loads with zeros) and the links. `resume_from`
decides at start-up whether to resume (--resume, --auto-resume; rank 0's file for a torchrun group) and
`load_checkpoint` refuses, in one line, a file written with other settings.

What this module must not do: train, talk to a shard, or import worker/run.py at run time (the process
imports this, and examples import the digests without the worker process).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from streamdiloco.common.atomic import atomic_write
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import tensor_digest

if TYPE_CHECKING:
    from streamdiloco.worker.config import WorkerConfig
    from streamdiloco.worker.engine import SyncEngine
    from streamdiloco.worker.group import RankGroup

log = logging.getLogger("streamdiloco.worker")


def mirror_digests(engine: SyncEngine) -> list[list[str]]:
    """Hash of each (fragment, shard slice) of the mirror: equal to the shards' master_hash when in sync."""
    return [[tensor_digest(f.mirror[lo:hi]) for lo, hi in f.ranges] for f in engine.fragments]


def params_digest(model: torch.nn.Module) -> str:
    """Hash of the model's (local) parameters, all of them in order: equal on every rank of a group worker."""
    return tensor_digest(torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()]))


def optimizer_digest(opt: torch.optim.Optimizer) -> str:
    """Hash of the inner optimizer's state tensors (AdamW's moments): equal on a group worker's ranks only
    if every step's averaged gradients were (no broadcast ever makes them equal)."""
    tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    flat = [t.detach().reshape(-1).float().cpu() for t in tensors]
    return tensor_digest(torch.cat(flat) if flat else torch.zeros(0))


CHECKPOINT_FORMAT = 2  # 2: the engine keeps the rounds its mirror holds (links no longer do)


def checkpoint_key(cfg: WorkerConfig, ranks: int = 1) -> dict:
    """What must be the same for a checkpoint to be resumed by this configuration. The batch is the
    worker's, all its ranks' and micro-batches together: 2 ranks of --batch-size 8 may resume 1 rank's of
    16, and back, as may --grad-accum 2 of --batch-size 8."""
    return {
        "model": cfg.model.model,
        "block_size": cfg.model.block_size,
        "seed": cfg.model.seed,
        "steps": cfg.run.steps,
        "batch_size": cfg.run.batch_size * ranks * cfg.worker.grad_accum,
        "data": cfg.run.data,
        "blocks_path": cfg.model.blocks_path,
        "fragments": cfg.model.fragments,
        "sync": cfg.sync.to_dict(),
    }


def _read_checkpoint(path: Path, flag: str = "--resume") -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(
            f"{flag}: no checkpoint at {path} (give the --name the worker had, or --checkpoint PATH)"
        ) from None
    except Exception as e:  # torch raises many kinds for damaged files
        raise ValueError(f"{flag}: {path} is not a worker checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{flag}: {path} is not a worker checkpoint of format {CHECKPOINT_FORMAT}")
    return ck


def checkpoint_name(path: str, flag: str = "--resume") -> str:
    """The worker name a checkpoint was written under."""
    return str(_read_checkpoint(Path(path), flag)["name"])


def load_checkpoint(cfg: WorkerConfig, ranks: int = 1) -> dict:
    """Read and check this worker's checkpoint; ValueError (one line) if it cannot be resumed."""
    path = cfg.checkpoint_path
    flag = "--resume" if cfg.resume else "--auto-resume"
    ck = _read_checkpoint(path, flag)
    want = checkpoint_key(cfg, ranks)
    key = dict(ck["key"])
    if isinstance(key.get("sync"), dict):  # written before a sync field existed: it had its default then
        # (sync_schedule's was "fixed" until issue 27 made "adaptive" the default)
        key["sync"] = {**SyncConfig().to_dict(), "sync_schedule": "fixed", **key["sync"]}
    changed = sorted(k for k in want if key.get(k) != want[k])
    if changed:
        raise ValueError(
            f"{flag}: {path} was written with other settings ({', '.join(changed)}): "
            "resume with the same flags, or remove the checkpoint to start this worker anew"
        )
    return ck


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save, atomically: a crash while writing leaves the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(state, f))


def checkpoint_state(cfg: WorkerConfig, ranks: int, stats: dict[str, Any], **parts: Any) -> dict:
    """A checkpoint's dict, to give save_checkpoint: this worker's identity and settings key, `stats`, and
    the state dicts in `parts` (params, optimizer, data, engine, links)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "name": cfg.name,
        "rank": cfg.data_rank,
        "key": checkpoint_key(cfg, ranks),
        **parts,
        "stats": stats,
    }


def resume_from(cfg: WorkerConfig, group: RankGroup | None) -> dict | None:
    """The checkpoint to resume from (rank 0's: other nodes may not see its file), or None: a new worker."""
    resuming = cfg.resume or (cfg.auto_resume and cfg.checkpoint_path.exists())
    if group is not None:
        resuming = group.share(resuming)
    if cfg.auto_resume and not cfg.resume:
        where = cfg.checkpoint_path
        log.info(
            "%s: %s", cfg.name, f"resuming from {where}" if resuming else f"no checkpoint at {where} yet"
        )
    if not resuming or (group is not None and not group.leads):
        return None
    resume = load_checkpoint(cfg, group.size if group is not None else 1)
    if resume["name"] != cfg.name:
        raise ValueError(
            f"{'--resume' if cfg.resume else '--auto-resume'}: {cfg.checkpoint_path} belongs to worker "
            f"{resume['name']!r}, not {cfg.name!r}"
        )
    return resume
