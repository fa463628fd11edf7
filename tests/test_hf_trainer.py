"""`transformers.Trainer` as one worker of a real run (worker/hf_trainer.py, examples/hf_trainer.py): the
example trains against a real shard process with gradient accumulation, is killed with SIGKILL after a
checkpoint, resumes from the Trainer's checkpoint, and ends with its mirror equal to the shard's masters."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.support.procs import ROOT, Cluster, http_json, wait_until

transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

FLAGS = ["--sync-every", "6", "--num-fragments", "3", "--min-workers", "1"]


def trainer_process(tmp, name: str, target: str, *flags: str) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(
        [sys.executable, "examples/hf_trainer.py", "--servers", target, "--name", "trainer", *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**Cluster(tmp).env, "HF_HUB_OFFLINE": "1"},
    )
    log.close()
    return proc


def test_a_trainer_is_one_worker_resumes_from_its_checkpoint_and_ends_with_the_masters(tmp_path):
    from tests.support.hf_gpt2 import tiny_gpt2

    config = tmp_path / "config"
    tiny_gpt2().config.save_pretrained(config)  # the shard's model, as a config the example builds from
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    run = [
        *("--model-config", str(config), "--steps", "18", "--batch-size", "2", "--grad-accum", "2"),
        *("--context", "32", "--save-steps", "6", "--out", str(out), "--summary", str(summary)),
    ]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", "--model", "tests.support.hf_gpt2:tiny_gpt2", *FLAGS)
        first = trainer_process(tmp_path, "first", target, *run)
        try:
            saved = out / "checkpoint-12" / "streamdiloco.pt"
            wait_until("the checkpoint of step 12 with the engine's state", saved.exists, timeout=240)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        assert not summary.exists()
        log = (tmp_path / "first.log").read_text()
        assert "Traceback" not in log, log[-3000:]
        second = trainer_process(tmp_path, "second", target, *run, "--resume")
        assert second.wait(timeout=240) == 0, (tmp_path / "second.log").read_text()[-4000:]
        status = http_json(http, "/api/status")
    got = json.loads(summary.read_text())
    assert got["step"] == 18
    # the Trainer counted optimizer steps (two micro-batches each): 18, the run's schedule steps
    state = json.loads((out / "checkpoint-18" / "trainer_state.json").read_text())
    assert state["global_step"] == 18
    masters = [[f["master_hash"]] for f in status["fragments"]]
    assert got["mirror_hashes"] == masters  # after the final sync: the run's global parameters
    assert "resumes at step 12" in (tmp_path / "second.log").read_text()
    assert {m["name"] for m in status["members"]} <= {"trainer"}


def test_a_trainer_resumed_without_the_engines_state_is_refused(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from streamdiloco.worker.hf_trainer import StreamingDiLoCoCallback

    cb = StreamingDiLoCoCallback("127.0.0.1:1", total_steps=10)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    (tmp_path / "checkpoint-4").mkdir()
    state = TrainerState(global_step=4, max_steps=10)
    with pytest.raises(ValueError, match="checkpoint-4/streamdiloco.pt does not exist"):
        cb.on_train_begin(args, state, TrainerControl(), model=object())
    (tmp_path / "checkpoint-4" / "streamdiloco.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):  # noqa: B017 (torch.load's own error for a file that is not one)
        cb.on_train_begin(args, state, TrainerControl(), model=object())
    with pytest.raises(ValueError, match="at least 1"):
        StreamingDiLoCoCallback("127.0.0.1:1", total_steps=0)


# in `make test-slow`; covered by test_a_trainer_is_one_worker_resumes_... (a transformers loop joined with
# the same connect() and hook) and tests/test_example.py (your own loop through a shard)
@pytest.mark.slow
def test_an_accelerate_loop_is_one_worker_and_ends_with_the_masters(tmp_path):
    from tests.support.hf_gpt2 import tiny_gpt2

    config = tmp_path / "config"
    tiny_gpt2().config.save_pretrained(config)
    summary = tmp_path / "summary.json"
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", "--model", "tests.support.hf_gpt2:tiny_gpt2", *FLAGS)
        log = open(tmp_path / "loop.log", "a")  # noqa: SIM115 (the child holds it)
        proc = subprocess.Popen(
            [sys.executable, "examples/accelerate_loop.py", "--servers", target, "--name", "acc"]
            + ["--model-config", str(config), "--steps", "12", "--batch-size", "2", "--grad-accum", "2"]
            + ["--context", "32", "--summary", str(summary)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**c.env, "HF_HUB_OFFLINE": "1"},
        )
        log.close()
        assert proc.wait(timeout=240) == 0, (tmp_path / "loop.log").read_text()[-4000:]
        status = http_json(http, "/api/status")
    got = json.loads(summary.read_text())
    assert got["step"] == 12
    assert got["mirror_hashes"] == [[f["master_hash"]] for f in status["fragments"]]
    # one push per fragment per H=6 steps over 12 steps, the final sync included: every round of the run
    assert all(f["round"] >= 2 for f in status["fragments"]), status["fragments"]
