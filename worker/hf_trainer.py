"""`transformers.Trainer` as one worker of a Streaming DiLoCo run: `StreamingDiLoCoCallback`.

    from streamdiloco.worker.hf_trainer import StreamingDiLoCoCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[StreamingDiLoCoCallback("shard0:7070,shard1:7070", total_steps=2000)])
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

At the start of training the callback joins every shard with `connect()` (the model's parameters become the
run's global ones; a run in progress is joined at its step), after every optimizer step (after gradient
accumulation, so once per Trainer step) it calls the engine's hook, and at the end it closes the sessions.
The Trainer keeps its own optimizer, schedule, data and checkpoints: the callback adds the engine's state to
each checkpoint folder (`streamdiloco.pt`), and a Trainer resumed from that folder resumes the engine too
(mirror, rounds, unanswered pushes), as the worker CLI does.

Steps are counted by the schedule, not by the Trainer: when the engine reaches `total_steps` (its final
sync done) the callback stops the Trainer. Under the shards' adaptive schedule a fast site does several
inner steps per schedule step, so give the Trainer `max_steps` of at least `total_steps` (the callback says
so when it is less). This module imports transformers: it is imported only by those who use it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from streamdiloco.common.atomic import atomic_write
from streamdiloco.common.config import SyncConfig
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.join import JoinOptions, connect
from streamdiloco.worker.transport import GrpcTransport

log = logging.getLogger("streamdiloco.worker")

STATE_FILE = "streamdiloco.pt"  # in each of the Trainer's checkpoint-N folders
STATE_FORMAT = "streamdiloco-trainer/1"


class StreamingDiLoCoCallback(TrainerCallback):
    """Makes the Trainer it is given to one worker of the run at `servers`.

    `total_steps`: the run's schedule steps for this worker (its final sync is at the last one).
    `sync`, `options` and any keyword of `JoinOptions` (name, token, seed, tls, ...) go to `connect()` as
    they are. `tokens_per_step`: tokens in one Trainer step (batch x accumulation x sequence length),
    reported to the shards' dashboards; when the Trainer counts input tokens
    (`include_num_input_tokens_seen`) its count is used instead. `engine` is the SyncEngine once training
    has started (None before)."""

    def __init__(
        self,
        servers: list[str] | str,
        total_steps: int,
        sync: SyncConfig | None = None,
        options: JoinOptions | None = None,
        tokens_per_step: int = 0,
        **join_kwargs: Any,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        self.servers, self.total_steps, self.sync = servers, total_steps, sync
        self.options, self.join_kwargs = options, join_kwargs
        self.tokens_per_step = tokens_per_step
        self.engine: SyncEngine | None = None
        self._tokens_seen = 0
        self._loss: float | None = None

    # --- the Trainer's events ------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if model is None:
            raise ValueError("StreamingDiLoCoCallback: the Trainer passed no model to on_train_begin")
        if 0 < state.max_steps < self.total_steps:
            log.warning(
                "the Trainer stops at max_steps=%d, before the run's total_steps=%d: this worker will not "
                "do its final sync; give the Trainer max_steps >= total_steps",
                state.max_steps,
                self.total_steps,
            )
        resume = self._resume_state(args, state)
        self.engine = connect(
            model,
            self.servers,
            self.sync,
            self.options,
            total_steps=self.total_steps,
            resume=resume,
            **self.join_kwargs,
        )
        self._tokens_seen = state.num_input_tokens_seen
        if self.engine.step_count >= self.total_steps:
            control.should_training_stop = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        engine = self._engine()
        seen = state.num_input_tokens_seen
        tokens = seen - self._tokens_seen if seen > self._tokens_seen else self.tokens_per_step
        self._tokens_seen = seen
        engine.step(tokens=tokens, loss=self._loss)
        if engine.step_count >= self.total_steps:
            control.should_training_stop = True
            control.should_save = True  # the last checkpoint holds the final sync

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)) and 0 <= loss < float("inf"):
            self._loss = float(loss)  # goes up with the next pushes (the shards' dashboards)
        if logs and "eval_loss" in logs and self.engine is not None:
            self.engine.report(eval_loss=float(logs["eval_loss"]))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        engine = self._engine()
        folder = Path(str(args.output_dir)) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():  # the Trainer saved elsewhere (a hyperparameter search's run folder)
            log.warning("no checkpoint folder %s: the engine's state is not saved with it", folder)
            return
        transport = engine.transport
        assert isinstance(transport, GrpcTransport)  # connect()'s
        state_dict = {
            "format": STATE_FORMAT,
            "engine": engine.state_dict(),  # before the links': they then hold every push sent here
            "links": transport.state_dict(),
        }
        atomic_write(folder / STATE_FILE, lambda f: torch.save(state_dict, f))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.engine is not None:
            self.engine.close()

    # --- helpers -------------------------------------------------------------------------------------
    def _engine(self) -> SyncEngine:
        if self.engine is None:
            raise RuntimeError("StreamingDiLoCoCallback: training has not begun (no on_train_begin)")
        return self.engine

    def _resume_state(self, args: TrainingArguments, state: TrainerState) -> dict | None:
        """The engine's state saved with the checkpoint the Trainer resumed from (its global_step > 0 at
        the start), or None for a fresh start. A resumed Trainer whose checkpoint lacks it is refused: the
        model holds local parameters of a run that this worker would join as new."""
        if state.global_step == 0:
            return None
        path = Path(str(args.output_dir)) / f"checkpoint-{state.global_step}" / STATE_FILE
        if not path.exists():
            raise ValueError(
                f"the Trainer resumed from step {state.global_step} but {path} does not exist: resume from "
                "a checkpoint that StreamingDiLoCoCallback saved, or start without resume_from_checkpoint"
            )
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
            raise ValueError(f"{path} is not a StreamingDiLoCoCallback state of format {STATE_FORMAT}")
        return saved
