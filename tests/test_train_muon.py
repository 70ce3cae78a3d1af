"""Muon + AdamW: the orthogonalised update against the SVD's polar factor, the AdamW
groups against torch's AdamW, the parameter split."""

from __future__ import annotations

import math

import pytest
import torch

from eagletools.train.muon import MuonAdamW, muon_groups, orthogonalize


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
