"""Muon + AdamW: the orthogonalised update against the SVD's polar factor, the AdamW
groups against torch's AdamW, the parameter split."""

from __future__ import annotations

import math

import pytest
import torch

from eagletools.train.muon import (
    MuonAdamW,
    _gram_newton_schulz,
    _newton_schulz,
    muon_groups,
    orthogonalize,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 96), (96, 32)])
def test_orthogonalize_is_near_the_polar_factor(shape, dtype):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    g[:, 0] *= 50  # an ill-conditioned gradient: Muon evens out its spectrum
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    out = orthogonalize(g, dtype=dtype)
    assert out.dtype == g.dtype
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    cosine = (out * (u @ vh)).sum() / (out.norm() * (u @ vh).norm())
    assert cosine > 0.97


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_first_muon_step_and_adamw_steps(ns_dtype):
    torch.manual_seed(0)
    tall = torch.nn.Parameter(torch.randn(48, 16))
    vec = torch.nn.Parameter(torch.randn(16))
    ref = torch.nn.Parameter(vec.detach().clone())
    opt = MuonAdamW(
        [{"params": [tall], "muon": True, "lr_ratio": 10.0}, {"params": [vec]}],
        lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, ns_dtype=ns_dtype,
    )  # fmt: skip
    adamw = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    start = tall.detach().clone()
    for step in range(3):
        grad = torch.randn(16)
        vec.grad, ref.grad = grad.clone(), grad.clone()
        tall.grad = torch.randn(48, 16)
        if step == 0:
            first_grad = tall.grad.clone()
        opt.step()
        adamw.step()
        if step == 0:
            # momentum starts at the gradient, Nesterov makes it (1 + 0.95) g; then
            # lr 0.1 (10x), sqrt(48/16) for a tall matrix, decay 0.1 at that lr
            update = orthogonalize(1.95 * first_grad, dtype=ns_dtype)
            want = start * (1 - 0.1 * 0.1) - 0.1 * math.sqrt(3) * update
            torch.testing.assert_close(tall.detach(), want)
    torch.testing.assert_close(vec, ref)


def test_muon_takes_the_hidden_matrices_only():
    model = torch.nn.ModuleDict(
        {
            "fc": torch.nn.Linear(4, 4),
            "lm_head": torch.nn.Linear(4, 8),
            "norm": torch.nn.LayerNorm(4),
        }
    )
    model["fc"].bias.requires_grad_(False)
    muon, rest = muon_groups(model.named_parameters(), 10.0)
    assert muon["params"] == [model["fc"].weight] and muon["lr_ratio"] == 10.0
    assert {id(p) for p in rest["params"]} == {
        id(model["lm_head"].weight), id(model["lm_head"].bias),
        id(model["norm"].weight), id(model["norm"].bias),
    }  # fmt: skip


@pytest.mark.parametrize("shape", [(48, 80), (32, 160)])
def test_gram_form_gives_the_same_iterates_in_fp32_only(shape):
    """orthogonalize's fp32 path for wide matrices, against the plain iteration in fp64,
    on a spectrum spread over four decades (the Gram matrix's over eight)."""
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[0], generator=gen, dtype=torch.float64))
    x = u @ torch.diag(torch.logspace(0, -4, shape[0], dtype=torch.float64)) @ v.T
    x = x / x.norm()
    exact = _newton_schulz(x, 5)
    assert torch.linalg.svdvals(exact).min() > 0.01  # the small directions grew: a real test
    fp32 = _gram_newton_schulz(x.float(), 5).double()
    torch.testing.assert_close(fp32, exact, atol=1e-3, rtol=0)  # bf16's plain form: ~0.1
    torch.testing.assert_close(orthogonalize(x.float(), dtype=torch.float32).double(), fp32)
    assert (_gram_newton_schulz(x.bfloat16(), 5).double() - exact).abs().max() > 1
