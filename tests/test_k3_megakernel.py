"""Kimi K3's layer kinds through the megakernel (issue 66), each on a tiny model with just
that feature on an existing family, against mk.reference: greedy tokens equal (float32,
interpret mode, B 1 and 4, T 1 and 4; T = 4 steps under the race detector), a planted bug
in the kind's kernel half diverges, and its simulator twin costs its own vector work.

`situ_dense` (SiTU instead of SwiGLU's silu): tiny (Qwen3's dense GQA model) with K3's
betas 4 and 25. init_params' gate and up projections are about N(0, 1), where SiTU is
nearly SwiGLU (25 tanh(u / 25) is u to 0.05 %); here they are scaled (x3 and x20) so both
soft caps bite, and a control shows each cap alone changes the reference's tokens.

Not covered by interpret mode: time and the scoped VMEM limit (the TPU compile tests).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import mk
import mk.megakernel as megakernel
from mk import reference, sim
from mk.kinds import mlp as kinds_mlp
from mk.kinds.layers import REFERENCE_ONLY, layer_kinds
from builders import assert_verify_steps

SLOW = pytest.mark.slow
TOKENS, CONTEXT = 16, 128
K3_SITU = dict(situ_beta=4.0, situ_linear_beta=25.0)  # the release's Config


def situ_model(**change):
    """(config, params) of tiny under SiTU, float32, its gate and up projections scaled so
    that both soft caps bite (module docstring)."""
    config = dataclasses.replace(mk.preset("tiny"), **dict(
        name="tiny-situ", dtype="float32", **K3_SITU) | change)
    params = mk.init_params(config)
    return config, params | {"w_gate": 3 * params["w_gate"], "w_up": 20 * params["w_up"]}


def _prompt(config, batch: int, seed: int = 0):
    return jax.random.randint(jax.random.key(seed + batch), (batch, 5), 0, config.vocab)


def test_situ_dense_is_a_kernel_kind_and_its_caps_change_the_tokens():
    """The model's MLP kind is situ_dense, no longer reference-only; the control: SwiGLU,
    SiTU with no gate cap (beta 1e4) and SiTU with no up cap (linear beta 1e4) each give
    other reference tokens than K3's betas, so a kernel that dropped either cap (or SiTU)
    would fail the checks below."""
    config, params = situ_model()
    assert "situ_dense" not in REFERENCE_ONLY
    assert [k.name for k in layer_kinds(config)] == ["gqa", "situ_dense"]
    prompt = _prompt(config, 1)
    want = reference.generate(config, params, prompt, TOKENS, max_context=CONTEXT)
    for change in (dict(situ_beta=0.0, situ_linear_beta=0.0), dict(situ_beta=1e4),
                   dict(situ_linear_beta=1e4)):
        other = dataclasses.replace(config, **change)
        assert (reference.generate(other, params, prompt, TOKENS, max_context=CONTEXT)
                != want).sum() > TOKENS // 2, change


# CPU seconds on the shared cores: ~25 each (B 4, T 4 in CI; the others make test-slow)
@pytest.mark.parametrize("batch, rows", [pytest.param(1, 1, marks=SLOW), (4, 4),
                                         pytest.param(4, 1, marks=SLOW),
                                         pytest.param(1, 4, marks=SLOW)])
def test_situ_dense_greedy_tokens_equal_the_reference(batch, rows):
    """T = 1: `generate`, TOKENS tokens over host dispatches of several steps. T = 4:
    verification steps fed the reference's tokens (a perfect draft) predict its next 4,
    race detector on."""
    config, params = situ_model()
    prompt = _prompt(config, batch)
    want = reference.generate(config, params, prompt, TOKENS, max_context=CONTEXT)
    if rows == 1:
        got = megakernel.generate(config, params, prompt, TOKENS, backend="interpret",
                                  max_context=CONTEXT, steps_per_call=TOKENS // 2)
        np.testing.assert_array_equal(got, want)
        return
    assert_verify_steps(config, params, params, prompt, want, rows, TOKENS)


@pytest.mark.parametrize("planted", [dict(beta=25.0, linear_beta=4.0),  # swapped betas
                                     dict(beta=4.0, linear_beta=1e4)])  # no up cap
def test_a_situ_kernel_with_a_wrong_beta_diverges(planted, monkeypatch):
    """The guard of the test above: the kernel's SiTU at other betas than the config's
    (the reference keeps them) gives other tokens."""
    config, params = situ_model()
    prompt = _prompt(config, 1)
    want = reference.generate(config, params, prompt, TOKENS, max_context=CONTEXT)
    monkeypatch.setattr(kinds_mlp.SituDense, "activation",
                        lambda self: lambda g, u: kinds_mlp.situ(g, u, **planted))
    planted_config = dataclasses.replace(  # a trace of its own
        config, name=f"planted-situ-{planted['beta']}-{planted['linear_beta']}")
    got = megakernel.generate(planted_config, params, prompt, TOKENS, backend="interpret",
                              max_context=CONTEXT, steps_per_call=TOKENS // 2)
    assert (np.asarray(got) != np.asarray(want)).any()


def test_the_situ_twin_costs_its_activation_as_the_kind_counts_it():
    """The simulator's SiTU layer: the same bytes as SwiGLU's (the same weights and
    stream), its activation's vector work `SituDense.act_ops` per element of the gate,
    twice SwiGLU's, under its own name."""
    config, _ = situ_model(dtype="bfloat16")  # the simulator's tile costs are bf16's
    swiglu = dataclasses.replace(config, situ_beta=0.0, situ_linear_beta=0.0)
    got, plain = (sim.simulate(c, "v5e", batch=4, rows=2, context=100)
                  for c in (config, swiglu))
    assert got.family_bytes() == plain.family_bytes()

    def busy(run, what):
        return sum(e.busy_s for e in run.events if e.what == what)

    assert busy(got, "swiglu") == 0 and busy(plain, "situ") == 0
    assert busy(got, "situ") == pytest.approx(2 * busy(plain, "swiglu"))
    assert kinds_mlp.SituDense.act_ops == 2 * kinds_mlp.Dense.act_ops
