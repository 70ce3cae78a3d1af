"""benchmarks/peer: the hidden states we hand to speculators' trainer are the ones it
expects: its loader splits `hidden_states [T, A+1, Ht]` into the aux states
(`[:, :-1]`) and a last state that its loss passes through the verifier's final
norm (`verifier_norm(hs[:, -1])`), so that norm of it must be the target's
final hidden state. Its Muon's fp32 stand-in is torch's iteration, not a new one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from conftest import tiny_model

from eagletools.targets import capture_aux
from eagletools.targets.anatomy import final_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peer"))
from speculators_cpu import fp32_newton_schulz, ours  # noqa: E402
from speculators_train import their_states  # noqa: E402


def test_their_states_split_into_our_aux_and_final_hidden_state():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    layers = [1, 2, 3]
    states = their_states(model, ids, layers)
    assert states.shape == (11, 4, 64)
    ours = capture_aux(model, ids, layer_ids=layers)
    # their loader: hidden_states[:, :-1].flatten(1) and hidden_states[:, -1]
    torch.testing.assert_close(states[:, :-1].flatten(1), ours.aux[0], rtol=0, atol=0)
    final = model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the norm
    torch.testing.assert_close(final_norm(model)(states[:, -1]), final)
    assert not torch.allclose(states[:, -1], final)  # the norm is theirs to apply


def test_fp32_muon_stand_in_is_torchs_iteration_at_another_rounding():
    from torch.optim import _muon

    coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    gen = torch.Generator().manual_seed(0)
    for shape in [(48, 96), (96, 48), (64, 64)]:
        grad = torch.randn(*shape, generator=gen)
        theirs = _muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7)
        ours = fp32_newton_schulz(grad, coefficients, 5, 1e-7)
        assert ours.dtype == torch.float32 and ours.shape == grad.shape
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=2e-2)  # bf16's rounding
        other = fp32_newton_schulz(grad, coefficients, 4, 1e-7)  # one step fewer is far off
        assert (other - theirs.float()).abs().max() > 5e-2


def test_our_flags_leave_the_rest_for_their_trainer():
    argv = ["--lr=3e-3", "--max-tokens=600000", "--snapshots=4", "--seed", "0"]
    rest, tokens = ours(argv, "--max-tokens")
    assert (rest, tokens) == (["--lr=3e-3", "--snapshots=4", "--seed", "0"], 600000)
    assert ours(rest, "--max-tokens") == (rest, None)
