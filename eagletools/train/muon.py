"""Muon for the draft's 2-D weights, AdamW for the rest, in one optimizer.

Muon replaces a matrix's momentum update by its nearest semi-orthogonal
matrix (all singular values ~1), found by a few Newton-Schulz iterations, so
every direction of the update moves at the same rate whatever the gradient's
spectrum. One optimizer with both kinds of parameter group keeps the trainer's
single `optimizer.step()`, its learning-rate schedule (each group scales the
scheduled rate by its `lr_ratio`) and its unsharded checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# the quintic iteration's coefficients: fast growth of small singular values,
# which then oscillate within about [0.7, 1.2] instead of converging to exactly 1
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(
    update: torch.Tensor,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """A matrix [m, n] -> about U V^T of its SVD U S V^T, by Newton-Schulz in `dtype`
    (bf16 is precise enough; fp32 where it is the faster, `devices.fast_matmul_dtype`)."""
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)  # the spectral norm is at most the Frobenius norm: <= 1
    m, n = x.shape
    # the Gram form costs 2 m^2 n + (4 steps - 3) m^3 multiply-adds against steps (2 m^2 n
    # + m^3): fewer once n > 1.5 m; it squares the spectrum, so only in fp32
    gram_form = dtype == torch.float32 and n > 1.5 * m
    x = (_gram_newton_schulz if gram_form else _newton_schulz)(x, steps)
    return (x.T if tall else x).to(update.dtype)


def _newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = _NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram_newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """`_newton_schulz`'s iterates from the [m, m] Gram matrix alone: each step is
    x <- p(g) x with g = x x^T, so x_k = q_k x_0 with q_k the product of the p's, and
    g_{k+1} = p g p (p is a polynomial in g): only the first and last products touch x's
    n columns."""
    a, b, c = _NS_COEFFICIENTS
    gram, q = x @ x.T, None
    for k in range(steps):
        p = b * gram + c * gram @ gram
        p.diagonal().add_(a)
        q = p if q is None else p @ q
        if k < steps - 1:
            gram = p @ gram @ p
    return q @ x


class MuonAdamW(torch.optim.Optimizer):
    """Groups with `muon: True` take Muon steps (Nesterov momentum, orthogonalised,
    scaled by sqrt(max(1, rows / cols))); the others AdamW steps. Each group's
    rate is `lr * lr_ratio`, so the trainer's schedule sets `lr` for all."""

    def __init__(
        self,
        groups: Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, momentum=momentum,
                        eps=eps, muon=False, lr_ratio=1.0)  # fmt: skip
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # Newton-Schulz's; not state: a resumed run may differ

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001 (torch's signature)
        for group in self.param_groups:
            lr = group["lr"] * group["lr_ratio"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.mul_(1 - lr * group["weight_decay"])
                if group["muon"]:
                    self._muon(p, group, lr)
                else:
                    self._adamw(p, group, lr)

    def _muon(self, p: torch.Tensor, group: dict, lr: float) -> None:
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.mul_(group["momentum"]).add_(p.grad)
        nesterov = p.grad.add(buf, alpha=group["momentum"])
        scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
        p.add_(orthogonalize(nesterov, dtype=self.ns_dtype), alpha=-lr * scale)

    def _adamw(self, p: torch.Tensor, group: dict, lr: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(())
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        n = float(state["step"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**n)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**n))


def muon_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], muon_lr_ratio: float
) -> list[dict]:
    """Muon for the hidden 2-D weights; AdamW for norms and for `lm_head`, whose rows
    are per-token outputs rather than one linear map to keep well conditioned."""
    hidden, rest = [], []
    for name, p in named:
        if p.requires_grad:
            (hidden if p.dim() == 2 and "lm_head" not in name else rest).append(p)
    groups = [{"params": hidden, "muon": True, "lr_ratio": muon_lr_ratio}]
    return groups + ([{"params": rest}] if rest else [])
