"""One worker process's config, `WorkerConfig`: the run's settings sections and this process's own fields.

Torch-free (the CLI builds its flags from it, worker/checkpoint.py types with it): it must not import
torch, the training loop (worker/run.py) or the wire; `__post_init__` checks addresses and TLS files only.
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from streamdiloco.common.config import (
    InnerConfig,
    ModelSettings,
    PieceSettings,
    RunSettings,
    SyncConfig,
    WorkerSettings,
)
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.ports import parse_target
from streamdiloco.common.tls import client_tls


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process's config: the run's settings sections (common/config.py: each a section of the
    config file, its fields flags) and this process's own fields, which differ from one worker to the next
    and stay out of the file (cli/cli.py declares their flags)."""

    servers: tuple[str, ...]
    model: ModelSettings = field(default_factory=ModelSettings)
    run: RunSettings = field(default_factory=RunSettings)
    sync: SyncConfig = field(default_factory=SyncConfig)
    # the fields of `sync` the user set; every other one is taken from the shard at Join (see connect());
    # None: those in which `sync` differs from SyncConfig()'s defaults
    sync_set: frozenset[str] | None = None
    inner: InnerConfig = field(default_factory=InnerConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    link: LinkSettings = field(default_factory=LinkSettings)  # this end of every connection to the shards
    pieces: PieceSettings = field(default_factory=PieceSettings)  # --data-pieces: shard 0 assigns the data
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    rank: int | None = None  # seeds this worker's data stream; default: derived from the name
    token: str = ""
    summary: str | None = None  # write the summary JSON here
    save_global: str | None = None  # torch.save the final global fragments (the mirror) here
    checkpoint: str | None = None  # where this worker's checkpoint goes (default: checkpoints/<name>.pt)
    resume: bool = False  # start from the checkpoint instead of joining as a new worker
    auto_resume: bool = False  # resume if the checkpoint exists, else join as a new worker (restarts)
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: any free port)
    metrics_host: str = "127.0.0.1"
    tls_ca: str | None = None  # TLS to the shards, trusting this CA (PEM); None: plaintext (loopback)
    tls_cert: str | None = None  # mutual TLS: this worker's certificate and key (PEM)
    tls_key: str | None = None
    wandb_run_name: str | None = None  # with --wandb-project: this worker's run's name (default: its name)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("--servers: give at least one shard as HOST:PORT")
        for target in self.servers:
            parse_target(target)  # one-line error for a malformed address
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        client_tls(self.tls_ca, self.tls_cert, self.tls_key)  # one-line errors for missing or bad files

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint) if self.checkpoint else Path("checkpoints") / f"{self.name}.pt"

    @property
    def data_rank(self) -> int:
        return self.rank if self.rank is not None else zlib.crc32(self.name.encode()) % 100_000
