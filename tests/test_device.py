"""The CUDA paths against the CPU's: each test runs on every device this machine has (its `cpu` case here,
its `cuda` case only where torch sees a GPU: skipped otherwise, run by scripts/gpu-check.py there).

- the sync engine on the device (a device-side snapshot brought to pinned memory on the sync thread's
  stream, the mirror or the rebase correction staged on the device for the lerp) against the engine on the
  CPU, on the same parameters, steps and updates: the mirrors bit-identical (they are CPU fp32 sums of the
  same updates), the first push of every fragment bit-identical (a copy of the same parameters), the
  parameters and later pushes within 1e-6 (the lerp and the rebase's add run on the device, where a fused
  multiply-add may round an ulp differently);
- a worker process with --device on two real shard processes: its mirror equals the masters bit for bit;
- a process-group worker of one rank: NCCL on CUDA, gloo on the CPU;
- `connect()` with a model on the device, trained in bf16 autocast;
- the simulator with its workers on the device (the shards' masters on the CPU, as in a shard process).
The codecs' CUDA kernels against the CPU bytes are tests/test_codecs.py's (`cuda` tests)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
import torch.nn as nn

from streamdiloco.common.codecs import decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.worker.checkpoint import mirror_digests
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.model import build_gpt
from tests.support.procs import Cluster, masters_hashes, shard_process

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]
# the CPU twin in `make test-slow`: `make test` has the same on the CPU already (named where it is used)
SLOW_ON_CPU = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow), DEVICES[1]]
# where the device runs the arithmetic (lerp, add) that the CPU runs too: fp32 round-off apart
TOLERANCE = 1e-6


# --- the engine on the device against the engine on the CPU -------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 5)


class FixedUpdates:
    """Two shards' transport whose round updates are fixed fp32 vectors (seeded by fragment and round),
    delivered at once whatever was pushed: two runs' mirrors stay comparable bit for bit."""

    num_shards, pace_seconds = 2, 0.0

    def __init__(self) -> None:
        self.pushes: dict[tuple[int, int], torch.Tensor] = {}
        self.engine: SyncEngine | None = None

    def push(self, fragment, round, slices, weight, loss) -> None:
        self.pushes[(fragment, round)] = torch.cat([decode(s) for s in slices])

    def skip_to(self, next_rounds) -> None:
        return None  # never behind

    def update(self, fragment: int, round: int) -> Future:
        assert self.engine is not None
        g = torch.Generator().manual_seed(1000 * fragment + round)
        fut: Future = Future()
        ranges = self.engine.fragments[fragment].ranges
        fut.set_result([encode(torch.randn(hi - lo, generator=g) * 1e-2, "fp32", 128) for lo, hi in ranges])
        return fut

    def close(self) -> None:
        pass


def run_engine(device: str, rule: str, steps: int = 14) -> tuple[SyncEngine, FixedUpdates]:
    """H=4, P=2, tau=1, "fixed" merges: the same steps, sends and merges on any device."""
    cfg = SyncConfig(
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=1,
        merge_policy="fixed",
        merge_rule=rule,
        uplink_codec="fp32",
        downlink_codec="fp32",
        final_sync=False,
    )
    net = Net().to(device)
    transport = FixedUpdates()
    engine = SyncEngine(net, build_layout(net, 2, "strided"), cfg, transport, total_steps=steps)
    transport.engine = engine
    g = torch.Generator().manual_seed(7)
    try:
        for _ in range(steps):
            with torch.no_grad():  # an exact change on any device: one fp32 addition (no multiply to fuse)
                for p in net.parameters():
                    p.add_((torch.randn(p.shape, generator=g) * 1e-3).to(device))
            engine.step()
        engine.quiesce()
    finally:
        engine.close()
    return engine, transport


@pytest.mark.parametrize("rule", ["mix", "rebase"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_on_the_device_equals_the_cpu_path(device, rule):
    ref, ref_t = run_engine("cpu", rule)
    got, got_t = run_engine(device, rule)
    assert got.merges == ref.merges == 6 and sorted(got_t.pushes) == sorted(ref_t.pushes)
    for f, frag in enumerate(got.fragments):
        assert frag.mirror.device.type == "cpu"
        assert frag.mirror.is_pinned() == (device == "cuda")  # the host side of the async copies
        # the mirror: the same fp32 additions of the same updates on the CPU, bit for bit
        assert torch.equal(frag.mirror, ref.fragments[f].mirror), f
        local = flatten(fragment_params(got.model, got.layout.fragments[f]))
        assert local.device.type == device
        want = flatten(fragment_params(ref.model, ref.layout.fragments[f]))
        torch.testing.assert_close(local.cpu(), want, rtol=0, atol=TOLERANCE)
    for key, want in ref_t.pushes.items():
        if key[1] == 0:  # before the fragment's first merge: a copy of the same parameters
            assert torch.equal(got_t.pushes[key], want), key
        else:
            torch.testing.assert_close(got_t.pushes[key], want, rtol=0, atol=TOLERANCE)


# --- a worker process on the device against two shard processes ---------------------------------------------
RUN = ["--model", "nano", "--sync-every", "4", "--num-fragments", "2"]


# on the CPU: tests/test_faults.py (two workers, two shards, mirrors equal to the masters)
@pytest.mark.parametrize("device", SLOW_ON_CPU)
def test_a_worker_on_the_device_with_two_shards_ends_with_its_mirror_equal_to_the_masters(tmp_path, device):
    with Cluster(tmp_path) as c:
        shards = [c.shard(f"s{i}", "--shard", str(i), "--num-shards", "2", *RUN) for i in range(2)]
        c.worker(
            "w",
            [t for t, _ in shards],
            *RUN,
            *("--device", device, "--precision", "bf16", "--steps", "12"),
            *("--eval-every", "0", "--eval-batches", "1", "--log-every", "4", "--checkpoint-every", "0"),
        )
        assert c.wait("w", timeout=240) == 0, c.log("w")[-3000:]
        summary = c.summary("w")
        assert summary["steps"] == 12 and summary["bytes_received"] > 0
        assert summary["mirror_hashes"] == masters_hashes([h for _, h in shards])  # bit for bit


# --- a process-group worker of one rank: NCCL on CUDA, gloo on the CPU --------------------------------------
# on the CPU: tests/test_process_group.py::test_the_library_a_ddp_model_joins_with_connect_group_...
@pytest.mark.parametrize("device", SLOW_ON_CPU)
def test_a_one_rank_group_worker_syncs_through_its_backend(tmp_path, device):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from streamdiloco.worker.group import batch_slice, connect_group

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.get_backend() == ("nccl" if cuda else "gloo")
        flags = ["--model", "nano", "--sync-every", "4", "--num-fragments", "2"]
        with shard_process(tmp_path, *flags) as (t, http, _):
            torch.manual_seed(0)
            model = DistributedDataParallel(build_gpt("nano").to(device), device_ids=[0] if cuda else None)
            engine = connect_group(model, [t], SyncConfig(sync_every=4, num_fragments=2), total_steps=8)
            try:
                assert engine.group.device.type == device and engine.engine is not None
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                for _ in range(8):
                    x = batch_slice(torch.randint(0, 256, (4, 32)), engine.group).to(device)
                    _, loss = model(x, x)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    engine.step(tokens=x.numel(), loss=loss.item())
                engine.drain()
                assert engine.engine.pushes == 8 // 2 + 1  # a fragment every 2 steps, and the final sync
                assert mirror_digests(engine.engine) == masters_hashes([http])
            finally:
                engine.close()
    finally:
        dist.destroy_process_group()


# --- connect() with a model on the device, in bf16 autocast -------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_connect_trains_a_model_on_the_device_in_bf16_autocast(tmp_path, device):
    from streamdiloco.worker.join import connect

    flags = ["--model", "nano", "--sync-every", "4", "--num-fragments", "2"]
    with shard_process(tmp_path, *flags) as (t, http, _):
        torch.manual_seed(0)
        model = build_gpt("nano").to(device)
        engine = connect(model, [t], SyncConfig(sync_every=4, num_fragments=2), total_steps=8, name="bf16")
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for _ in range(8):
                x = torch.randint(0, 256, (4, 32), device=device)
                with torch.autocast(device, dtype=torch.bfloat16):
                    logits, loss = model(x, x)
                assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                engine.step(tokens=x.numel(), loss=losses[-1])
            engine.drain()
            assert all(torch.isfinite(torch.tensor(losses)))
            # the parameters stay fp32 on the device; what is synced is fp32 and equals the masters
            assert all(p.dtype == torch.float32 and p.device.type == device for p in model.parameters())
            assert engine.merges == engine.pushes == 8 // 2 + 1
            assert mirror_digests(engine) == masters_hashes([http])
            state = engine.global_state_dict()
            assert all(v.device.type == "cpu" for v in state.values())
        finally:
            engine.close()


# --- the simulator with its workers on the device ---------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_the_simulator_trains_its_workers_on_the_device(device):
    from streamdiloco.common.config import ModelSettings, RunSettings
    from streamdiloco.sim.simulator import SimConfig, simulate

    cfg = SimConfig(
        workers=2,
        run=RunSettings(steps=8, device=device, eval_batches=2),
        model=ModelSettings(model="nano"),
        num_shards=2,
        eval_every=8,
        sync=SyncConfig(sync_every=4, num_fragments=2),
    )
    result = simulate(cfg, log=None)
    assert result["mirrors_match_masters"] and result["rounds"] == 8 // 2 + 1
    assert all(t.device.type == "cpu" for t in result["global_params"])
    assert 0 < result["eval_loss"] < 6
