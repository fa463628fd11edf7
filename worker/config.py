"""One worker process's config, `WorkerConfig`: the run's settings sections and this process's own fields.

Torch-free and light (the CLI builds the worker's flags from its fields' metadata, worker/checkpoint.py types
with it): it must not import torch, the training loop (worker/run.py) or the wire; `__post_init__` checks
addresses and TLS files only.
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


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process's config: the run's settings sections (common/config.py: each a section of the
    config file, its fields flags) and this process's own fields, which differ from one worker to the next
    and stay out of the file (their flags are made from the fields' metadata: cli/flags.py)."""

    servers: tuple[str, ...] = field(metadata={"help": "every shard as HOST:PORT, comma-separated"})
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
    # this process's own fields, each a flag of `streamdiloco worker` (cli/flags.py's add_own_flags), in
    # this order, with the help below
    name: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        metadata={"help": "a unique name for this worker (default: host-pid)"},
    )
    rank: int | None = field(
        default=None, metadata={"help": "seeds the data stream (default: from the name)"}
    )
    token: str = field(
        default="", metadata={"help": "this worker's token, or the run's shared one (--token-file)"}
    )
    tls_ca: str | None = field(  # None: plaintext (loopback)
        default=None,
        metadata={
            "help": "connect over TLS, trusting the run's CA (ca.pem) for the shards' certificates",
            "metavar": "PEM",
        },
    )
    tls_cert: str | None = field(
        default=None,
        metadata={"help": "mutual TLS: this worker's certificate (NAME.pem)", "metavar": "PEM"},
    )
    tls_key: str | None = field(
        default=None, metadata={"help": "mutual TLS: its private key (NAME.key)", "metavar": "PEM"}
    )
    summary: str | None = field(
        default=None, metadata={"help": "write the final figures (JSON) here", "metavar": "PATH"}
    )
    save_global: str | None = field(
        default=None, metadata={"help": "torch.save the global fragments here", "metavar": "PATH"}
    )
    checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "this worker's checkpoint (default: checkpoints/NAME.pt), written every "
            "--checkpoint-every steps and when it stops",
            "metavar": "PATH",
        },
    )
    resume: bool = field(
        default=False,
        metadata={"help": "continue from the checkpoint (with the same --name, or --checkpoint PATH)"},
    )
    auto_resume: bool = field(
        default=False,
        metadata={
            "help": "resume if the checkpoint exists, else join as a new worker (for restart policies)"
        },
    )
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "serve Prometheus metrics on this port at /metrics (default: none; 0 picks a free port)"
        },
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address for --metrics-port (0.0.0.0: every interface, with --insecure: the metrics are "
            "served without TLS or a token)"
        },
    )
    wandb_run_name: str | None = field(
        default=None,
        metadata={
            "help": "with --wandb-project: this worker's W&B run name (default: its --name)",
            "metavar": "NAME",
        },
    )

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("--servers: give at least one shard as HOST:PORT")
        for target in self.servers:
            parse_target(target)  # one-line error for a malformed address
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        from streamdiloco.common.tls import client_tls  # here: grpc and cryptography stay out of --help

        client_tls(self.tls_ca, self.tls_cert, self.tls_key)  # one-line errors for missing or bad files

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint) if self.checkpoint else Path("checkpoints") / f"{self.name}.pt"

    @property
    def data_rank(self) -> int:
        return self.rank if self.rank is not None else zlib.crc32(self.name.encode()) % 100_000
