"""The outer step, the downlink's error feedback, and the merge: the math both ends must agree on.

Worker, at a fragment's send step:   delta = mirror - local            (the outer gradient, old minus new)
Shard, when a round closes:          theta_new = SGD-Nesterov(theta_old, mean(delta))
                                     u = theta_new - theta_old
                                     v = u + e;  u_hat = dequant(quant(v));  e <- v - u_hat
                                     master <- theta_old + u_hat
Worker, tau steps after the send:    mirror <- mirror + u_hat
                                     local  <- alpha * local + (1 - alpha) * mirror

The master moves by exactly u_hat, and so does every worker's mirror, with the same fp32 addition: mirrors
and master stay bit-identical however coarse the downlink codec is.

With --outer-variant sparseloco (SparseLoCo, arXiv 2508.15706) the shard's step is plain SGD on the mean,
theta_new = theta_old - lr * mean(delta), with no momentum buffer: the workers' uplink error feedback
(worker/fragment.py: push enc(delta + d*e), keep e = what the encoding left out) is its momentum.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch

from streamdiloco.common.codecs import (
    Encoded,
    decode,
    encode,
    fused_outer_step_available,
    outer_step,
)
from streamdiloco.common.config import SyncConfig


def outer_momentum(cfg: SyncConfig) -> tuple[float, bool]:
    """The outer step's momentum and Nesterov flag in force: cfg's, or none (0.0, False) with --outer-variant
    sparseloco, whose step is the plain averaged one."""
    if cfg.outer_variant == "sparseloco":
        return 0.0, False
    return cfg.outer_momentum, cfg.outer_nesterov


def outer_gradient(
    mirror: torch.Tensor, local: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The outer gradient of one fragment: global (as of the last sync) minus local. Points uphill.
    `out`: a preallocated buffer to write it into (a fresh 100 MB tensor costs more in page faults than the
    subtraction itself)."""
    return torch.sub(mirror, local, out=out) if out is not None else mirror - local


class OuterOptimizer:
    """Nesterov SGD on one flat fp32 master vector, with error feedback on the quantized update.

    The step is torch.optim.SGD's (nesterov, no dampening or weight decay), written out with the same torch
    ops so that it runs in buffers kept from one step to the next: a shard closes a round of a 25M-value
    slice in a few passes over memory instead of a dozen fresh 100 MB tensors (each costs more in page
    faults than its arithmetic). The values are bit-identical to stepping torch.optim.SGD (a test pins it),
    and the momentum lives in that optimizer's state, so checkpoints keep its format.

    `master` is never changed in place: a step makes a new tensor (a reader may keep the old one).
    """

    def __init__(
        self,
        master: torch.Tensor,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        downlink_codec: str = "e3m0",
        block_size: int = 128,
        rounding: str = "nearest",
        seed: int = 0,
    ):
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("the master must be a flat fp32 tensor")
        self.master = master.detach().clone()
        self._param = torch.empty(0)  # the key of the momentum buffer in sgd's state (its format)
        self.sgd = torch.optim.SGD(
            [self._param], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov and momentum > 0
        self.residual = torch.zeros_like(self.master)  # error feedback e
        self.codec, self.block_size, self.rounding = downlink_codec, block_size, rounding
        self.generator = torch.Generator().manual_seed(seed)  # only used by stochastic rounding
        self._v: torch.Tensor | None = None  # the step's scratch: the update, then v = u + e
        self._u: torch.Tensor | None = None  # the decoded update u_hat
        self._g: torch.Tensor | None = None  # see gradient_buffer
        self._spare: torch.Tensor | None = None  # the previous master, reused when free (_spare_master)
        self._u_stale = False  # _u does not hold the last update yet (the fused step does not need it)

    def step(self, mean_delta: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """One outer step from the averaged outer gradient; returns the encoded and the decoded update (the
        latter a buffer of this optimizer: valid until the next step). Raises ValueError, changing nothing,
        when the gradient is not finite."""
        g = mean_delta.to(torch.float32).reshape(-1)
        if g.numel() != self.master.numel():
            raise ValueError(f"the gradient has {g.numel()} values, the master {self.master.numel()}")
        if g.numel() and not all(bool(torch.isfinite(x)) for x in torch.aminmax(g)):  # NaN propagates
            raise ValueError("cannot take an outer step on non-finite values")
        enc = self._fused(g)
        if enc is None:
            enc = self._step_torch(g)
        assert self._u is not None
        if self._u_stale:
            decode(enc, out=self._u)
            self._u_stale = False
        return enc, self._u

    def step_from(
        self, fill: Callable[[int, int, torch.Tensor], None], fill_values: int = 1 << 16
    ) -> Encoded:
        """One outer step from a gradient that `fill(lo, hi, out)` writes block by block (fp32, values
        [lo, hi), `fill_values` at a time): on the CPU with e3m0 or int8 each block is stepped, encoded and
        added to the master while it is in cache, and the whole gradient is never built (a shard's close).
        The caller guarantees finite values (a shard's are bounded by its validation). Returns the encoded
        update, the same as step() on the whole gradient."""
        enc = self._fused(fill, fill_values)
        if enc is None:
            g = self.gradient_buffer()
            for lo in range(0, g.numel(), fill_values):
                hi = min(g.numel(), lo + fill_values)
                fill(lo, hi, g[lo:hi])
            enc, _ = self.step(g)
        return enc

    def _fused(self, g: torch.Tensor | Callable, fill_values: int = 1 << 16) -> Encoded | None:
        """The fused CPU kernel's step (codecs.outer_step), or None where it does not apply."""
        if not fused_outer_step_available(self.codec, self.block_size, self.master.device):
            return None
        state = self.sgd.state[self._param]
        buf = state.get("momentum_buffer") if self.momentum else None
        first = bool(self.momentum) and buf is None
        if first:
            buf = torch.empty_like(self.master)
        new = self._spare_master()
        enc = outer_step(
            g, buf, first, self.master, self.residual, new, self.momentum, self.lr, self.nesterov,
            self.codec, self.block_size, self.rounding, self.generator, fill_values,
        )  # fmt: skip
        if enc is not None:
            if first:
                state["momentum_buffer"] = buf
            self._spare, self.master = self.master, new
            if self._u is None:
                self._u = torch.empty_like(new)
            self._u_stale = True  # decoded only if step() is asked for it
        return enc

    def _spare_master(self) -> torch.Tensor:
        """A tensor for the next master: the master of two steps ago when nothing holds it any more (no
        reference, no view: a Fetch or a hash may keep a master for as long as it likes), else a new one
        (whose page faults cost a fresh 100 MB tensor more than the step's arithmetic)."""
        spare, self._spare = self._spare, None
        if spare is not None and sys.getrefcount(spare) <= 2:  # this local and getrefcount's argument
            try:
                shared = torch._C._storage_Use_Count(spare.untyped_storage()._cdata) > 2  # views of it
            except (AttributeError, RuntimeError):  # the private API went away: do not reuse
                shared = True
            if not shared:
                return spare
        return torch.empty_like(self.master)

    def _step_torch(self, g: torch.Tensor) -> Encoded:
        """The same step in torch ops (any codec; the reference the fused kernel is tested against)."""
        old = self.master
        state = self.sgd.state[self._param]
        if self._v is None or self._u is None:
            self._v, self._u = torch.empty_like(old), torch.empty_like(old)
        v, u_hat = self._v, self._u
        # torch.optim.SGD's _single_tensor_sgd, op for op: buf = mu * buf + g; d = g + mu * buf (nesterov)
        if self.momentum == 0:
            d = g
        else:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.clone()
            else:
                buf.mul_(self.momentum).add_(g)
            d = torch.add(g, buf, alpha=self.momentum, out=v) if self.nesterov else buf
        torch.add(old, d, alpha=-self.lr, out=v)  # theta_new
        v.sub_(old).add_(self.residual)  # v = (theta_new - theta_old) + e
        enc = encode(v, self.codec, self.block_size, self.rounding, self.generator)
        decode(enc, out=u_hat)
        torch.sub(v, u_hat, out=self.residual)
        self.master = torch.add(old, u_hat)
        self._u_stale = False
        return enc

    def restart(self, master: torch.Tensor) -> None:
        """Start again from `master` (an earlier, finite one) with no momentum and no error-feedback residual:
        what a shard does when a step came out non-finite, since the step may have written them part-way.
        Workers never saw the failed step, so their mirrors still match this master."""
        self.master = master
        self.residual = torch.zeros_like(master)
        self.sgd.state.pop(self._param, None)
        self._spare = None  # it may be `master` itself: never a scratch buffer again

    def gradient_buffer(self) -> torch.Tensor:
        """A buffer of the master's size, kept for the caller to build the mean gradient in (no fresh
        100 MB tensor per round)."""
        if self._g is None:
            self._g = torch.empty_like(self.master)
        return self._g

    def state_dict(self) -> dict:
        return {
            "master": self.master.clone(),
            "residual": self.residual.clone(),
            "sgd": copy.deepcopy(self.sgd.state_dict()),  # the live one shares the momentum buffer
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.master = state["master"].clone()
        self.residual = state["residual"].clone()
        self.sgd.load_state_dict(state["sgd"])
        self.generator.set_state(state["generator"])


def apply_update(mirror: torch.Tensor, u_hat: torch.Tensor) -> None:
    """mirror <- mirror + u_hat, in place: the same fp32 addition as the master's."""
    mirror.add_(u_hat)


def merge_local(local: torch.Tensor, mirror: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * local + (1 - alpha) * mirror, as one lerp (torch.lerp is exact at both ends: alpha = 0 takes
    the global parameters exactly, alpha = 1 keeps the local ones)."""
    return torch.lerp(local, mirror, 1.0 - alpha)


def merge_local_(locals_: list[torch.Tensor], mirrors: list[torch.Tensor], alpha: float) -> None:
    """merge_local in place, over a fragment's parameter tensors and the matching views of its mirror
    (already on the parameters' device): one fused multi-tensor lerp where dtypes allow."""
    weight = 1.0 - alpha
    with torch.no_grad():
        if all(t.dtype == m.dtype for t, m in zip(locals_, mirrors, strict=True)):
            torch._foreach_lerp_(locals_, mirrors, weight)
            return
        for t, m in zip(locals_, mirrors, strict=True):  # low-precision parameters: mix in fp32
            t.copy_(torch.lerp(t.to(m.dtype), m, weight))


def rebase_local_(locals_: list[torch.Tensor], corrections: list[torch.Tensor], alpha: float) -> None:
    """The rebase merge in place: local += (1 - alpha) * correction, where correction = global - local as
    it was at the send (views on the parameters' device, fp32)."""
    weight = 1.0 - alpha
    with torch.no_grad():
        if all(t.dtype == c.dtype for t, c in zip(locals_, corrections, strict=True)):
            torch._foreach_add_(locals_, corrections, alpha=weight)
            return
        for t, c in zip(locals_, corrections, strict=True):  # low-precision parameters: add in fp32
            t.copy_(t.to(c.dtype).add_(c, alpha=weight))
