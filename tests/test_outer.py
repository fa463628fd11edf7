"""The outer step, error feedback and the merge, pinned with closed-form cases."""

import pytest
import torch

from streamdiloco.common.codecs import decode
from streamdiloco.common.outer import OuterOptimizer, apply_update, merge_local, outer_gradient


def test_outer_gradient_points_from_local_to_global():
    mirror = torch.tensor([1.0, 2.0, 3.0])
    local = mirror + torch.tensor([0.5, -1.0, 0.0])  # training moved the local parameters
    delta = outer_gradient(mirror, local)
    assert delta.tolist() == [-0.5, 1.0, 0.0]
    # a plain SGD step with lr 1 on this gradient lands on the local parameters
    opt = OuterOptimizer(mirror, lr=1.0, momentum=0.0, downlink_codec="fp32")
    _, u = opt.step(delta)
    assert torch.equal(opt.master, local)
    assert torch.equal(u, local - mirror)


def test_nesterov_matches_closed_form():
    lr, mu = 0.7, 0.9
    p0 = torch.tensor([1.0, -2.0])
    g1, g2 = torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.05])
    opt = OuterOptimizer(p0, lr=lr, momentum=mu, nesterov=True, downlink_codec="fp32")
    opt.step(g1)
    p1 = p0 - lr * (g1 + mu * g1)
    assert torch.allclose(opt.master, p1, atol=1e-7)
    opt.step(g2)
    buf = mu * g1 + g2
    p2 = p1 - lr * (g2 + mu * buf)
    assert torch.allclose(opt.master, p2, atol=1e-7)


@pytest.mark.parametrize("codec", ["e3m0", "int8", "bf16"])
def test_error_feedback_keeps_mirror_bit_identical_and_tracks_the_exact_master(codec):
    torch.manual_seed(0)
    n = 3000
    start = torch.randn(n)
    opt = OuterOptimizer(start, lr=0.7, momentum=0.9, downlink_codec=codec, block_size=128)
    exact = OuterOptimizer(start, lr=0.7, momentum=0.9, downlink_codec="fp32")
    mirrors = [start.clone(), start.clone()]  # two workers
    for _ in range(300):
        g = torch.randn(n) * 1e-3
        enc, u_hat = opt.step(g)
        exact.step(g)
        for m in mirrors:
            apply_update(m, decode(enc))  # what a worker does with the bytes it receives
        assert torch.equal(u_hat, decode(enc))
    for m in mirrors:
        assert torch.equal(m, opt.master)
    # with error feedback the quantized master stays within one quantization step of the exact one
    drift = (opt.master - exact.master).abs().max()
    assert drift <= opt.residual.abs().max() + 1e-5
    assert drift < 5e-3


def test_without_error_feedback_e3m0_would_drift():
    """The control for the test above: quantizing the update with no residual drifts much further."""
    torch.manual_seed(0)
    n = 3000
    start = torch.randn(n)
    ef = OuterOptimizer(start, lr=0.7, momentum=0.9, downlink_codec="e3m0")
    exact = OuterOptimizer(start, lr=0.7, momentum=0.9, downlink_codec="fp32")
    naive = start.clone()
    from streamdiloco.common.codecs import roundtrip

    for _ in range(300):
        g = torch.randn(n) * 1e-3
        before = exact.master.clone()
        ef.step(g)
        exact.step(g)
        naive += roundtrip(exact.master - before, "e3m0")
    assert (naive - exact.master).abs().max() > 3 * (ef.master - exact.master).abs().max()


def test_merge_with_alpha():
    local, mirror = torch.tensor([2.0, 4.0]), torch.tensor([0.0, 1.0])
    assert torch.equal(merge_local(local, mirror, 0.0), mirror)
    assert torch.equal(merge_local(local, mirror, 1.0), local)
    assert merge_local(local, mirror, 0.5).tolist() == [1.0, 2.5]
    assert torch.allclose(merge_local(local, mirror, 0.25), torch.tensor([0.5, 1.75]))


def test_state_dict_roundtrip():
    opt = OuterOptimizer(torch.randn(100), lr=0.7, momentum=0.9)
    for _ in range(3):
        opt.step(torch.randn(100) * 1e-2)
    state = opt.state_dict()
    twin = OuterOptimizer(torch.zeros(100), lr=0.7, momentum=0.9)
    twin.load_state_dict(state)
    g = torch.randn(100) * 1e-2
    a, _ = opt.step(g)
    b, _ = twin.step(g)
    assert torch.equal(opt.master, twin.master) and torch.equal(a.payload, b.payload)


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, True)])
def test_the_step_is_torch_sgd_bit_for_bit(momentum, nesterov):
    """The step runs in kept buffers; its values are those of stepping torch.optim.SGD itself (with the
    fp32 downlink there is no quantization: the master is SGD's parameter, bit for bit)."""
    torch.manual_seed(1)
    n = 10_007  # not a multiple of any vector width: the tails too
    start = torch.randn(n)
    opt = OuterOptimizer(start, lr=0.7, momentum=momentum, nesterov=nesterov, downlink_codec="fp32")
    param = start.clone().requires_grad_(True)
    sgd = torch.optim.SGD([param], lr=0.7, momentum=momentum, nesterov=nesterov and momentum > 0)
    for _ in range(5):
        g = torch.randn(n) * 1e-2
        old = opt.master
        opt.step(g)
        param.grad = g.clone()
        sgd.step()
        assert torch.equal(opt.master, old + (param.detach() - old))  # theta_old + u, u exact in fp32
        assert torch.equal(opt.residual, torch.zeros(n))
        with torch.no_grad():
            param.copy_(opt.master)
        assert not torch.equal(old, opt.master)  # the old master was not changed in place
    if momentum:  # the momentum is SGD's, in SGD's state format
        assert torch.equal(
            opt.state_dict()["sgd"]["state"][0]["momentum_buffer"], sgd.state[param]["momentum_buffer"]
        )


def test_a_non_finite_gradient_is_refused_and_changes_nothing():
    opt = OuterOptimizer(torch.randn(300), lr=0.7, momentum=0.9)
    opt.step(torch.randn(300) * 1e-2)
    before = opt.state_dict()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.randn(300) * 1e-2
        g[123] = bad
        with pytest.raises(ValueError, match="non-finite"):
            opt.step(g)
        after = opt.state_dict()
        assert torch.equal(after["master"], before["master"]) and torch.equal(
            after["residual"], before["residual"]
        )
        assert torch.equal(
            after["sgd"]["state"][0]["momentum_buffer"], before["sgd"]["state"][0]["momentum_buffer"]
        )


@pytest.mark.parametrize("codec", ["e3m0", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.95, False), (0.0, True)])
def test_the_fused_cpu_step_equals_the_torch_ops(monkeypatch, codec, rounding, momentum, nesterov):
    """On the CPU the step of the quantized codecs is one fused kernel (split over threads for large
    slices); the torch ops (no kernels) give the same master, residual, momentum and bytes, bit for bit."""
    from streamdiloco.common import codecs, kernels

    monkeypatch.setattr(codecs, "PARALLEL_VALUES", 5000)  # several threads on uneven ranges
    monkeypatch.setenv("STREAMDILOCO_CODEC_THREADS", "3")
    n = 40_003
    start = torch.randn(n, generator=torch.Generator().manual_seed(3))
    kw = dict(lr=0.7, momentum=momentum, nesterov=nesterov, downlink_codec=codec, rounding=rounding, seed=5)
    fused, plain = OuterOptimizer(start, **kw), OuterOptimizer(start, **kw)
    compiled = kernels.cpu_kernels()
    assert compiled is not None
    for i in range(4):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + i)) * 1e-3
        a, ua = fused.step(g)
        monkeypatch.setattr(kernels, "_KERNELS", False)
        b, ub = plain.step(g)
        monkeypatch.setattr(kernels, "_KERNELS", compiled)
        assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
        assert torch.equal(ua, ub) and torch.equal(fused.master, plain.master)
        assert torch.equal(fused.residual, plain.residual)
        sa, sb = fused.state_dict()["sgd"]["state"], plain.state_dict()["sgd"]["state"]
        assert sa.keys() == sb.keys()
        if momentum:
            assert torch.equal(sa[0]["momentum_buffer"], sb[0]["momentum_buffer"])


def test_a_master_someone_holds_is_never_reused_and_a_free_one_is():
    """The fused step writes the new master into the master of two steps ago when nothing holds it: a
    master kept by a reader (a Fetch, a hash), or a view of it, never changes."""
    opt = OuterOptimizer(torch.randn(50_000), lr=0.7, momentum=0.9)
    held = opt.master  # a reader keeps the first master
    copy_held = held.clone()
    opt.step(torch.randn(50_000) * 1e-3)
    view = opt.master[100:200]  # a view of the second
    copy_view = view.clone()
    for _ in range(4):
        opt.step(torch.randn(50_000) * 1e-3)
    assert torch.equal(held, copy_held) and torch.equal(view, copy_view)
    del held, view
    ptrs = []
    for _ in range(6):  # nobody holds them now: each new master is written into the one of two steps ago
        opt.step(torch.randn(50_000) * 1e-3)
        ptrs.append(opt.master.data_ptr())
    assert all(ptrs[i] == ptrs[i - 2] for i in range(3, 6)) and ptrs[-1] != ptrs[-2]
