"""`compiling.compile_frozen` on CPU: every linear from inductor's C++ GEMM template,
a row's bits the same among any rows, attention's products kept whole."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from eagletools.compiling import compile_frozen
from eagletools.cpu_ops import batched_product


@torch.inference_mode()
def test_the_gemm_template_gives_a_row_the_same_bits_among_any_rows():
    """Exact decoding rests on this: a token's logits do not depend on how many
    tree nodes share its products. A graph per row count, and one dynamic in it."""
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    up, down = torch.nn.Linear(192, 384, bias=False), torch.nn.Linear(384, 192, bias=False)
    up, down = up.bfloat16(), down.bfloat16()
    x = torch.randn(9, 192).bfloat16()

    def block(x):  # a linear, an activation, a linear with the residual fused after it
        return x + down(torch.nn.functional.silu(up(x)))

    counters.clear()
    step = compile_frozen(block, "")
    outs = {rows: step(x[:rows]) for rows in (1, 2, 3, 5, 9)}
    assert counters["inductor"]["cpp_templated_kernel_counter"] > 0  # the template ran
    for rows, out in outs.items():
        assert torch.equal(out, outs[9][:rows]), (rows, seed)
    assert not torch.equal(outs[9], block(x))  # a fused epilogue skips a rounding: not eager


@torch.inference_mode()
def test_attention_products_compile_whole_and_equal_eager():
    """The template has no form for a product with a dynamic key count (nor float64):
    `batched_product` keeps it whole, with eager's bits."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))

    def scores_then_values(q, k, v):
        p = batched_product(q, k.transpose(1, 2), 0.125).softmax(-1)
        return batched_product(p.double(), v)

    step = compile_frozen(scores_then_values, "L['k']:1,L['v']:1")
    for keys in (7, 30):
        q = torch.randn(3, 6, 64, generator=g)
        k = torch.randn(3, keys, 64, generator=g)
        v = torch.randn(3, keys, 64, generator=g, dtype=torch.float64)
        torch.testing.assert_close(step(q, k, v), scores_then_values(q, k, v))


@torch.inference_mode()
def test_a_graph_rounds_to_bf16_where_the_program_does():
    """A bf16 result the program rounds before widening it (RoPE's output before the
    fp32 score product) keeps that rounding in a fused kernel: a row's bits follow
    the program, not inductor's fusion plan."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(3, 2, 64, generator=g).bfloat16()
    cos, sin = torch.randn(2, 3, 1, 64, generator=g).bfloat16()

    def rotate_then_widen(x, cos, sin):
        return (x * cos + x.roll(32, -1) * sin).float() * 0.125

    step = compile_frozen(rotate_then_widen, "")
    assert torch.equal(step(x, cos, sin), rotate_then_widen(x, cos, sin))


class Scaled(torch.nn.Module):
    """A linear whose output a bool flag on a submodule changes, as `Attention.exact` does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(16, 16, bias=False)
        self.inner.doubled = False

    def forward(self, x):
        y = self.inner(x)
        return y * 2 if self.inner.doubled else y


@torch.inference_mode()
def test_a_frozen_step_follows_swapped_parameters_and_flags():
    """The guards `frozen_module_guards` keeps: a parameter replaced by another object
    (FSDP2's swap, `load_state_dict(assign=True)`) and a submodule's bool flag each
    compile the step again; the module's hooks and types are not checked."""
    model = Scaled().eval()
    step = compile_frozen(model, "")
    x = torch.randn(2, 16)
    torch.testing.assert_close(step(x), model(x))
    model.inner.weight = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    torch.testing.assert_close(step(x), model(x))
    model.inner.doubled = True
    torch.testing.assert_close(step(x), model(x))
