"""CPU fast paths against the plain ops: packed linears (products, gradients, fresh
weights), our bf16 kernel (products, row independence, when it is taken) and argmax
(ties)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from eagletools import cpu_ops, native
from eagletools.cpu_ops import PackedLinear, argmax, linear, pack_linears, packing_available

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN bf16 packing")
needs_native = pytest.mark.skipif(native.bf16_linear() is None, reason="no AVX2 or no compiler")


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1)).max() <= tol)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 12, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 96, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16() if bias else None
    x = torch.randn(2, rows, 96, generator=g).bfloat16()
    with torch.no_grad():
        assert close(linear(x, w, b), F.linear(x, w, b), 1e-2)
        strided = torch.randn(96, rows, generator=g).bfloat16().t()  # not contiguous
        assert close(linear(strided, w, b), F.linear(strided, w, b), 1e-2)


@needs_packing
def test_a_changed_weight_is_packed_again():
    w = torch.randn(16, 32).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    with torch.no_grad():
        first = linear(x, w, None)
        w.mul_(-2)  # in place: same storage, new version
        assert close(linear(x, w, None), -2 * first, 1e-2)
        w.copy_(torch.randn(16, 32))
        assert close(linear(x, w, None), F.linear(x, w), 1e-2)


@needs_native
@pytest.mark.parametrize("out_features, in_features", [(13, 37), (40, 96), (64, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_our_bf16_product_is_the_fp32_product_rounded(out_features, in_features, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = native.bf16_linear()(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fp32 sums in another order than torch's: a bf16 step of the output at most
    assert ((got.float() - want).abs() <= want.abs() / 128 + 1e-4).all()


@needs_native
def test_our_bf16_product_of_a_row_does_not_depend_on_the_others():
    """What exact decoding needs: a token's row alone (plain decoding) and among a tree's
    rows (verification) come out bit for bit the same, at every row count and place."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 200, generator=g).bfloat16()
    b = torch.randn(72, generator=g).bfloat16()
    x = torch.randn(64, 200, generator=g).bfloat16()
    op = native.bf16_linear()
    alone = torch.cat([op(row[None], w, b) for row in x])
    for rows in (2, 3, 4, 7, 33, 64):
        assert torch.equal(op(x[:rows], w, b), alone[:rows]), rows
    assert torch.equal(op(x.view(4, 16, 200), w, b), alone.view(4, 16, 72))
    assert torch.equal(op(x.t().contiguous().t(), w, b), alone)


def test_linear_takes_our_kernel_for_few_bf16_rows_where_onednn_cannot_pack(monkeypatch):
    calls = []

    def spy(x, w, b):
        calls.append(len(x.reshape(-1, w.shape[1])))
        return F.linear(x, w, b)

    monkeypatch.setattr(cpu_ops, "packing_available", lambda: False)
    monkeypatch.setattr(native, "bf16_linear", lambda: spy)
    cpu_ops.product_route.cache_clear()  # chosen again, with the above
    monkeypatch.setattr(cpu_ops, "product_route", cpu_ops.product_route.__wrapped__)
    w = torch.randn(8, 16).bfloat16()
    with torch.no_grad():
        linear(torch.randn(3, 16).bfloat16(), w, None)
        linear(torch.randn(65, 16).bfloat16(), w, None)  # many rows: torch's product
        linear(torch.randn(3, 16), w.float(), None)  # fp32: torch's
    linear(torch.randn(3, 16).bfloat16(), w.requires_grad_(), None)  # a gradient: torch's
    assert calls == [3] and cpu_ops.product_route() == "native"


@needs_native
@pytest.mark.parametrize("dim", [37, 576])
def test_our_rms_norm_rounds_as_hugging_face_llama_norm(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(2, 7, dim, generator=g).bfloat16()
    w = torch.randn(dim, generator=g).bfloat16()
    with torch.no_grad():
        got = cpu_ops.rms_norm(x, w, 1e-5)
    h = x.float()
    hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert close(got, hf, 1e-2)
    alone = torch.stack([native.rms_norm()(row, w, 1e-5) for row in x.view(-1, dim)])
    assert torch.equal(alone.view_as(got), got)  # a row's bits never follow the others


def test_rms_norm_keeps_torch_for_gradients_and_other_dtypes():
    x = torch.randn(3, 16).bfloat16().requires_grad_()
    w = torch.ones(16)  # fp32 master weights under bf16 autocast
    out = cpu_ops.rms_norm(x, w, 1e-6)
    out.float().sum().backward()
    assert x.grad is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(
        cpu_ops.rms_norm(x.float(), w, 1e-6), F.rms_norm(x.float(), (16,), w, 1e-6)
    )


def test_grad_flows_through_the_unpacked_path():
    layer = PackedLinear(32, 8).bfloat16()
    x = torch.randn(5, 32).bfloat16().requires_grad_()
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    assert torch.isfinite(layer.weight.grad.float()).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_single_row_equals_the_matrix_path(dtype, tol, bias):
    torch.manual_seed(0)
    layer = PackedLinear(96, 40, bias=bias).to(dtype)
    one, many = torch.randn(1, 1, 96, dtype=dtype), torch.randn(2, 3, 96, dtype=dtype)
    with torch.no_grad():
        out = layer(one)
        assert out.shape == (1, 1, 40)
        assert close(out, F.linear(one, layer.weight, layer.bias), tol)
        assert close(layer(many), F.linear(many, layer.weight, layer.bias), tol)


def test_pack_linears_keeps_the_model_and_its_state_dict():
    model = tiny_model("llama", seed=0).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        keys = list(model.state_dict())
        pack_linears(model)
        got = model(ids).logits
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert list(model.state_dict()) == keys
    assert close(got, ref, 3e-2)
    copy.deepcopy(model)  # the packed copies live outside the module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_takes_the_first_maximum_like_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 5000, generator=g) * 2).round().to(dtype)  # ties at most maxima
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[0], 0), x[0].argmax())


@needs_packing
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (4096, 576)])
def test_a_rows_product_does_not_depend_on_the_other_rows(out_features, in_features):
    """Batch invariance (docs/design.md 3.6): up to 64 rows, row i of a packed bf16
    product has the same bits as row i alone, so a tree verify and one-token
    decoding give a token the same logits. SmolLM2's shapes; [576, 1536] failed for
    6 of 64 lone rows on an AVX-512 CPU without AMX before lone rows ran as two, and
    every count of 33 to 64 rows on a Xeon with AMX before rows ran in blocks of 32."""
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(64, in_features, generator=g).bfloat16()
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1], w, None) for i in range(64)])
        assert torch.equal(linear(x[7].view(1, 1, -1), w, None).view(1, -1), alone[7:8])
        for rows in (2, 5, 16, 32, 33, 63, 64):
            assert torch.equal(linear(x[:rows], w, None), alone[:rows])


@needs_native
@pytest.mark.parametrize("v_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("t, mask", [(1, None), (4, "causal"), (5, "rows")])
def test_our_attention_matches_the_grouped_products(v_dtype, t, mask):
    from eagletools.decode.model import _grouped_attention, extend_mask

    g = torch.Generator().manual_seed(t)
    s = 40
    q = torch.randn(2, 6, t, 64, generator=g).bfloat16()
    k = torch.randn(2, 2, 64, 64, generator=g)[:, :, :s]  # a cache view: strided rows
    v = torch.randn(2, 2, 64, 64, generator=g).to(v_dtype)[:, :, :s]
    m = {
        None: None,
        "causal": extend_mask(s - t, t),
        "rows": torch.rand(2, t, s, generator=g) > 0.3,
    }[mask]
    got = cpu_ops.attention_op(q, k, v)(q, k, v, m, 64**-0.5)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert close(got, _grouped_attention(q, k, v, m, True), 1e-2)


@needs_native
def test_our_attention_of_a_tree_path_equals_the_same_tokens_decoded_plainly():
    """Exact decoding's need: a node of a draft tree attends to its ancestors among
    hidden siblings; plain decoding later holds the same keys contiguous, bit for bit."""
    g = torch.Generator().manual_seed(0)
    prefix, nodes = 30, 6
    q = torch.randn(1, 9, 1, 64, generator=g).bfloat16()
    k = torch.randn(1, 3, prefix + nodes, 64, generator=g)
    v = torch.randn(1, 3, prefix + nodes, 64, generator=g).double()
    path = [0, 2, 5]  # the node's ancestors and itself, siblings hidden between
    visible = torch.zeros(1, prefix + nodes, dtype=torch.bool)
    visible[0, :prefix] = True
    visible[0, [prefix + i for i in path]] = True
    op = cpu_ops.attention_op(q, k, v)
    in_tree = op(q, k, v, visible, 0.125)
    keep = visible[0]
    plain = op(q, k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), None, 0.125)
    assert torch.equal(in_tree, plain)
