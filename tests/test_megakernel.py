"""mk.step.megakernel: the whole decode step in one pallas_call against mk.model.reference.

Greedy tokens must equal the reference's exactly (interpret mode; race detector on for
single steps); whole-model TPU compiles at full size take seconds each. Interpret mode does
not cover time or the scoped VMEM limit; the compiles cover lowering and capacity.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
import mk.step.megakernel as megakernel
from mk.kernels import backend
from mk.model import quant, reference
from mk.measure import tpu
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan, default_block
from mk.model.weights import abstract_params, param_shapes
from builders import assert_verify_steps, bar_count

TOKENS = 64


# CPU seconds of each plain case on this machine (interpret mode, compile included): tiny
# 48, 67, 28, 41; tiny-moe 116, 173, 73, 92; quantised ones a few seconds more. CI
# (`make test`) runs tiny at B = 4, T = 4 with fp8 and fp4 (race detector on); notebook
# 12's run checks int8 and int4 (tiny-moe, its experts too) in CI. `make test-slow` runs
# every model x (B, T) plain and with each scheme in every family, and two mixes. Plain
# MoE tokens are checked in CI by the speculative and tensor-parallel tests.
SLOW = pytest.mark.slow
SHAPES = [("tiny", 1, 1), ("tiny", 4, 1), ("tiny", 1, 4), ("tiny", 4, 4),
          ("tiny-moe", 1, 1), ("tiny-moe", 4, 1), ("tiny-moe", 1, 4), ("tiny-moe", 4, 4)]
IN_CI = (("tiny", 4, 4, "dense=fp8 lm_head=fp4"),)
SLOW_MIXED = (("tiny", 1, 1, "dense=int4 lm_head=int8"),)
MIXED = (*IN_CI, *SLOW_MIXED, ("tiny-moe", 4, 4, "dense=fp4 experts=int4 lm_head=fp8"))  # a tuple:
#        xdist workers must collect the same order


def _formats(name: str, spelled: str | None) -> dict:
    """"dense=int4 lm_head=int8" -> {"dense": "int4", "lm_head": "int8"}; a bare scheme
    quantises every family `name` has."""
    if spelled is None:
        return {}
    if "=" not in spelled:
        families = ("dense", "experts", "lm_head") if "moe" in name else ("dense", "lm_head")
        return dict.fromkeys(families, spelled)
    return dict(pair.split("=") for pair in spelled.split())


CASES = [(*shape, f) for shape in SHAPES for f in (None, *quant.SCHEMES)] + list(MIXED)


@pytest.mark.parametrize("name, batch, rows, formats", [
    pytest.param(*case, marks=() if case in IN_CI else SLOW) for case in CASES])
def test_64_greedy_tokens_equal_the_reference(name, batch, rows, formats):
    """T = 1: `generate`, 64 tokens in one or four host dispatches. T = 4: verification,
    16 steps that each feed 4 of the reference's greedy tokens (a perfect draft) and must
    predict the next 4, race detector on. With `formats`, the params are quantised
    (`mk.model.quant.quantize`) and the reference runs on the same values
    (`mk.model.quant.dequantize`) while the kernel streams the packed tiles and scales.

    In float32: in bf16 the kernel and the reference round at different points (both
    legitimately), ~1e-3 of the logits' scale apart, and a random tiny model meets top-2
    near-ties closer than that within 64 x 4 tokens (seen: a 0.029 margin at logit 42).
    In float32 only summation order differs (~1e-6), so exact tokens are a sharp check;
    bf16 tokens are checked over shorter runs below and by the transformers test."""
    config = dataclasses.replace(mk.preset(name), dtype="float32")
    params = quant.quantize(config, mk.init_params(config), **_formats(name, formats))
    values = quant.dequantize(params)
    prompt = jax.random.randint(jax.random.key(batch + rows), (batch, 5), 0, config.vocab)
    want = reference.generate(config, values, prompt, TOKENS, max_context=128)
    if rows == 1:
        got = megakernel.generate(config, params, prompt, TOKENS, backend="interpret",
                                  max_context=128, steps_per_call=TOKENS // batch)
        np.testing.assert_array_equal(got, want)
        return
    assert_verify_steps(config, params, values, prompt, want, rows, TOKENS)


FP8_FED = {"tiny": dict(dense="fp4", lm_head="fp8"),  # groups TPU7x feeds fp8
           "tiny-moe": dict(experts="fp8", dense="fp4", lm_head="fp8")}


# CPU seconds: tiny ~15, tiny-moe ~50 (`make test-slow`).
@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-moe", marks=SLOW)])
def test_fp8_fed_weights_decode_the_references_tokens(name):
    """The fp8 feed (TPU7x's default for fp8 and fp4, asked for here without a chip): fp4
    attention and dense MLP, fp8 experts and lm_head; the stream's quantised segments are
    fed fp8, and 8 greedy tokens equal the reference's on the feed's oracle weights
    (`mk.model.quant.dequantize(params, feeds=)`; float32, as above). The same at tp 2:
    tests/test_quant_shards.py."""
    config = dataclasses.replace(mk.preset(name), dtype="float32")
    params = quant.quantize(config, mk.init_params(config), **FP8_FED[name])
    feeds = dict.fromkeys(FP8_FED[name], "fp8")
    plan = DecodePlan.make(config, batch=2, context=128, formats=FP8_FED[name], feeds=feeds)
    assert {s.feed for s in plan.stream.segments + plan.stream.tail if s.scheme} == {"fp8"}
    prompt = jax.random.randint(jax.random.key(5), (2, 5), 0, config.vocab)
    want = reference.generate(config, quant.dequantize(params, feeds=dict(plan.feeds)),
                              prompt, 8, max_context=128)
    got = megakernel.generate(config, params, prompt, 8, backend="interpret",
                              max_context=128, steps_per_call=7, feeds=feeds)
    np.testing.assert_array_equal(got, want)


# CPU seconds: ~20 (tiny, fp4 MLP, CI), ~25 (tiny-moe, plain experts, make test-slow)
@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-moe", marks=SLOW)])
def test_weights_in_tiles_of_their_own_decode_the_references_tokens(name):
    """Weights cut into tiles of their own shape (`BlockSizes.tiles`: ring buffers of their
    own on the one slot index, as qwen3-30b-a3b's plan cuts its experts 2048 x 768 beside
    2048 x 512 tiles): tiny's MLP stored FP4, packed in 256 x 128 tiles beside the block's
    256 x 256; tiny-moe's expert slots plain in 256 x 128 tiles (w_down transposed) beside
    the block's 128 x 256. The 4 greedy tokens of a T = 4 verification step equal the
    reference's (float32), race detector on."""
    config = dataclasses.replace(mk.preset(name), dtype="float32")
    formats, names = (({"dense": "fp4"}, ("w_gate", "w_up", "w_down")) if name == "tiny"
                      else ({}, ("we_gate", "we_up", "we_down")))
    params = quant.quantize(config, mk.init_params(config), **formats)
    own = (256, 128)
    block = dataclasses.replace(default_block(config, 128),
                                tiles=tuple((n, own) for n in names))
    plan = DecodePlan.make(config, batch=2, rows=4, context=128, block=block, formats=formats)
    assert (block.tile_rows, block.tile_cols) != own
    assert ("ring_fp4_256x128" if formats else "ring_256x128") in plan.buffers
    assert [plan.stream.segment(n).tile for n in names] == [own] * 3
    values = quant.dequantize(params)
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, config.vocab)
    want = reference.generate(config, values, prompt, 4, max_context=128)
    assert_verify_steps(config, params, values, prompt, want, 4, 4, block=block)


QWEN35_ATTENTION = dict(attn_output_gate=True, partial_rotary_factor=0.25, norm_offset=1.0)


# make test-slow (~30 CPU s). CI checks this path in tests/test_hybrid.py: a hybrid's full
# layer, T = 4 steps against transformers.
@SLOW
def test_qwen35_full_attention_decodes_the_references_tokens():
    """Qwen3.5's full-attention layers: the output gate (a wq_gate segment in the ring, o *
    sigmoid(h @ wq_gate) before wo), RoPE on the first quarter of each head, norms scaling
    by 1 + weight. A verify step of 4 rows (race detector on) predicts the reference's
    greedy tokens (the T = 1 path is the same kernel with T = 1). Control: each detail alone
    changes the reference's tokens, so a kernel that dropped one would fail here."""
    config = dataclasses.replace(mk.preset("tiny"), dtype="float32", **QWEN35_ATTENTION)
    params = mk.init_params(config)
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, config.vocab)
    want = reference.generate(config, params, prompt, 16, max_context=128)
    for field, qwen3 in (("attn_output_gate", False), ("partial_rotary_factor", 1.0),
                         ("norm_offset", 0.0)):
        other = dataclasses.replace(config, **{field: qwen3})
        kept = {n: p for n, p in params.items() if n in param_shapes(other)}
        assert (reference.generate(other, kept, prompt, 16, max_context=128) != want).any(), \
            field
    assert_verify_steps(config, params, params, prompt, want, 4, 4)


def test_the_stage_kernels_refuse_qwen35_attention_by_name():
    from mk.step.one_layer import one_layer
    config = dataclasses.replace(mk.preset("tiny"), **QWEN35_ATTENTION)
    params = mk.init_params(config)
    _, cache = reference.prefill(config, params, jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError,
                       match=r"streams \('wq', 'wk', 'wv', 'wq_gate', 'wo'\), norm_offset=1.0"):
        one_layer(config, params, jnp.zeros((1, 1, config.hidden)), cache.k, cache.v,
                  jnp.array([4], jnp.int32), layer=0)


@pytest.mark.parametrize("name, batch", [("tiny", 1), pytest.param("tiny-moe", 2, marks=SLOW)])
def test_bf16_greedy_tokens_equal_the_reference_and_the_bar_counts_them(name, batch, capsys):
    """8 tokens: the prefill's, then dispatches of 4 and 3 steps; the progress bar ends at
    8 of 8 (its planted miscount is caught in the test below)."""
    config = mk.preset(name)
    params = mk.init_params(config)
    prompt = jax.random.randint(jax.random.key(1), (batch, 5), 0, config.vocab)
    got = megakernel.generate(config, params, prompt, 8, backend="interpret",
                              max_context=128, steps_per_call=4, progress=True)
    np.testing.assert_array_equal(got, reference.generate(config, params, prompt, 8))
    assert bar_count(capsys.readouterr().err) == (8, 8)


def test_the_progress_bar_is_off_by_default_and_a_miscount_shows(capsys):
    """The bar check above against a planted miscount (update by 1 per dispatch, not by
    its n steps); progress=False draws nothing; a non-bool progress is refused."""
    with megakernel.progress_bar(8, True) as bar:
        bar.update(1)
        bar.update(1)
    assert bar_count(capsys.readouterr().err) == (3, 8)
    with megakernel.progress_bar(8, False) as bar:
        bar.update(7)
    assert bar_count(capsys.readouterr().err) is None
    with pytest.raises(ValueError, match="progress='yes' must be True or False"):
        megakernel.progress_bar(8, "yes")


@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-moe", marks=SLOW)])
def test_t_rows_verify_in_one_pass_race_free(name):
    config = mk.preset(name)
    params = mk.init_params(config)
    block = default_block(config, 128)  # KV tiles of 128: the 256-position cache has two
    _, cache = reference.prefill(config, params, jnp.ones((2, 6), jnp.int32) * 7)
    tokens = jax.random.randint(jax.random.key(2), (2, 4), 0, config.vocab)
    positions = jnp.array([6, 6], jnp.int32)
    want_logits, want_cache = reference.decode_step(config, params, cache, tokens, positions)
    with backend.use("interpret", detect_races=True):
        plan = DecodePlan.make(config, batch=2, rows=4, context=cache.capacity, block=block)
        got, logits, got_cache = megakernel.decode_step(
            plan, megakernel.prepare(plan, params), cache, tokens, positions)
    assert not backend.races_found()
    np.testing.assert_array_equal(got, reference.greedy(want_logits))
    # bf16 roundings through every layer and the lm_head: compared at the logits' scale.
    scale = float(jnp.abs(want_logits).max())
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-2 * scale)
    # Layer 0's V rows see identical inputs; deeper layers' inputs carry bf16 roundings.
    np.testing.assert_array_equal(got_cache.v[0], want_cache.v[0])
    np.testing.assert_allclose(got_cache.v.astype(jnp.float32),
                               want_cache.v.astype(jnp.float32), rtol=0, atol=3e-2)


def test_a_reused_write_back_slot_sends_each_layers_rows_to_that_layer_race_free():
    """The KV write-backs stay in flight from 2B staging slots (`drain_write_backs`): with
    B = 1 and 3 full layers, layer 2 reuses layer 0's slot, so layer 0's write-back must be
    waited for on its own semaphore first (a DMA semaphore shared by two write-backs in
    flight let layer 2's rows land in layer 0's cache). float32: the whole cache the
    reference's to rounding."""
    config = dataclasses.replace(mk.preset("tiny-moe"), dtype="float32")
    assert len(config.full_layers) > 2
    params = {n: v.astype(jnp.float32) for n, v in mk.init_params(config).items()}
    _, cache = reference.prefill(config, params, jnp.arange(5, dtype=jnp.int32)[None] + 3,
                                 max_context=64)
    tokens, positions = jnp.array([[9]], jnp.int32), jnp.array([5], jnp.int32)
    _, want = reference.decode_step(config, params, cache, tokens, positions)
    block = default_block(config, 64)
    with backend.use("interpret", detect_races=True):
        plan = DecodePlan.make(config, batch=1, context=64, block=block)
        _, _, got = megakernel.decode_step(plan, megakernel.prepare(plan, params), cache,
                                           tokens, positions)
    assert not backend.races_found()
    for name in ("k", "v"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=0,
                                   atol=1e-5, err_msg=name)


def test_a_donated_step_equals_the_copying_one_and_spends_the_cache():
    """`decode_step(donate=True)` (`step_in_place`, what `mk.measure.measure` times) computes what
    the copying call does, bit for bit, and really takes the caller's cache: its buffers
    are deleted, so no copy of the cache was made for the kernel to write."""
    config = dataclasses.replace(mk.preset("tiny"), dtype="float32")
    plan = DecodePlan.make(config, batch=2, rows=1, context=64)
    weights = megakernel.prepare(plan, mk.init_params(config))
    tokens, positions = jnp.array([[3], [5]], jnp.int32), jnp.array([7, 11], jnp.int32)

    def filled():  # a cache whose old positions hold values, not zeros
        return jax.tree.map(lambda a: a + jnp.asarray(0.25, a.dtype),
                            reference.init_cache(config, 2, 64))

    with backend.use("interpret"):
        copied = megakernel.decode_step(plan, weights, filled(), tokens, positions)
        spent = filled()
        donated = megakernel.decode_step(plan, weights, spent, tokens, positions,
                                         donate=True)
    assert all(a.is_deleted() for a in jax.tree.leaves(spent))
    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(donated), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_ring_of_one_slot_is_refused_before_tracing():
    config = mk.preset("tiny")
    with pytest.raises(ValueError, match=r"BlockSizes.slots=1: the megakernel's ring needs"):
        megakernel.generate(config, {}, jnp.zeros((1, 4), int), 2,
                            block=BlockSizes(slots=1, tile_rows=128, tile_cols=128))


def test_a_position_past_the_cache_is_named():
    config = mk.preset("tiny")
    cache = reference.init_cache(config, 1, 128)
    with pytest.raises(ValueError, match=r"positions\[0\]=127 with T=2 .*max_context=128"):
        megakernel.decode_step(DecodePlan.make(config, rows=2, context=128,
                                               block=default_block(config, 128)),
                               {}, cache, jnp.zeros((1, 2), int), jnp.array([127]))


def test_a_step_is_refused_unless_its_inputs_are_its_plans():
    """The plan is the step's one description: a cache of another capacity, tokens of
    another [B, T], weights packed otherwise or a tensor-parallel plan are named before
    anything is traced."""
    config = mk.preset("tiny")
    plan = DecodePlan.make(config, context=128)
    tokens, positions = jnp.zeros((1, 1), int), jnp.array([5])
    with pytest.raises(ValueError, match="plan is a ModelConfig; it must be a DecodePlan"):
        megakernel.decode_step(config, {}, reference.init_cache(config, 1, 128), tokens,
                               positions)
    with pytest.raises(ValueError, match="capacity 256 is not the plan's context=128"):
        megakernel.decode_step(plan, {}, reference.init_cache(config, 1, 256), tokens,
                               positions)
    with pytest.raises(ValueError, match=r"tokens shape \(1, 2\) is not the plan's \[B=1, "
                                         r"T=1\]"):
        megakernel.decode_step(plan, {}, reference.init_cache(config, 1, 128),
                               jnp.zeros((1, 2), int), positions)
    int8 = DecodePlan.make(config, context=128, formats={"dense": "int8"})
    with pytest.raises(ValueError, match=r"weights streamed packed in \{\}, the plan's in "
                                         r"\{'dense': 'int8'\}"):
        megakernel.decode_step(int8, {}, reference.init_cache(config, 1, 128), tokens,
                               positions)
    with pytest.raises(NotImplementedError, match="plan.tp=2"):
        megakernel.decode_step(DecodePlan.make(config, tp=2, context=128), {},
                               reference.init_cache(config, 1, 128), tokens, positions)


# v5e's whole-model compiles in CI are the quantised ones below and gpt-oss-20b's
# (tests/test_gpt_oss.py); qwen3-1.7b's under make test-slow.
@pytest.mark.parametrize("name, chip", [pytest.param("qwen3-1.7b", "v5e", marks=SLOW),
                                        ("qwen3-8b", "v6e"),
                                        ("qwen3-8b", "tpu7x"), ("qwen3-30b-a3b", "tpu7x")])
def test_whole_model_compiles_for_tpu(name, chip):
    report = tpu.compile_megakernel(DecodePlan.make(mk.preset(name), chip=chip, batch=8,
                                                    rows=1, context=4096))
    assert report.ok, report.error
    assert report.vmem.total_bytes < report.vmem.limit_bytes


# Issue 16's compiles: quantised weights make these fit one chip (bf16 qwen3-8b at B=8,
# S=4096 needs 19.8 GiB of v5e's 16). The cache is donated (`mk.measure.tpu.CACHE_ARGS`): without
# it the compiler holds it twice and the int8 8B at B=8 needs 17.3 GiB (measured).
@pytest.mark.parametrize("name, chip, batch, formats", [
    ("qwen3-8b", "v5e", 8, dict(dense="int8", lm_head="int8")),
    ("qwen3-30b-a3b", "v6e", 1, dict(experts="int4")),
    ("qwen3-30b-a3b", "v5e", 1, dict(dense="int4", experts="int4", lm_head="int4")),
    pytest.param("qwen3-8b", "tpu7x", 1, dict(dense="fp8", lm_head="fp8"), marks=SLOW)])
def test_quantised_models_compile_for_the_chip_they_fit(name, chip, batch, formats):
    report = tpu.compile_megakernel(DecodePlan.make(mk.preset(name), chip=chip, batch=batch,
                                                    context=4096, formats=formats))
    assert report.ok, report.error
    rings = {b.name for b in report.vmem.buffers if b.name.startswith("ring_")}
    for q in set(formats.values()):  # each scheme's ring: the block's tile or its own shape
        assert any(n == f"ring_{q}" or n.startswith(f"ring_{q}_") for n in rings), (q, rings)
    # the weights in HBM are the packed bytes and scales (mk.model.quant.tile_major), KV cache
    # once: what the compiler reports for the arguments, within its own rounding
    assert report.argument_bytes == pytest.approx(report.hbm_bytes, rel=0.01)


def test_a_tiny_model_fed_fp8_compiles_for_tpu7x():
    """tiny with fp4 attention and dense MLP and an fp8 lm_head: on TPU7x the plan feeds
    them fp8 (its default there) and the whole megakernel compiles (~2 s; tiny-moe's
    60-slot ring takes ~15 s, fed bf16 or fp8)."""
    config, formats = mk.preset("tiny"), FP8_FED["tiny"]
    plan = DecodePlan.make(config, batch=8, context=1024, formats=formats, chip="tpu7x")
    assert dict(plan.feeds) == dict.fromkeys(formats, "fp8")
    report = tpu.compile_megakernel(plan)
    assert report.ok, report.error


def test_int4_experts_alone_do_not_fit_v5e_and_the_numbers_say_so():
    report = tpu.compile_megakernel(DecodePlan.make(
        mk.preset("qwen3-30b-a3b"), chip="v5e", batch=1, context=4096,
        formats=dict(experts="int4")))
    assert not report.ok
    assert "17.17 GiB of HBM, over the 15.75 GiB the compiler gives one v5e core" in report.error


def test_a_model_too_big_for_the_chip_is_reported_with_numbers():
    report = tpu.compile_megakernel(DecodePlan.make(mk.preset("qwen3-30b-a3b"), chip="v5e",
                                                    batch=8, context=4096))
    assert not report.ok
    assert "GiB of HBM, over the 15.75 GiB the compiler gives one v5e core" in report.error


def test_greedy_tokens_of_a_transformers_checkpoint_equal_transformers(tmp_path):
    """A TPU-legal tiny Qwen3-MoE made by transformers, loaded by mk, decoded by the
    megakernel: the tokens are transformers' own greedy tokens."""
    import torch
    from builders import build_hf_model

    model = build_hf_model("qwen3_moe", dict(
        vocab_size=384, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, intermediate_size=256, moe_intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
        max_position_embeddings=256, rope_theta=10_000.0, attn_implementation="eager",
        eos_token_id=None, bos_token_id=None, pad_token_id=None))
    model.save_pretrained(tmp_path)
    config, params = mk.load_checkpoint(tmp_path)
    prompt = np.random.default_rng(3).integers(0, 384, (2, 6))
    with torch.no_grad():
        hf = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones(prompt.shape, dtype=torch.long))
    got = megakernel.generate(config, params, prompt, 8, backend="interpret",
                              max_context=128, steps_per_call=8)
    np.testing.assert_array_equal(got, hf[:, prompt.shape[1]:].numpy())


@pytest.mark.parametrize("plant, where", [
    # wo as `prepare` lays it out: [L, tiles, tile_rows, tile_cols]
    (lambda w: w | {"wo": w["wo"].at[1, 1, 3, 5].add(0.5)}, (1, "attn")),
    (lambda w: w | {"norms": w["norms"].at[0, 1].mul(1.5)}, (0, "mlp"))])
def test_first_divergence_names_the_op_of_a_planted_bug(plant, where):
    config = mk.preset("tiny")
    params = mk.init_params(config)
    _, cache = reference.prefill(config, params, jnp.ones((1, 6), jnp.int32), max_context=128)
    plan = DecodePlan.make(config, batch=1, rows=2, context=128)
    args = (plan, params, cache, jnp.array([[3, 4]]), jnp.array([6]))
    first, report = megakernel.first_divergence(*args, backend="interpret")
    assert first is None and len(report) == 2 * config.layers
    weights = plant(megakernel.prepare(plan, params))
    first, report = megakernel.first_divergence(*args, backend="interpret", weights=weights,
                                                stop_after=where)
    assert first == where and (report[-1]["layer"], report[-1]["op"]) == where


def test_stop_after_outside_the_model_is_named():
    config = mk.preset("tiny")
    with pytest.raises(ValueError, match=r"stop_after=\(2, 'attn'\) must be .*layers=2"):
        megakernel.first_divergence(DecodePlan.make(config, context=128), {}, None, None,
                                    None, stop_after=(2, "attn"))


def test_a_ring_reaching_the_next_moe_layer_issues_each_expert_tile_once():
    """A ring as deep as a chip's plan makes it (18 slots: tiny-moe's layer period, where
    `default_block` caps Little's law) reaches layer 2's expert tiles while layer 1's
    experts run. Before the slots' switch knew the layer they were routed for
    (`count_smem[ROUTED_LAYER]`), those tiles were issued with layer 1's ids and again
    after layer 2's routing: DMAs never waited for (strict_dma), on a chip a semaphore
    signalled twice. Now each is issued once, and the step is the reference's."""
    config = dataclasses.replace(mk.preset("tiny-moe"), dtype="float32")
    params = mk.init_params(config)
    block = dataclasses.replace(default_block(config, 128), slots=18)
    plan = DecodePlan.make(config, batch=1, rows=1, context=128, block=block)
    assert plan.block.slots == plan.stream.period == 18
    _, cache = reference.prefill(config, params, jnp.arange(1, 6)[None], max_context=128)
    tokens, positions = jnp.array([[7]]), jnp.array([5])
    with backend.use("interpret", strict_dma=True):
        got, logits, _ = megakernel.decode_step(plan, megakernel.prepare(plan, params),
                                                cache, tokens, positions)
    want, _ = reference.decode_step(config, params, cache, tokens, positions)
    np.testing.assert_array_equal(got, reference.greedy(want))
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-3 * float(jnp.abs(want).max()))


# -- What XLA puts around the kernel, compiled for a v5e ---------------------------------------
def _cache_copies(fn, config, B: int = 1, S: int = 256, steps: int | None = None) -> list[str]:
    """The whole-cache copies in `fn`'s optimised HLO for one v5e core: instructions that
    copy (copy, copy-start, a slice) an array of the KV cache's shape."""
    plan = DecodePlan.make(config, batch=B, context=S, chip="v5e")
    core = jax.sharding.Mesh(np.array(tpu.devices(mk.chip("v5e").topology)[:1]), ("core",))
    on = jax.sharding.NamedSharding(core, jax.sharding.PartitionSpec())

    def placed(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), tree)

    weights = placed(jax.eval_shape(lambda p: megakernel.prepare(plan, p),
                                    abstract_params(config)))
    cache = placed(jax.eval_shape(lambda: reference.init_cache(config, B, S)))
    shape = ",".join(map(str, cache.k.shape))
    token = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=on)
    args = (token, token, steps) if steps else (
        jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=on), token)
    with jax.sharding.use_abstract_mesh(core.abstract_mesh):
        text = fn.lower(plan, weights, cache, *args).compile().as_text()
    return [line.strip()[:120] for line in text.splitlines()
            if re.search(rf"\[{shape}\].* (copy|copy-start|slice|async-start)\(", line)]


def test_a_donated_step_and_the_device_loop_update_the_cache_in_place_on_a_v5e():
    """A v5e trace of qwen3-0.6b's undonated step (data/measured/v5e-trace.json) spent
    345 µs of its 1.95 ms copying the KV cache around the kernel; donated (what
    `decode_step(donate=True)` and `generate`'s device loop run) the compiler copies none.
    The undonated step is the control: the check finds its copies."""
    config = mk.preset("tiny")
    assert _cache_copies(megakernel.traced_step, config)  # the control
    assert _cache_copies(megakernel.step_in_place, config) == []
    assert _cache_copies(megakernel.device_loop, config, steps=4) == []


def test_a_device_loop_of_verification_steps_is_its_steps_one_by_one():
    """`device_loop` with T = 2 rows (what `mk.measure.measure` times as a T-row step):
    each step is fed the last one's T predictions at T positions on, token for token what
    the same steps dispatched one at a time give, and the cache they leave is the same."""
    config = mk.preset("tiny")
    plan = DecodePlan.make(config, batch=2, rows=2, context=64)
    params = mk.init_params(config, 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab, (2, 2)), jnp.int32)
    positions = jnp.asarray([5, 17], jnp.int32)
    with backend.use("interpret"):
        weights = megakernel.prepare(plan, params)
        cache = reference.init_cache(config, 2, 64)
        looped, loop_cache = megakernel.device_loop(plan, weights, cache, tokens, positions, 3)
        cache, fed, at, one_by_one = reference.init_cache(config, 2, 64), tokens, positions, []
        for _ in range(3):
            fed, _, cache = megakernel.traced_step(plan, weights, cache, fed, at)[:3]
            one_by_one.append(fed)
            at = at + 2
    assert looped.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(looped), np.concatenate(one_by_one, axis=1))
    np.testing.assert_array_equal(np.asarray(loop_cache.k), np.asarray(cache.k))


def test_generate_loops_on_the_device_by_default_on_a_tpu_only(monkeypatch):
    """Issue 60: a dispatched step cost 0.45 ms more than a device loop's on the v5e, so
    on a TPU `generate` runs DEVICE_LOOP_STEPS per dispatch unless told otherwise; in
    interpret mode one (a loop of another length compiles another program there)."""
    config = mk.preset("tiny")

    def per_call(**kw):
        return megakernel.check_generate(config, [[1, 2]], 9, None, 64, **kw)[3]

    assert per_call(hardware=True) == megakernel.DEVICE_LOOP_STEPS > 1
    assert per_call(hardware=False) == per_call() == 1  # a CPU, no interpret block
    monkeypatch.setattr(backend, "on_tpu", lambda: True)
    assert per_call() == megakernel.DEVICE_LOOP_STEPS
    with backend.use("interpret"):
        assert per_call() == 1
    assert megakernel.check_generate(config, [[1, 2]], 9, 3, 64, hardware=True)[3] == 3
