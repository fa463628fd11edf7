"""Hugging Face models through the product: `--model hf:PATH` built from a local config (a folder written by
save_pretrained, with or without weights, or a config JSON file) with the same seeded init everywhere, its
parameters under the model's own names, trained by a real shard and worker and exported with --hf-out into
a folder that `AutoModelForCausalLM.from_pretrained` loads equal to the shards' masters; bad specs in one
line. And the worker's inner step: bf16 autocast on CPU (the state stays fp32) and --grad-accum N (N
micro-batches of the batch size equal one batch of N times the rows)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from streamdiloco.cli import main
from streamdiloco.common.config import InnerConfig, RunSettings, SyncConfig, WorkerSettings
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.common.modelspec import build_model, check_vocab, model_block_size
from streamdiloco.worker.checkpoint import checkpoint_key
from streamdiloco.worker.data import BatchStream, ByteDataset
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.run import WorkerConfig
from streamdiloco.worker.train import autocast, forward_backward, make_inner_optimizer, optimizer_step
from tests.support.procs import Cluster, refused_in_one_line

TOKEN = "hf-test-token"
RUN = ["--sync-every", "6", "--num-fragments", "3", "--token", TOKEN]


def tiny(**changes) -> dict:
    """A tiny GPT-2 on bytes: the built-in text trains it (vocabulary 256, 32 positions)."""
    # imports transformers: only the tests that have it get here
    from tests.support.hf_gpt2 import tiny_config

    return {**tiny_config(vocab=256, positions=32), **changes}


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny(**changes)))
    return folder


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- building -----------------------------------------------------------------------------------------------
def test_an_hf_model_builds_from_a_folder_or_a_config_file_with_the_same_seeded_init(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = write_config(tmp_path / "tiny")
    model = build_model(f"hf:{folder}", seed=3)
    again = build_model(f"hf:{folder / 'config.json'}", seed=3)  # the file itself: the same model
    assert same(params(model), params(again))  # a shard's initial masters are every worker's start
    assert not same(params(model), params(build_model(f"hf:{folder}", seed=4)))
    # the model's own class and names (export --hf-out and from_pretrained rely on them), fp32, training
    assert isinstance(model, transformers.GPT2LMHeadModel) and type(model).__name__ == "GPT2LMHeadModel"
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny()))
    assert list(params(model)) == list(params(plain))
    assert all(p.dtype == torch.float32 for p in model.parameters()) and model.training
    assert model_block_size(model) == 32 and model_block_size(model, 16) == 16
    # the worker loop's forward: (logits, mean cross-entropy over every position)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 256)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    assert model(x)[1] is None
    # transformers' own calls keep working (generate calls forward(input_ids=...))
    assert model.generate(x[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)
    # the fingerprint carries the architecture, as for the built-in GPT
    fp = model_fingerprint(build_layout(model, 3), SyncConfig(sync_every=6, num_fragments=3), 3)
    assert fp["model_config"]["n_head"] == 2 and fp["model_config"]["model_type"] == "gpt2"
    assert "resid_pdrop" not in fp["model_config"] and fp["fragments"][0][0] == [0]  # blocks: transformer.h


def test_any_causal_lm_class_builds_a_llama_with_its_own_blocks(tmp_path):
    pytest.importorskip("transformers")
    llama = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64}
    llama |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "llama.json").write_text(json.dumps({**llama, "max_position_embeddings": 4096}))
    model = build_model(f"hf:{tmp_path / 'llama.json'}")
    assert type(model).__name__ == "LlamaForCausalLM" and build_layout(model, 3).blocks_path == "model.layers"
    assert model_block_size(model) == 1024  # its positions, at most 1024 unless --block-size says
    x = torch.randint(0, 256, (4, 8))
    assert forward_backward(model, x, x, micro_batches=2, precision="bf16") > 0


def test_an_hf_folder_with_weights_loads_them_in_fp32(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny()))
    saved.to(torch.bfloat16).save_pretrained(tmp_path / "trained")  # weights in bf16: loaded as fp32
    model = build_model(f"hf:{tmp_path / 'trained'}", seed=99)  # the seed does not matter: the weights do
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert same(params(model), {k: v.float() for k, v in params(saved).items()})
    assert not same(params(model), params(build_model(f"hf:{tmp_path / 'trained' / 'config.json'}", 99)))
    assert model.training  # from_pretrained gives eval mode; the worker trains


def test_hf_specs_that_do_not_build_are_one_line(tmp_path):
    pytest.importorskip("transformers")
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="model_type 'vit' is not a causal language model"):
        build_model(f"hf:{vit}")
    remote = write_config(tmp_path / "remote", model_type="mine", auto_map={"AutoConfig": "conf.Mine"})
    with pytest.raises(ValueError, match="transformers cannot read .* custom code"):  # never run, no prompt
        build_model(f"hf:{remote}")
    folder = write_config(tmp_path / "tiny")
    with pytest.raises(ValueError, match="--block-size 64 is longer than the model's 32 positions"):
        build_model(f"hf:{folder}", block_size=64)
    small = build_model(f"hf:{write_config(tmp_path / 'small', vocab_size=100)}")
    with pytest.raises(ValueError, match="its vocab_size is 100, but the data has token ids up to 255"):
        check_vocab(small, 256, "hf:small")
    check_vocab(small, 100, "hf:small")
    check_vocab(torch.nn.Linear(2, 2), 10**6, "x:y")  # a model that does not say: not checked
    # weights of another architecture than the config says
    build_model(f"hf:{write_config(tmp_path / 'one', n_layer=1)}").save_pretrained(tmp_path / "one")
    write_config(tmp_path / "one", n_layer=2)
    with pytest.raises(ValueError, match="do not fit its config: .* missing keys"):
        build_model(f"hf:{tmp_path / 'one'}")
    # through the worker's command (in this process: transformers is imported here already): one line, exit
    # 2, before it goes on the network
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["worker", "--servers", "127.0.0.1:1", "--model", f"hf:{vit}", "--join-timeout", "1"])
    assert rc == 2 and len(err.getvalue().strip().splitlines()) == 1, err.getvalue()[-2000:]
    assert err.getvalue().startswith(f"streamdiloco: error: --model hf:{vit}: model_type 'vit' is not")


# One fresh interpreter: every bad hf: spec (and --precision, --grad-accum) refused in one line, exit 2,
# before torch is imported
def test_bad_hf_specs_and_step_settings_are_refused_in_one_line_without_torch(tmp_path):
    (tmp_path / "empty").mkdir()
    for name, text in (("bad", "{not json"), ("list", "[1, 2]"), ("notype", '{"vocab_size": 256}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    tmp = str(tmp_path)
    w = ["worker", "--servers", "127.0.0.1:1", "--model"]
    refused_in_one_line(
        [
            (w + [f"hf:{tmp}/none"], "does not exist"),
            (w + [f"hf:{tmp}/empty"], "has no config.json"),
            (w + [f"hf:{tmp}/bad"], "config.json is not JSON"),
            (w + [f"hf:{tmp}/list"], "holds a JSON list, not a model's config"),
            (w + [f"hf:{tmp}/notype"], "has no model_type"),
            (w + [f"hf:{tmp}/pickled"], "only safetensors are read"),
            (w + ["hf:"], "give PATH"),
            (["server", "--model", f"hf:{tmp}/empty"], "has no config.json"),
            (["launch", "--model", f"hf:{tmp}/bad/config.json"], "is not JSON"),
            (
                ["worker", "--servers", "127.0.0.1:1", "--grad-accum", "0"],
                "--grad-accum must be in [1, 1024]",
            ),
            (["worker", "--servers", "127.0.0.1:1", "--precision", "fp16"], "unknown precision 'fp16'"),
        ]
    )
    with pytest.raises(ValueError, match="grad-accum"):
        WorkerSettings(grad_accum=2000)


# --- export --hf-out --tokenizer ----------------------------------------------------------------------------
def test_export_tokenizer_is_checked_before_anything_is_fetched_or_written(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from streamdiloco.common.tokenizer import read_tokenizer, train_tokenizer
    from streamdiloco.worker.text import load_text

    folder = write_config(tmp_path / "tiny", vocab_size=300)
    text = load_text(None).decode("utf-8", errors="ignore")[:40_000]
    small, large = train_tokenizer(iter([text]), 257), train_tokenizer(iter([text]), 384)
    small.save(str(tmp_path / "small.json"))
    large.save(str(tmp_path / "large.json"))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "no-tokenizer").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("[1]")  # a prepared folder's manifest, not one
    hf, out = tmp_path / "hf", tmp_path / "m.safetensors"
    # nothing listens at 127.0.0.1:1: a tokenizer that passed would fail on the fetch instead
    argv = ["export", "--servers", "127.0.0.1:1", "--timeout", "1", "--model", f"hf:{folder}"]
    argv += ["--out", str(out)]
    cases = [
        ([], str(tmp_path / "small.json"), "--tokenizer needs --hf-out"),
        (["--hf-out", str(hf)], str(tmp_path / "none.json"), "no such file"),
        (["--hf-out", str(hf)], str(tmp_path / "no-tokenizer"), "no tokenizer.json in that folder"),
        (["--hf-out", str(hf)], str(tmp_path / "bad.json"), "not a tokenizers JSON file"),
        (["--hf-out", str(hf)], str(tmp_path / "broken"), f"--tokenizer {tmp_path / 'broken'}: "),
        (["--hf-out", str(hf)], str(tmp_path / "large.json"), "its vocab_size is 300, but the tokenizer"),
    ]
    for extra, tokenizer, expect in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main([*argv, *extra, "--tokenizer", tokenizer])
        lines = err.getvalue().strip().splitlines()
        assert rc == 2 and len(lines) == 1, (tokenizer, err.getvalue()[-2000:])
        assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0], (tokenizer, lines[0])
        assert not hf.exists() and not out.exists()
    # a bare tokenizer.json: its <|endoftext|> is taken for EOS, and AutoTokenizer loads what is written
    model = build_model(f"hf:{folder}")
    tok = read_tokenizer(str(tmp_path / "small.json"), model, f"hf:{folder}")
    model.save_pretrained(hf)
    tok.write(hf, model)
    loaded = transformers.AutoTokenizer.from_pretrained(hf)
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>" and loaded.eos_token_id == 0
    assert loaded.model_max_length == 32
    assert loaded("to be or not").input_ids == small.encode("to be or not").ids


# --- the inner step: bf16 autocast and gradient accumulation -----------------------------------------------
@pytest.fixture
def one_thread():
    """Small models train faster on one CPU thread than on two that spin for each other (and the suite runs
    two test processes on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bf16_autocast_trains_on_cpu_and_the_state_stays_fp32(one_thread):
    torch.manual_seed(0)
    model = build_gpt("nano")
    data = ByteDataset.load(None, 32)
    stream = BatchStream(data.train, 8, 32, seed=0, rank=0)
    opt = make_inner_optimizer(model, InnerConfig(lr=3e-3, warmup_steps=0))
    x, y = stream.next()
    with autocast("bf16", "cpu"):
        assert model(x, y)[0].dtype == torch.bfloat16  # the forward runs in bf16
    losses = []
    for _ in range(30):
        x, y = stream.next()
        losses.append(forward_backward(model, x, y, precision="bf16"))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        optimizer_step(model, opt, InnerConfig())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # it learns
    assert all(p.dtype == torch.float32 for p in model.parameters())  # what the sync flattens and sends
    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def test_grad_accum_of_n_micro_batches_equals_one_batch_of_n_times_the_rows(one_thread):
    """The worker draws --grad-accum x --batch-size rows per step (one stream, the same windows) and runs
    them as N micro-batches: its steps are those of one batch of N x B rows, up to float round-off."""
    data = ByteDataset.load(None, 32)
    runs = []
    for micro in (1, 2, 4):
        torch.manual_seed(0)
        model = build_gpt("nano")
        opt = make_inner_optimizer(model, InnerConfig(warmup_steps=0))
        stream = BatchStream(data.train, 8, 32, seed=0, rank=0)
        losses = []
        for _ in range(3):
            x, y = stream.next()
            losses.append(forward_backward(model, x, y, micro_batches=micro))
            optimizer_step(model, opt, InnerConfig())
        runs.append((losses, params(model)))
    (want_losses, want), *others = runs
    for losses, got in others:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, p in got.items():
            assert torch.allclose(p, want[name], rtol=1e-4, atol=1e-6), name
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        forward_backward(build_gpt("nano"), x, y, micro_batches=3)
    # so a worker of --batch-size 8 --grad-accum 2 and one of --batch-size 16 resume each other's checkpoint
    # (the same windows from the same stream), and one of --batch-size 8 alone does not
    key = [
        checkpoint_key(
            WorkerConfig(("127.0.0.1:1",), run=RunSettings(batch_size=b), worker=WorkerSettings(**w))
        )
        for b, w in ((8, {"grad_accum": 2}), (16, {}), (8, {}))
    ]
    assert key[0] == key[1] != key[2]


# --- a real shard and worker -------------------------------------------------------------------------------
def test_a_shard_and_a_worker_train_an_hf_model_and_export_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from streamdiloco.export import fetch_masters

    folder = write_config(tmp_path / "tiny")
    spec = f"hf:{folder}"
    with Cluster(tmp_path) as c:
        target, _ = c.shard("shard", "--model", spec, *RUN)
        steps, batch, accum = 12, 4, 2
        flags = ["--steps", str(steps), "--batch-size", str(batch), "--log-every", "6"]
        c.worker(
            "w0", [target], "--model", spec, *RUN, *flags, "--grad-accum", str(accum), "--precision", "bf16"
        )
        assert c.wait("w0", 240) == 0, c.log("w0")[-3000:]
        summary = c.summary("w0")
        assert summary["tokens"] == steps * accum * batch * 32  # every micro-batch's tokens, counted once
        assert summary["eval_loss"] < summary["eval_loss_start"]
        masters = fetch_masters([target], TOKEN)
        # the export command in this process (transformers is imported here already: a process would
        # import it again, seconds on a loaded machine); its code is the CLI's
        rc = main(
            [
                "export", "--servers", target, "--token", TOKEN, "--model", spec,
                "--out", str(tmp_path / "m.safetensors"), "--hf-out", str(tmp_path / "hf"),
            ]
        )  # fmt: skip
        assert rc == 0
    # the worker's state is fp32 under bf16 autocast: its parameters and its mirror (what it syncs)
    ck = torch.load(tmp_path / "w0.pt", weights_only=True)
    assert all(t.dtype == torch.float32 for t in ck["params"].values())
    mirrors = ck["engine"]["mirrors"]
    assert mirrors and all(m.dtype == torch.float32 for m in mirrors)
    # the exported folder loads as the plain transformers class, equal to the shard's masters
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf) is transformers.GPT2LMHeadModel
    layout = build_layout(hf, 3)
    for f, fragment in enumerate(layout.fragments):
        for e in fragment.entries:
            value = masters[f][e.offset : e.offset + e.numel].view(e.shape)
            assert torch.equal(hf.get_parameter(e.name), value), e.name
    assert hf.generate(torch.tensor([[72, 101]]), max_new_tokens=4, do_sample=False).shape == (1, 6)
