"""Kimi K3's layer kinds through the megakernel (issue 66), each on a tiny model with just
that feature on an existing family (tests/builders.py), against mk.model.reference: greedy
tokens equal (float32, interpret mode, B 1 and 4, T 1 and 4; T = 4 steps under the race
detector), a planted bug in the kind's kernel half diverges, its simulator twin costs its
own work, the model compiles for a TPU ahead of time. The DMA order of each model:
tests/test_dma_order.py.

`situ_dense` (SiTU instead of SwiGLU's silu): tiny with K3's betas 4 and 25.
init_params' gate and up projections are about N(0, 1), where SiTU is nearly SwiGLU
(25 tanh(u / 25) is u to 0.05 %); here they are scaled (x3 and x20) so both soft caps
bite, and a control shows each cap alone changes the reference's tokens.

`gated_mla` (MLA's output gate): tiny-kimi cut to two MLA layers with a q low rank and
the gate; a control shows the gate changes the reference's tokens.

`bounded_kda` (KDA's bounded decay and full-rank output gate): tiny-kimi cut to two KDA
layers with K3's bound -5. init_params' forget gate is about N(0, 1) before the sigmoid, so
the log-decay spreads over most of (-5, 0) (5 to 95 %: -4.5 to -0.5 on the prompts'
rows) and scales with the bound; a control shows another bound, and a zero gate, each
change the reference's tokens.

`latent_moe` (the routed SiTU experts on a latent, its sum RMS-normed and projected back):
tiny-kimi cut to two MLA layers, a dense layer (situ_dense: SiTU is the model's) then a
latent MoE layer with a latent of 128. Its routed output is normed, so at init_params'
scales a bug there rarely changes a token: the experts' gate and up are scaled as
situ_model's (SiTU's caps bite), down x4 (the sum's RMS far from 1), latent_up x3 (the
routed output weighs more in x) and latent_norm's spread about 1 widened from 0.1 to 0.5.
A control shows latent_norm's weights and latent_up each change the reference's tokens,
and we_down's scale does not (the norm cancels it).

`res_layer` (Kimi K3's attention residuals): tiny-kimi grown to five layers (KDA, MLA,
MLA, KDA, MLA; dense MLPs) with a block every 2 layers, so blocks begin at 0, 2 and 4 and
layers 1 and 3 add to a block's sum. init_params' res projections are N(0, 1/D), so each
source's score is O(1) and the mixes weigh the sources unevenly; a control shows a
uniform mix (zero projections) and a sharper one (x4) each change the reference's
tokens. The plan counts the completed blocks' VMEM and names them when they do not fit.

`tiny-k3`, the preset with all five at once (K3's layers in small widths), decodes the
reference's tokens too (`make test-slow`; CI decodes it at tp 2, k3_tokens).

Not covered by interpret mode: time and the scoped VMEM limit (the compile test covers
lowering and capacity). At tp > 1: tests/test_tensor_parallel.py (k3_tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import mk
import mk.step.megakernel as megakernel
from mk.cost import perf
from mk.model import reference
from mk.measure import tpu
from mk.kinds.linear import deltanet
from mk.kinds.mlp import latent_moe as latent_kernels
from mk.step.plan import DecodePlan
from mk.kinds.attention import kinds as kinds_attention
from mk.kinds.mlp import latent as kinds_latent
from mk.kinds.linear import kinds as kinds_linear
from mk.kinds.mlp import kinds as kinds_mlp
from mk.kinds import residual as kinds_residual
from mk.kinds.layers import layer_kinds
from mk.model.weights import param_shapes
from builders import (simulated_step, assert_verify_steps, tiny_bounded_kda, tiny_gated_mla,
                      tiny_latent_moe, tiny_res_layer, tiny_situ)

pytestmark = pytest.mark.xdist_group("k3_megakernel")  # the reference compiled once a model
SLOW = pytest.mark.slow
TOKENS, CONTEXT = 16, 128
# (batch, rows): B 4, T 4 in CI (~30 CPU s each model), the others in make test-slow
SHAPES = [pytest.param(1, 1, marks=SLOW), (4, 4), pytest.param(4, 1, marks=SLOW),
          pytest.param(1, 4, marks=SLOW)]


def situ_model(**change):
    """(config, params) of tiny under SiTU, float32, its gate and up projections scaled so
    that both soft caps bite (module docstring)."""
    config = tiny_situ(dtype="float32", **change)
    params = mk.init_params(config)
    return config, params | {"w_gate": 3 * params["w_gate"], "w_up": 20 * params["w_up"]}


def gated_mla_model(**change):
    """(config, params) of the gated-MLA model, float32."""
    config = tiny_gated_mla(dtype="float32", **change)
    return config, mk.init_params(config)


def bounded_kda_model(**change):
    """(config, params) of the K3-KDA model, float32."""
    config = tiny_bounded_kda(dtype="float32", **change)
    return config, mk.init_params(config)


def latent_moe_model(**change):
    """(config, params) of the latent-MoE model, float32, scaled so that each of its
    pieces shows in the tokens (module docstring): the experts' gate and up as
    situ_model's (x3, x20), down x4, latent_up x3, latent_norm's spread about 1 widened
    from init_params' 0.1 to 0.5."""
    config = tiny_latent_moe(dtype="float32", **change)
    p = mk.init_params(config)
    return config, p | {"we_gate": 3 * p["we_gate"], "we_up": 20 * p["we_up"],
                        "we_down": 4 * p["we_down"], "latent_up": 3 * p["latent_up"],
                        "latent_norm": 1 + 5 * (p["latent_norm"] - 1)}


def res_layer_model(**change):
    """(config, params) of the attention-residual model, float32."""
    config = tiny_res_layer(dtype="float32", **change)
    return config, mk.init_params(config)


def k3_model(**change):
    """(config, params) of tiny-k3 itself, float32: every K3 kind in one model."""
    config = dataclasses.replace(mk.preset("tiny-k3"), dtype="float32", **change)
    return config, mk.init_params(config)


MODELS = {"situ_dense": situ_model, "gated_mla": gated_mla_model,
          "bounded_kda": bounded_kda_model, "latent_moe": latent_moe_model,
          "res_layer": res_layer_model, "tiny-k3": k3_model}
RES_PROJECTIONS = ("attn_res_proj", "mlp_res_proj", "output_res_proj")


def _prompt(config, batch: int):
    return jax.random.randint(jax.random.key(batch), (batch, 5), 0, config.vocab)


def _reference(config, params, batch: int = 1, tokens: int = TOKENS):
    prompt = _prompt(config, batch)
    return prompt, reference.generate(config, params, prompt, tokens, max_context=CONTEXT)


def _megakernel(config, params, prompt, tokens: int = TOKENS):
    return megakernel.generate(config, params, prompt, tokens, backend="interpret",
                               max_context=CONTEXT, steps_per_call=tokens // 2)


def _differs(config, params, want, **change) -> int:
    """How many of the reference's tokens change under the config `change`, the params
    the changed config has (a weight it has no place for dropped)."""
    other = dataclasses.replace(config, **change)
    kept = {n: p for n, p in params.items() if n in param_shapes(other)}
    prompt = _prompt(config, want.shape[0])
    got = reference.generate(other, kept, prompt, TOKENS, max_context=CONTEXT)
    return int((np.asarray(got) != np.asarray(want)).sum())


@pytest.mark.parametrize("kind, kinds", [("situ_dense", ["gqa", "situ_dense"]),
                                         ("gated_mla", ["gated_mla", "moe", "dense"]),
                                         ("bounded_kda", ["bounded_kda", "moe", "dense"]),
                                         ("latent_moe", ["mla", "latent_moe", "situ_dense"]),
                                         ("res_layer", ["kda", "mla", "dense", "res_layer"])])
def test_each_model_has_the_k3_kind_alone_and_the_kernel_runs_it(kind, kinds):
    config, _ = MODELS[kind]()
    assert [k.name for k in layer_kinds(config)] == kinds


@pytest.mark.slow  # in CI the planted bugs guard the token checks
def test_situ_s_caps_each_change_the_reference_s_tokens():
    """The control of the situ_dense checks: SwiGLU, SiTU with no gate cap (beta 1e4) and
    SiTU with no up cap (linear beta 1e4) each change most of the tokens, so a kernel
    that dropped either cap (or SiTU) fails them."""
    config, params = situ_model()
    _, want = _reference(config, params)
    for change in (dict(situ_beta=0.0, situ_linear_beta=0.0), dict(situ_beta=1e4),
                   dict(situ_linear_beta=1e4)):
        assert _differs(config, params, want, **change) > TOKENS // 2, change


@pytest.mark.slow  # in CI the planted bugs guard the token checks
def test_the_mla_output_gate_changes_the_reference_s_tokens():
    """The control of the gated_mla checks: the same model without the gate (MLA's kind)
    decodes other tokens."""
    config, params = gated_mla_model()
    _, want = _reference(config, params)
    assert _differs(config, params, want, attn_output_gate=False) > 0


@pytest.mark.slow  # in CI the planted bugs guard the token checks
def test_the_kda_bound_and_full_gate_each_change_the_reference_s_tokens():
    """The control of the bounded_kda checks: the bound -1 for K3's -5, or a zero kda_g (a
    gate of 1/2 everywhere), each decodes other tokens."""
    config, params = bounded_kda_model()
    _, want = _reference(config, params)
    assert _differs(config, params, want, kda_gate_bound=-1.0) > 0
    assert _differs(config, params | {"kda_g": 0 * params["kda_g"]}, want) > 0


@pytest.mark.slow  # in CI the planted bugs guard the token checks
def test_the_latent_norm_and_projection_each_change_the_reference_s_tokens():
    """The control of the latent_moe checks: latent_norm's weights all ones, or latent_up
    zero (no routed expert reaches D), each decodes other tokens; we_down x 3 does not (the
    latent sum's RMS norm cancels its scale), so a kernel that skipped the norm's division
    would fail them."""
    config, params = latent_moe_model()
    _, want = _reference(config, params)
    ones, zero = ({n: f(params[n])} for n, f in (("latent_norm", np.ones_like),
                                                 ("latent_up", np.zeros_like)))
    assert _differs(config, params | ones, want) > 0
    assert _differs(config, params | zero, want) > 0
    assert _differs(config, params | {"we_down": 3 * params["we_down"]}, want) == 0


# tiny-k3 (all five kinds in one model, ~35 CPU s) in make test-slow: CI runs each kind
# alone here (with its planted bugs) and tiny-k3's kinds together at tp 2
# (tests/test_tensor_parallel.py's tp2-k3, the same layers with each shard's widths)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=SLOW) if k == "tiny-k3" else k
                                  for k in MODELS])
@pytest.mark.parametrize("batch, rows", SHAPES)
def test_k3_kind_greedy_tokens_equal_the_reference(kind, batch, rows):
    """T = 1: `generate`, TOKENS tokens over host dispatches of several steps. T = 4:
    verification steps fed the reference's tokens (a perfect draft) predict its next 4,
    race detector on."""
    config, params = MODELS[kind]()
    prompt, want = _reference(config, params, batch)
    if rows == 1:
        np.testing.assert_array_equal(_megakernel(config, params, prompt), want)
        return
    assert_verify_steps(config, params, params, prompt, want, rows, TOKENS)


@pytest.mark.slow  # in CI the planted bugs guard the token checks
def test_the_residual_mixing_changes_the_reference_s_tokens():
    """The control of the res_layer checks: every mix uniform (zero projections: each
    source weighs 1/n) or sharper (projections x4) decodes other tokens, so a kernel
    that mixed with the wrong weights (or not at all) fails them."""
    config, params = res_layer_model()
    _, want = _reference(config, params)
    for scale in (0.0, 4.0):
        scaled = params | {n: scale * params[n] for n in RES_PROJECTIONS}
        assert _differs(config, scaled, want) > 0, scale


@pytest.mark.slow  # the token checks cover it in CI; this names the op
def test_the_res_layer_taps_follow_the_reference_layer_by_layer():
    """The residual stream after each mixer and MLP (the current block's partial sum:
    the reference's taps) agrees with the reference's op by op (`first_divergence`), so
    a block edge that stored the wrong sum would be named where it happens."""
    config, params = res_layer_model()
    prompt = _prompt(config, 2)
    _, cache = reference.prefill(config, params, prompt, max_context=CONTEXT)
    plan = DecodePlan.make(config, batch=2, rows=2, context=cache.capacity)
    first, report = megakernel.first_divergence(
        plan, params, cache, prompt[:, -2:], jax.numpy.full((2,), 5), backend="interpret")
    assert first is None and len(report) == 2 * config.layers, report


def _no_gate(self, k):  # MLA's output: the heads' outputs, ungated
    kinds_attention.MLA.output(self, k)


def _bound_minus_one(ring, config, *args):  # K3's KDA gates under the bound -1, not -5
    deltanet.bounded_kda_gates(ring, dataclasses.replace(config, kda_gate_bound=-1.0), *args)


def _norm_unscaled(x, weight, eps):  # the latent sum RMS-normed without latent_norm
    return mk.model.ops.rms_norm(x, np.float32(1.0) + 0 * weight, eps)


def _norm_undivided(x, weight, eps):  # the latent sum scaled by latent_norm, not normed
    return x * weight


_COUNTED = kinds_residual.ResLayer.counted
PLANTED = {  # a bug in a kind's kernel half: (kind, class, method, replacement)
    "situ_swapped_betas": ("situ_dense", kinds_mlp.SituDense, "activation",
                           lambda self: lambda g, u: kinds_mlp.situ(g, u, 25.0, 4.0)),
    "situ_no_up_cap": ("situ_dense", kinds_mlp.SituDense, "activation",
                       lambda self: lambda g, u: kinds_mlp.situ(g, u, 4.0, 1e4)),
    "mla_no_gate": ("gated_mla", kinds_attention.GatedMLA, "output", _no_gate),
    "kda_wrong_bound": ("bounded_kda", kinds_linear.BoundedKDA, "gates",
                        dataclasses.replace(deltanet.BOUNDED_GATES, compute=_bound_minus_one)),
    "kda_silu_gate": ("bounded_kda", kinds_linear.BoundedKDA, "gates",  # Qwen3.5's gate
                      dataclasses.replace(deltanet.BOUNDED_GATES, output_gate=jax.nn.silu)),
    "latent_norm_unscaled": ("latent_moe", latent_kernels, "rms_norm", _norm_unscaled),
    "latent_norm_undivided": ("latent_moe", latent_kernels, "rms_norm", _norm_undivided),
    "latent_swiglu_experts": ("latent_moe", kinds_latent.LatentMoE, "activation",
                              lambda self: kinds_mlp.silu_gate),
    "res_no_block_start": ("res_layer", kinds_residual.ResLayer, "add",  # a plain stream
                           lambda self, k, x, out: x + out),
    "res_mix_skips_a_block": ("res_layer", kinds_residual.ResLayer, "counted",
                              lambda self, step, part: _COUNTED(self, step, part)
                              - (part == "attn"))}  # the mixer's mix misses the newest
SLOW_PLANTED = ("situ_no_up_cap", "kda_silu_gate", "latent_norm_undivided",
                "latent_swiglu_experts", "res_mix_skips_a_block")
PLANTED_TOKENS = 4  # each planted bug changes one of the first 4 tokens (fewer steps)
# but the latent MoE's: its routed output is RMS-normed, so a bug there shows later (of
# the 16 tokens of one sequence, the prompt of key 1, the reference under each of its bugs
# changes 13, 16 and 11; of the first 4: 1, 4 and 0)
PLANTED_TOKENS_OF = {"latent_moe": TOKENS}
PLANTED_ROWS = 4
# The token checks' prompt (B 4) and reference run, so that on their worker (the module's
# xdist_group) the reference's compiled programs are shared.
PLANTED_BATCH = 4


@pytest.mark.parametrize("planted", [  # CI: one planted bug a kind; `make test-slow` all
    pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PLANTED else p for p in PLANTED])
def test_a_planted_bug_in_a_k3_kind_diverges(planted, monkeypatch):
    """The guard of the token checks: the kernel's SiTU at other betas than the config's,
    its MLA without the gate, its K3 KDA under another bound or with SiLU's output gate,
    or its latent MoE's norm without latent_norm's scale or its division, or SwiGLU
    experts (the reference keeps them), predicts other tokens than the reference's among
    the first 4 of each of the token checks' 4 sequences (the latent MoE's: 16), fed the
    reference's tokens 4 a step: the T = 4 token checks' own `assert_verify_steps` fails.
    (A greedy run's first changed token is the first predicted differently from the same
    prefix, so this finds what a greedy run of as many tokens finds, from one trace of
    the step.)"""
    kind, cls, method, replacement = PLANTED[planted]
    config, params = MODELS[kind]()
    tokens = PLANTED_TOKENS_OF.get(kind, PLANTED_TOKENS)
    prompt, want = _reference(config, params, PLANTED_BATCH)
    monkeypatch.setattr(cls, method, replacement)
    config = dataclasses.replace(config, name=f"planted-{planted}")  # a trace of its own
    with pytest.raises(AssertionError, match="tokens"):
        assert_verify_steps(config, params, params, prompt, want, PLANTED_ROWS, tokens,
                            detect_races=False)


def _simulated(config):
    return simulated_step(config, "v5e", batch=4, rows=2, context=100)


def _busy(run, what) -> float:
    return sum(e.busy_s for e in run.events if e.what == what)


def test_the_situ_twin_costs_its_activation_as_the_kind_counts_it():
    """The simulator's SiTU layer: the same bytes as SwiGLU's (the same weights and
    stream), its activation's vector work `SituDense.act_ops` per element of the gate,
    twice SwiGLU's, under its own name. bf16: the simulator's tile costs are bf16's."""
    config = tiny_situ()
    got, plain = (_simulated(c) for c in
                  (config, dataclasses.replace(config, situ_beta=0.0, situ_linear_beta=0.0)))
    assert got.family_bytes() == plain.family_bytes()
    assert _busy(got, "swiglu") == 0 and _busy(plain, "situ") == 0
    assert _busy(got, "situ") == pytest.approx(2 * _busy(plain, "swiglu"))
    assert kinds_mlp.SituDense.act_ops == 2 * kinds_mlp.Dense.act_ops


def test_the_gated_mla_twin_streams_wg_and_costs_the_gate():
    """The simulator's gated MLA layer: MLA's bytes plus wg's (each layer's [D, N*Ho] in
    the attention family), the gate's vector work after the up-projection, which MLA's
    layer has none of."""
    config = tiny_gated_mla()
    got, plain = (_simulated(c) for c in
                  (config, dataclasses.replace(config, attn_output_gate=False)))
    extra = {f: got.family_bytes()[f] - plain.family_bytes().get(f, 0)
             for f in got.family_bytes()}
    wg = config.layers * config.hidden * config.heads * config.value_dim * 2  # bf16
    assert {f: b for f, b in extra.items() if b} == {"attention": wg}
    assert _busy(got, "output_gate") > 0 == _busy(plain, "output_gate")


def test_the_bounded_kda_twin_streams_kda_g_for_the_low_rank_gate():
    """The simulator's K3 KDA layer: kda_g through the ring in its gates, Kimi Linear's
    layer (the low-rank gate's pair, by DMA) none; the same bytes per family at these
    widths (D Nv Hv = D Hv + Hv Nv Hv with D = Nv Hv = 256)."""
    config = tiny_bounded_kda()
    got, plain = (_simulated(c) for c in
                  (config, dataclasses.replace(config, kda_full_gate=False,
                                               kda_gate_bound=0.0)))
    assert got.family_bytes() == plain.family_bytes()
    assert _busy(got, "kda_g") > 0 == _busy(plain, "kda_g")


def test_the_latent_moe_twin_streams_the_latent_and_costs_its_norm():
    """The simulator's latent MoE layer against Kimi Linear's MoE layer of the same model
    (SwiGLU, experts on D): latent_down and latent_up in the dense-MLP bytes (each MoE
    layer's [D, Lt] and [Lt, D]), latent_norm's DMA in the norms', each active expert's
    bytes Lt / D of the plain one's; SiTU's vector work, not SwiGLU's, and the latent's
    norm, which the plain layer has none of."""
    config = tiny_latent_moe()
    got, plain = (_simulated(c) for c in
                  (config, dataclasses.replace(config, moe_latent=0, situ_beta=0.0,
                                               situ_linear_beta=0.0)))
    extra = {f: got.family_bytes()[f] - plain.family_bytes().get(f, 0)
             for f in got.family_bytes()}
    D, Lt, moe = config.hidden, config.moe_latent, len(config.moe_layers)
    assert extra["dense_mlp"] == moe * 2 * D * Lt * 2  # bf16
    assert extra["norms"] == moe * Lt * 4  # f32
    assert got.family_bytes()["experts"] == plain.family_bytes()["experts"] * Lt / D
    assert _busy(got, "latent_norm") > 0 == _busy(plain, "latent_norm")
    assert _busy(got, "situ") > 0 == _busy(plain, "situ")
    assert _busy(got, "swiglu") == 0 < _busy(plain, "swiglu")


def test_the_latent_moe_plan_simulator_and_perf_count_the_same_bytes():
    """One row (exactly top-k experts active): the plan's ledger, the simulator's replay
    and mk.cost.perf's estimate of the latent model move the same bytes per weight family (the
    kernel's own, DMA by DMA: tests/test_dma_order.py)."""
    config = tiny_latent_moe()
    plan = DecodePlan.make(config, batch=1, rows=1, context=config.max_context)
    active = config.experts_per_token
    ledger = {f: b for f, b in plan.weight_bytes(active).items() if b}
    replay = simulated_step(config, "v5e", batch=1, rows=1, context=37, block=plan.block,
                            experts_active=active).family_bytes()
    roof = perf.predict(config, "v5e", batch=1, rows=1, context=37, routing="shared")
    by_perf = dict(attention=roof.attention_bytes, norms=roof.norm_bytes,
                   dense_mlp=roof.dense_mlp_bytes, router=roof.router_bytes,
                   experts=roof.expert_bytes, lm_head=roof.lm_head_bytes)
    assert {f: replay[f] for f in ledger} == ledger == by_perf


def test_the_res_layer_twin_streams_its_queries_and_costs_its_mixes():
    """The simulator's attention residuals: the same bytes as the plain stream's but the
    queries' (two of D per layer, float32, and the lm_head's one), the mixes' vector work
    under their own name, which the plain stream has none of."""
    config = tiny_res_layer()
    got, plain = (_simulated(c) for c in
                  (config, dataclasses.replace(config, residual_block=0)))
    extra = {f: got.family_bytes()[f] - plain.family_bytes().get(f, 0)
             for f in got.family_bytes()}
    D = config.hidden
    assert {f: b for f, b in extra.items() if b} == {"norms": (config.layers * 2 + 1) * D * 4}
    assert _busy(got, "res_mix") > 0 == _busy(plain, "res_mix")


def test_the_plan_counts_the_residual_blocks_vmem_and_names_them_when_over():
    """The completed blocks ([ceil(L / residual_block), B*T, D] float32) are a buffer of
    the plan, so its fit counts them; over the chip's VMEM (kimi-k2-shaped's widths with
    K3's blocks of 12 layers at B = 64 on TPU7x), the error names them and what shrinks
    them."""
    config = dataclasses.replace(mk.preset("kimi-k2-shaped"), residual_block=12)
    plan = DecodePlan.make(config, tp=8, batch=8, context=1024, chip="tpu7x")
    blocks = plan.buffers["residual.res_blocks"]
    assert blocks.shape == (8, 8, config.hidden)  # ceil(93 / 12) = 8 blocks of 8 rows
    assert blocks in plan.fits("tpu7x").vmem.buffers
    with pytest.raises(ValueError, match=r"res_blocks \(8, 64, 7168\).* Attention residuals "
                                         r"keep 8 completed blocks .* 14.0 MiB"):
        DecodePlan.make(config, tp=8, batch=64, context=1024, chip="tpu7x")


@pytest.mark.parametrize("builder", [tiny_situ, tiny_gated_mla, tiny_bounded_kda,
                                     tiny_latent_moe, tiny_res_layer])
def test_each_k3_kind_model_compiles_for_tpu(builder):
    """Mosaic lowers the kinds' new pieces (SiTU's tanh caps; the gate's ring segment and
    sigmoid; the bounded decay's sigmoid and kda_g's segment; the latent's segments and
    norm; the residual mixes' softmax over the stored blocks) for the v5e at T = 4 (ahead
    of time, on the CPU: ~2, ~6, ~7, ~7 and ~20 s)."""
    report = tpu.compile_megakernel(DecodePlan.make(builder(), chip="v5e", batch=4, rows=4,
                                                    context=1024))
    assert report.ok, report.error
