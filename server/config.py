"""One shard's settings as one object, `ShardConfig`: the run's sections that every shard of a run shares
(the model, Streaming DiLoCo's settings, the round policy, the defenses, the limits, the link, the data
pieces) and this process's own fields (its place in the run, where it starts from, its checkpoint, where
it listens, its credentials), each declared and checked once, here or in its section's dataclass.

`streamdiloco server` makes one from its flags and config file (cli/), tests and library users write one;
`server.startup.build_shard` turns it into a running shard. What this module must not do: import torch or
touch a file: a bad setting is refused in one line before anything loads or listens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from streamdiloco.common.config import ModelSettings, PieceSettings, ShardSettings, SyncConfig
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.tls import ServerTLS
from streamdiloco.server.observe.run_view import Peers
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.rule import RoundRule
from streamdiloco.server.trust.auth import Auth, WorkersFile
from streamdiloco.server.trust.bounds import Limits

FROM_WORKER = "from-worker"  # --init from-worker: the first worker's layout and parameters
INIT_TIMEOUT = 30.0  # --init-timeout: seconds an upload may go without sending values before it is refused
# --init-min-rate: bytes of values a second an upload must average, past its first --init-timeout seconds, to
# keep the only upload slot. 16 KiB/s is 131 kbit/s: an honest upload over a 1 Mbit/s link (122 KiB/s) keeps
# 7.6 times that, and a worker gives up on its own upload below 512 kbit/s (worker/bootstrap.py) long before
# the shard would; a trickle of one value per --init-timeout falls behind within the first one.
INIT_MIN_RATE = 16384.0


def _own(default: object, help: str, **more: object) -> object:
    """A process's own field: its default, and its flag's help (and metavar) beside it."""
    return field(default=default, metadata={"help": help, **more})


@dataclass(frozen=True)
class ShardConfig:
    """Shard `shard` of `num_shards` (see the module's docstring). With `has_model` the shard builds the
    model from `model` (the same factory, seed and context length as the workers); without it the model
    comes from `init` (a file: names, shapes and values) or from the first worker (`init` "from-worker")."""

    # --- the run's sections (one section of the config file each) ------------------------------------------
    model: ModelSettings = field(default_factory=ModelSettings)
    sync: SyncConfig = field(default_factory=SyncConfig)
    server: ShardSettings = field(default_factory=ShardSettings)  # the round policy and the chunk size
    robust: RobustConfig = field(default_factory=RobustConfig)
    limits: Limits = field(default_factory=Limits)
    link: LinkSettings = field(default_factory=LinkSettings)
    pieces: PieceSettings = field(default_factory=PieceSettings)

    # --- this process's own -------------------------------------------------------------------------------
    shard: int = _own(0, "this shard's index s (default 0)")  # type: ignore[assignment]
    num_shards: int = _own(1, "S, the number of shards (default 1)")  # type: ignore[assignment]
    has_model: bool = True  # False: the model is the --init file's, or the first worker's
    # where it listens (serve()): gRPC for workers, HTTP for health, metrics, status and the dashboard
    host: str = _own("127.0.0.1", "address to listen on (0.0.0.0 for all; default %(default)s)")  # type: ignore[assignment]
    port: int = _own(7070, "gRPC port, 0 picks a free one (default %(default)s)")  # type: ignore[assignment]
    http_port: int | None = _own(8080, "HTTP status port (default %(default)s)")  # type: ignore[assignment]
    ready_file: str | None = _own(None, "write the bound ports here (JSON) once serving")  # type: ignore[assignment]
    init: str | None = _own(  # type: ignore[assignment]
        None,
        "start from these parameters: a state_dict saved with torch.save(model.state_dict(), PATH), or "
        "a safetensors file from `streamdiloco export`. Without --model the file is the model: names, "
        "shapes, dtypes and values come from it, the blocks from its fingerprint, --blocks-path or the "
        "names (the log says which). `--init from-worker`: no model and no file: the first worker to join "
        "sends its layout and parameters (written to the checkpoint at once; every later worker must match)",
        metavar="PATH",
    )
    init_expect: str | None = _own(  # type: ignore[assignment]
        None,
        "with --init from-worker: take only an upload of these starting parameters, named by their init "
        "hash (64 hex digits: `streamdiloco init-hash` prints it for a model and seed); any other is refused",
        metavar="SHA256",
    )
    init_timeout: float = _own(  # type: ignore[assignment]
        INIT_TIMEOUT,
        "with --init from-worker: an upload that sends no values for this long is refused and frees the "
        "only upload slot; also the grace before --init-min-rate counts (default %(default)s)",
        metavar="SECONDS",
    )
    init_min_rate: float = _own(  # type: ignore[assignment]
        INIT_MIN_RATE,
        "with --init from-worker: an upload must have sent this many bytes of values a second, on average, "
        "once its first --init-timeout seconds have passed; one that falls behind is refused and frees the "
        "slot (with --init-expect, for the next pinned upload waiting in line). The default, 131 kbit/s, is "
        "an eighth of a 1 Mbit/s link (default %(default)s)",
        metavar="BYTES_PER_S",
    )
    checkpoint_dir: str | None = _own(  # type: ignore[assignment]
        None,  # None here: no checkpoint (a restart starts over)
        "written every round and on shutdown; a shard started again resumes from it "
        "(default: checkpoints/shard-S-of-N)",
        metavar="DIR",
    )
    fresh: bool = _own(False, "start a new run even if --checkpoint-dir holds one (replaces it)")  # type: ignore[assignment]
    http_host: str | None = None  # where HTTP listens (default: host; None for http_port: no HTTP)
    tls: ServerTLS | None = None  # gRPC and HTTP over TLS (mutual with a client CA)
    peers: Peers | None = None  # the run's shards, for the dashboard's run view (default: this one alone)
    # credentials: who may join, and the read token of HTTP (the CLI builds them from its flags)
    auth: Auth = field(default_factory=Auth)
    workers_file: WorkersFile | None = None  # re-read when it changes, or on SIGHUP: revocation

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard index {self.shard} is outside [0, {self.num_shards - 1}]")
        for flag, port in (("--port", self.port), ("--http-port", self.http_port or 0)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be 0..65535, got {port}")
        RoundRule.of(self.server, self.sync.sync_every)  # the round rule's own checks (--min-workers)
        self.robust.check_codec(self.sync.uplink_codec)  # no trimmed mean of sparse pushes
        if self.init_expect is not None:
            if self.init != FROM_WORKER:
                raise ValueError(
                    "--init-expect pins the first worker's upload: it goes with --init from-worker"
                )
            if not re.fullmatch(r"[0-9a-fA-F]{64}", self.init_expect.strip()):
                raise ValueError(
                    "--init-expect takes an init hash, 64 hex digits (`streamdiloco init-hash` prints it), "
                    f"got {self.init_expect[:80]!r}"
                )
        if not 0 < self.init_timeout < float("inf"):
            raise ValueError(f"--init-timeout must be a positive number of seconds, got {self.init_timeout}")
        if not 0 < self.init_min_rate < float("inf"):
            raise ValueError(
                f"--init-min-rate must be a positive number of bytes a second, got {self.init_min_rate}"
            )
        if not self.has_model and not self.init:
            raise ValueError("give the model (--model), its parameters (--init FILE) or --init from-worker")
        if self.init == FROM_WORKER and (self.has_model or self.model.blocks_path is not None):
            raise ValueError("--init from-worker takes the model from the first worker: leave out --model")
        if not self.has_model and self.init != FROM_WORKER and self.model.fragments:
            raise ValueError("--fragments needs the model (--model): a file's layout is its blocks'")

    @property
    def rule(self) -> RoundRule:
        """When the shard's rounds close (server/rounds/rule.py), from the [server] section and H."""
        return RoundRule.of(self.server, self.sync.sync_every)
