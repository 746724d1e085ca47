"""mk.cost.perf: the bytes and FLOPs of one decode step, checked by hand on the tiny presets, and
the properties the floors and the roofline must have (the published rows: tests/
test_published.py; set against the floors: tests/test_ledger.py)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mk
from mk.cost import perf
from mk.model import quant
from mk.model.chips import all_chips, chip
from mk.kernels.collectives import ICI_LATENCY_S
from mk.step.one_layer import model_block
from mk.step.plan import shard_config
from mk.kinds.layers import layer_kinds
from mk.model.presets import PRESET_NAMES
from mk.model.quant import stored_bytes
from mk.model.weights import abstract_params

REAL_PRESETS = [n for n in PRESET_NAMES if not n.startswith("tiny")]
DENSE_PRESETS = [n for n in REAL_PRESETS if not mk.preset(n).is_moe]


# -- Distinct experts ---------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 2, 7, 1000])
def test_every_expert_is_touched_when_each_token_picks_all_of_them(tokens):
    assert perf.experts_touched(8, 8, tokens) == 8


@pytest.mark.parametrize("experts,per_token", [(8, 2), (896, 16), (128, 8), (5, 1)])
def test_one_token_touches_exactly_its_x_experts(experts, per_token):
    assert perf.experts_touched(experts, per_token, 1) == pytest.approx(per_token, rel=1e-12)


def test_two_tokens_picking_two_of_four_touch_three_on_average():
    # Each expert is missed by one token with probability 1/2, by both with 1/4.
    assert perf.experts_touched(4, 2, 2) == pytest.approx(3.0)


@settings(max_examples=200, deadline=None)
@given(experts=st.integers(1, 1024), data=st.data(), tokens=st.integers(1, 4096))
def test_uniform_routing_lies_between_shared_and_disjoint_and_grows_with_tokens(
        experts, data, tokens):
    x = data.draw(st.integers(1, experts))
    uniform = perf.experts_touched(experts, x, tokens)
    assert perf.experts_touched(experts, x, tokens, "shared") <= uniform * (1 + 1e-12)
    assert uniform <= perf.experts_touched(experts, x, tokens, "disjoint") * (1 + 1e-12)
    assert perf.experts_touched(experts, x, tokens + 1) >= uniform * (1 - 1e-12)


def test_experts_touched_rejects_more_picks_than_experts_and_unknown_routing():
    with pytest.raises(ValueError, match="per_token=9 exceeds experts=8"):
        perf.experts_touched(8, 9, 1)
    with pytest.raises(ValueError, match="routing='top1'"):
        perf.experts_touched(8, 2, 1, "top1")


# -- One step, by hand ----------------------------------------------------------------------
def test_tiny_step_bytes_and_flops_match_a_hand_count():
    # tiny: V=512 D=256 L=2 N=4 K=2 H=128 F=512, bf16 (2 bytes), untied, qk_norm, dense.
    e = perf.predict(mk.preset("tiny"), "v5e", batch=2, rows=3, context=10)
    attention_params = 256 * (2 * 4 * 128 + 2 * 2 * 128)  # q, k, v, o projections
    assert e.attention_bytes == 2 * attention_params * 2
    # attn and mlp norms, q and k norms per layer, the final norm: float32 as streamed
    assert e.norm_bytes == (2 * (2 * 256 + 2 * 128) + 256) * 4
    assert e.dense_mlp_bytes == 2 * 3 * 256 * 512 * 2
    assert e.router_bytes == 0 and e.expert_bytes == 0
    assert e.embed_bytes == 6 * 256 * 2  # B*T = 6 gathered rows
    assert e.lm_head_bytes == 512 * 256 * 2
    kv_per_token = 2 * 2 * 2 * 128 * 2  # K and V, 2 layers, 2 kv heads x 128, 2 bytes
    # As the kernel moves them: its cache holds the 13 positions in one KV tile of 16
    # (`capacity`), which each sequence reads whole; the tile holding rows 10..12 sends
    # back its aligned window of 16 rows (`write_back_rows`: 3 rows in 16-row sublanes).
    assert e.kv_read_bytes == 2 * 16 * kv_per_token
    assert e.kv_write_bytes == 2 * 16 * kv_per_token
    per_token = 2 * 256 * (4 * 128 * 2 + 2 * 128 * 2) + 2 * 3 * 256 * 512 + 256 * 512
    assert e.matmul_flops == 2 * per_token * 6
    # Row t attends to 10 cached + t+1 new positions: 3*10 + (1+2+3) = 36 per sequence.
    assert e.attention_flops == 4 * 2 * 4 * 128 * 2 * 36


def test_tiny_moe_reads_only_the_experts_its_tokens_touch():
    # tiny-moe: 2 MoE layers of E=8, X=2, Fe=128, D=256, bf16.
    one = perf.predict(mk.preset("tiny-moe"), "v5e", batch=1, rows=1, context=0)
    assert one.experts_touched == pytest.approx(2)
    assert one.expert_bytes == pytest.approx(2 * 2 * 3 * 256 * 128 * 2)
    two = perf.predict(mk.preset("tiny-moe"), "v5e", batch=2, rows=1, context=0)
    assert two.experts_touched == pytest.approx(8 * (1 - (6 / 8) ** 2))  # 3.5
    assert two.router_bytes == 2 * 256 * 8 * 2


def test_fp4_experts_count_four_bits_per_weight_and_a_scale_byte_per_32():
    config = mk.preset("kimi-k3-like")  # formats={"experts": "fp4"}, mk.model.quant's MXFP4
    assert config.expert_bits == 4
    # charged (and packed by the kernel) at any tp: an expert's matrices as a device's
    # slot streams them (at TP32 gate|up joined in 128 lanes, down's 64 rows padded to 128)
    for tp, slot in ((1, 3 * 7168 * 2048), (32, 2 * 7168 * 128)):
        e = perf.predict(config, "tpu7x", context=0, routing="shared", tp=tp)
        assert e.expert_bytes == 92 * 16 * tp * slot * (1 / 2 + 1 / 32)
        assert e.formats == (("experts", "fp4"),)
    bf16 = perf.predict(config, "tpu7x", context=0, routing="shared", formats={})
    assert bf16.expert_bytes == 92 * 16 * 3 * 7168 * 2048 * 2 and bf16.formats == ()


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "qwen3-0.6b", "qwen3-30b-a3b"])
def test_touching_every_expert_reads_every_stored_weight_once(name):
    # With all experts touched, the weight families add up to mk.model.weights.stored_bytes, less
    # the embedding table (only B*T rows are gathered) when lm_head is a separate tensor, with
    # the norms in float32 (config counts them in bf16) and the lm_head's columns padded
    # to whole tiles.
    config = mk.preset(name)
    e = perf.predict(config, "v6e", batch=64, context=0, routing="disjoint")
    table = 0 if config.tie_embeddings else config.vocab * config.hidden * 2
    padding = e.lm_head_bytes - config.vocab * config.hidden * 2
    assert 0 <= padding < model_block(config).tile_cols * config.hidden * 2
    norms = e.norm_bytes / 2  # the same vectors in bf16
    assert e.weight_bytes - e.embed_bytes - norms - padding + table == stored_bytes(config)


def test_floors_are_bytes_over_device_bandwidth_and_flops_over_device_peak():
    spec = chip("tpu7x")  # 2 devices per chip, each with half the chip's numbers
    e = perf.predict(mk.preset("qwen3-8b"), spec, batch=4, rows=2, context=100, tp=8)
    assert e.hbm_floor_ms == pytest.approx(1e3 * e.total_bytes / 8 / (spec.hbm_bw / 2))
    assert e.compute_floor_ms == pytest.approx(1e3 * e.flops / 8 / (spec.bf16_flops / 2))
    fp8 = perf.predict(mk.preset("qwen3-8b"), spec, batch=4, rows=2, context=100, tp=8,
                       compute="fp8")
    assert fp8.compute_floor_ms == pytest.approx(e.compute_floor_ms / 2)
    assert e.step_ms == max(e.hbm_floor_ms, e.compute_floor_ms + e.collective_ms)


def test_tokens_per_s_count_accepted_tokens_per_user_and_batch_in_aggregate():
    e = perf.predict(mk.preset("qwen3-4b"), "h200", batch=4, rows=6, accepted=3.5,
                     context=0)
    assert e.tokens_per_s_per_user == pytest.approx(3.5 / (e.step_ms / 1e3))
    assert e.tokens_per_s == pytest.approx(4 * e.tokens_per_s_per_user)
    assert perf.predict(mk.preset("qwen3-4b"), "h200", rows=6, context=0).accepted == 6


@pytest.mark.parametrize("name", DENSE_PRESETS)
def test_bf16_dense_weights_have_intensity_about_m_flop_per_byte(name):
    # Not for MoE presets: there the experts touched grow with M too. The weights alone
    # have that intensity; the whole step less: each sequence's KV tile (16 positions at
    # context 0, read and written back whole) and a hybrid's linear states (float32,
    # fixed per sequence) add bytes per sequence.
    config = mk.preset(name)
    for m in (1, 8, 64):
        e = perf.predict(config, "v6e", batch=m, context=0)
        assert e.matmul_flops / e.weight_bytes == pytest.approx(m, rel=0.05)
        assert e.intensity_flop_per_byte < e.matmul_flops / e.weight_bytes


@pytest.mark.parametrize("spec", all_chips("tpu"), ids=lambda c: c.name)
def test_at_batch_one_flops_leave_every_preset_hbm_bound_the_mxu_rule_all_but_kimi(spec):
    # By FLOPs alone every preset is HBM-bound at B=1. The MXU rule charges each weight pass
    # at least mxu_rows rows; kimi-k3-like's fp4 experts stream 4x fewer bytes per weight
    # than bf16, so its MXU floor passes its HBM floor on every TPU.
    for name in PRESET_NAMES:
        e = perf.predict(mk.preset(name), spec, context=0)
        assert e.bound == "hbm" and e.hbm_floor_ms > e.compute_floor_ms
        mxu = perf.mxu_floor_ms(mk.preset(name), spec, context=0)
        assert (mxu > e.hbm_floor_ms) == (name == "kimi-k3-like"), (name, mxu, e.hbm_floor_ms)


def test_mxu_floor_of_tiny_on_v6e_by_hand():
    c, v6e = mk.preset("tiny"), chip("v6e")
    passes = (c.layers * c.hidden * (2 * c.q_width + 2 * c.kv_width)
              + 3 * c.layers * c.hidden * c.ffn + c.hidden * c.vocab)
    attention = 4 * c.layers * c.kv_heads * c.head_dim * (10 + 1) * 256  # G*T rows -> R
    want = 1e3 * (2 * 256 * passes + attention) / v6e.bf16_flops
    assert perf.mxu_floor_ms(c, v6e, context=10) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-kimi"])
def test_a_linear_layer_multiplies_by_its_own_weights_by_hand(name):
    # The gated DeltaNet: qkv, z, b, a, out. KDA (Kimi Linear): qkv, b, the low-rank
    # forget gate (f_a, f_b) and output gate (g_a, g_b), out: no z, no a.
    c = mk.preset(name)
    D, C, Vw, Nv = c.hidden, c.conv_channels, c.linear_value_width, c.linear_value_heads
    Hk, Hv = c.linear_key_dim, c.linear_value_dim
    deltanet = D * (C + Vw + 2 * Nv) + Vw * D
    kda = D * C + D * Nv + D * Hk + Hk * Nv * Hk + D * Hv + Hv * Vw + Vw * D
    want = kda if c.channel_decay else deltanet
    assert kda != deltanet  # (the gated DeltaNet's count was once charged for KDA too)
    kinds = layer_kinds(c)
    (linear,) = [k for k in kinds if k.name in ("deltanet", "kda")]
    assert linear.params() == want
    others = sum(len(k.layers) * k.params() for k in kinds if k is not linear)
    e = perf.predict(c, "v6e", context=0)
    assert e.matmul_flops == 2 * (len(c.linear_layers) * want + others + D * c.vocab)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b"])
def test_mxu_floor_is_flat_below_the_mxu_rows_and_meets_the_flop_floor_far_above(name):
    config, v6e = mk.preset(name), chip("v6e")
    if not config.is_moe:  # (more rows touch more experts)
        small = [perf.mxu_floor_ms(config, v6e, rows=t, context=0) for t in (1, 4)]
        assert small[0] == pytest.approx(small[1], rel=0.01)  # 1 row costs what 4 cost
    flop = perf.predict(config, v6e, batch=4096, context=0).compute_floor_ms
    mxu = perf.mxu_floor_ms(config, v6e, batch=4096, context=0)
    assert flop <= mxu <= 1.05 * flop
    gpu = perf.predict(config, "h200", context=0).compute_floor_ms
    assert perf.mxu_floor_ms(config, "h200", context=0) == gpu  # no MXU rule on a GPU


# -- Properties of the floors -------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(PRESET_NAMES), batch=st.integers(1, 32), rows=st.integers(1, 8),
       context=st.integers(0, 2048), spec=st.sampled_from(all_chips()))
def test_more_batch_or_context_never_shortens_the_step_or_raises_per_user_speed(
        name, batch, rows, context, spec):
    config = mk.preset(name)
    e = perf.predict(config, spec, batch=batch, rows=rows, context=context)
    more_b = perf.predict(config, spec, batch=batch + 1, rows=rows, context=context)
    more_s = perf.predict(config, spec, batch=batch, rows=rows, context=context + 1)
    assert more_b.step_ms >= e.step_ms
    # One position more reads no fewer KV bytes (no sliding windows here) but can write
    # fewer back, as the kernel does: T rows straddling a tile edge send two windows, one
    # position on only one. Only then may the step shorten.
    assert more_s.kv_read_bytes >= e.kv_read_bytes
    assert more_s.step_ms >= e.step_ms or more_s.kv_write_bytes < e.kv_write_bytes
    assert more_b.tokens_per_s_per_user <= e.tokens_per_s_per_user


def splits(config, tp: int) -> bool:
    """Whether tp devices can share `config`'s heads, width and linear key heads."""
    return not (config.heads % tp or config.hidden % tp
                or config.linear_layers and config.linear_key_heads % tp)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_hbm_floor_falls_as_one_over_tp_up_to_what_every_device_repeats(name):
    # What every device moves whole (norms, router unless the plan splits it by experts,
    # replicated kv heads) or pads (split widths short of a tile) keeps the floor above
    # one over tp; never below. (The
    # lm_head's vocab columns are padded to whole tiles of each shard's own tiling: a
    # wider tile at tp=1 can pad more than the shards together.)
    config = mk.preset(name)
    one = perf.predict(config, "tpu7x", tp=1, context=0)
    for tp in (2, 4, 8, 16, 32):
        if not splits(config, tp):
            continue
        many = perf.predict(config, "tpu7x", tp=tp, context=0)
        split = shard_config(config, tp).router_columns  # a split router is not repeated
        repeated = (tp - 1) * (one.norm_bytes + (0 if split else one.router_bytes))
        assert many.total_bytes - many.lm_head_bytes >= (
            one.total_bytes - one.lm_head_bytes + repeated - 1e-6 * one.total_bytes)
        assert many.lm_head_bytes >= config.vocab * config.hidden * 2
        padded = (one.lm_head_bytes - config.vocab * config.hidden * 2) / one.total_bytes
        assert many.hbm_floor_ms >= one.hbm_floor_ms / tp * (1 - padded)
    dense = perf.predict(mk.preset("qwen3-8b"), "tpu7x", tp=8, context=0)
    base = perf.predict(mk.preset("qwen3-8b"), "tpu7x", tp=1, context=0)
    # qwen3-8b at TP8: 8 kv heads split, no width padded; each device's 151936 / 8 =
    # 18992 vocab columns padded to whole 128-lane tiles (its tiles are 128 wide).
    assert dense.lm_head_bytes == 8 * 4096 * (-(-18992 // 128) * 128) * 2
    unsplit = 7 * base.norm_bytes + dense.lm_head_bytes - base.lm_head_bytes
    assert dense.total_bytes == pytest.approx(base.total_bytes + unsplit, rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch=0), "batch=0"), (dict(rows=True), "rows=True"), (dict(tp=0), "tp=0"),
    (dict(context=-1), "context=-1"), (dict(context=4096), "context\\+rows=4097"),
    (dict(rows=2, accepted=3), "accepted=3"), (dict(accepted=0), "accepted=0"),
    (dict(routing="hash"), "routing='hash'"), (dict(compute="fp4"), "compute='fp4'"),
])
def test_predict_rejects_bad_inputs_naming_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        perf.predict(mk.preset("tiny"), "v6e", **kwargs)


def test_predict_rejects_an_unknown_chip_name():
    with pytest.raises(ValueError, match="chip='tpu8'"):
        perf.predict(mk.preset("tiny"), "tpu8")


# -- Roofline -------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(spec=st.sampled_from(all_chips()), a=st.floats(0, 1e5), b=st.floats(0, 1e5),
       compute=st.sampled_from(perf.COMPUTES))
def test_roofline_is_nondecreasing_and_capped_at_peak(spec, a, b, compute):
    lo, hi = sorted((a, b))
    y_lo, y_hi = (perf.attainable_flops(spec, x, compute) for x in (lo, hi))
    assert y_lo <= y_hi <= perf.peak_flops(spec, compute)
    assert y_lo == min(lo * spec.hbm_bw, perf.peak_flops(spec, compute))


def test_roofline_curve_contains_the_ridge_point_and_ends_at_peak():
    spec = chip("tpu7x")
    x, y = perf.roofline_curve(spec)
    assert np.all(np.diff(x) > 0) and np.all(np.diff(y) >= 0)
    ridge = spec.ridge_flop_per_byte
    assert np.any(np.isclose(x, ridge)) and y[-1] == spec.bf16_flops
    assert y[np.isclose(x, ridge)][0] == pytest.approx(spec.bf16_flops)


def test_negative_intensity_is_rejected():
    with pytest.raises(ValueError, match="intensity"):
        perf.attainable_flops(chip("v5e"), -1.0)


# -- Capacity -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REAL_PRESETS)
@pytest.mark.parametrize("spec", all_chips(), ids=lambda c: c.name)
def test_min_chips_is_the_smallest_power_of_two_that_holds_the_model(name, spec):
    config = mk.preset(name)
    need = perf.resident_bytes(config, batch=2, context=1024)
    n = perf.min_chips(config, spec, batch=2, context=1024)
    assert n & (n - 1) == 0 and n * spec.hbm_bytes >= need
    assert n == 1 or (n // 2) * spec.hbm_bytes < need


def test_kimi_k3_like_needs_sixteen_tpu7x_chips():
    # ~1.85 TB of weights (FP4 experts) over 192 GiB chips: 9.0 chips, so 16.
    assert perf.min_chips(mk.preset("kimi-k3-like"), "tpu7x", context=0) == 16


# -- Weight dtypes per family ---------------------------------------------------------------
@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_dense_formats_scale_every_dense_family_and_leave_embedding_and_kv_alone(scheme):
    config = mk.preset("tiny")
    bf16 = perf.predict(config, "v6e", batch=2, context=10)
    formats = {"dense": scheme, "lm_head": scheme}
    e = perf.predict(config, "v6e", batch=2, context=10, formats=formats)
    block = model_block(config, formats=formats)  # quantised weights are never transposed
    k, n = block.tile_rows, block.tile_cols
    per = quant.tile_bytes(scheme, k, n) / (k * n)  # packed data and scales
    for field in ("attention_bytes", "dense_mlp_bytes", "lm_head_bytes"):
        assert getattr(e, field) == pytest.approx(getattr(bf16, field) * per / 2), field
    assert e.embed_bytes == bf16.embed_bytes and e.norm_bytes == bf16.norm_bytes
    assert e.kv_bytes == bf16.kv_bytes and e.flops == bf16.flops


def test_expert_formats_change_only_the_expert_bytes():
    config = mk.preset("tiny-moe")
    bf16 = perf.predict(config, "v6e", context=0, routing="shared")
    fp4 = perf.predict(config, "v6e", context=0, routing="shared",
                       formats={"experts": "fp4"})
    assert fp4.expert_bytes == bf16.expert_bytes * 17 / 64 == 2 * 2 * 3 * 256 * 128 * 17 / 32
    assert fp4.weight_bytes - fp4.expert_bytes == bf16.weight_bytes - bf16.expert_bytes
    assert (fp4.formats, bf16.formats) == ((("experts", "fp4"),), ())


@pytest.mark.parametrize("formats,match", [
    ({"attention": "int8"}, "formats group='attention'"),
    ({"experts": "fp2"}, "formats experts='fp2'")])
def test_formats_reject_unknown_groups_and_schemes(formats, match):
    with pytest.raises(ValueError, match=match):
        perf.predict(mk.preset("tiny-moe"), "v6e", formats=formats)


# -- Collectives ----------------------------------------------------------------------------
def test_one_allreduce_is_a_reduce_scatter_and_an_all_gather_of_their_rounds_each():
    spec = chip("tpu7x")
    # The release's measured links (three at 134 GB/s a core, one way) and round (4.1 us)
    one_way, r = spec.link_bw, spec.collective_round_s
    assert (one_way, r) == (134e9, 4.1e-6)
    wire = 2 * 7 / 8 * 1e6 / one_way  # the same bytes by either algorithm
    assert perf.allreduce_s(1e6, 1, spec) == 0
    assert perf.allreduce_s(1e6, 8, spec, "recursive") == pytest.approx(6 * r + wire)
    assert perf.allreduce_s(1e6, 8, spec, "two_phase") == pytest.approx(2 * r + wire)
    assert perf.allreduce_s(1e6, 8, spec) == perf.allreduce_s(1e6, 8, spec, "two_phase")
    assert perf.allreduce_s(0, 32, spec, "recursive") == pytest.approx(10 * r)
    assert perf.allreduce_s(0, 5, spec, "recursive") == pytest.approx(6 * r)  # ceil(log2 5)
    assert perf.allreduce_s(0, 32, spec, latency_s=1e-6) == pytest.approx(2e-6)
    # A chip with nothing measured: the datasheet's one-way ICI and ASTRA-sim's round
    v6e = chip("v6e")
    assert v6e.link_bw is v6e.collective_round_s is None
    assert perf.allreduce_s(1e6, 8, v6e, "two_phase") == pytest.approx(
        2 * ICI_LATENCY_S + 2 * 7 / 8 * 1e6 / (v6e.ici_bw / 2))
    assert perf.allreduce_s(0, 2, spec) == perf.allreduce_s(0, 2, spec, "recursive")
    with pytest.raises(ValueError, match=r"latency_s=-1e-06 must be >= 0"):
        perf.allreduce_s(0, 2, spec, latency_s=-1e-6)


def test_collective_term_counts_two_allreduces_per_layer_and_one_for_the_lm_head():
    config, spec = mk.preset("qwen3-8b"), chip("tpu7x")
    e = perf.predict(config, spec, batch=2, rows=4, context=0, tp=16)
    message = 8 * config.hidden * 4  # M=8 rows of float32 partial sums
    assert e.collective_ms == pytest.approx(1e3 * (2 * 36 + 1) * perf.allreduce_s(
        message, 16, spec))
    # HBM streams through the all-reduces: they add to the compute lane's path only
    assert e.step_ms == pytest.approx(max(e.hbm_floor_ms,
                                          e.compute_floor_ms + e.collective_ms))
    pure = perf.predict(config, spec, batch=2, rows=4, context=0, tp=16, collectives=False)
    assert pure.collective_ms == 0 and pure.hbm_floor_ms == e.hbm_floor_ms
    assert perf.predict(config, spec, context=0).collective_ms == 0  # tp = 1


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_every_preset_predicts_for_tp_1_to_32_batch_1_to_8_and_t_1_to_8(tp):
    for name in PRESET_NAMES:
        config = mk.preset(name)
        if not splits(config, tp):  # a split the kernel cannot make
            with pytest.raises(ValueError, match=f"is not a multiple of tp={tp}"):
                perf.predict(config, "tpu7x", context=0, tp=tp)
            continue
        for batch, rows in ((1, 1), (8, 1), (1, 8), (8, 8)):
            e = perf.predict(config, "tpu7x", batch=batch, rows=rows, context=0, tp=tp)
            assert e.step_ms > 0 and math.isfinite(e.tokens_per_s)
            assert e.dominant in ("hbm", "compute", "collective")


# -- The conventional execution ------------------------------------------------------------
def test_conventional_step_is_the_work_plus_one_gap_per_kernel():
    c = perf.conventional(mk.preset("tiny"), "v6e", context=10, gap_s=2e-6)
    assert c.step_ms == pytest.approx(c.work_ms + 2e-3 * len(c.kernels))
    # embed; per dense layer attn_norm, qkv, qk_norm_rope, attention, wo, residual_norm,
    # gate_up, swiglu, down, residual; final norm, lm_head, argmax; no collective
    assert len(c.kernels) == 1 + 2 * 10 + 3
    assert not [k for k in c.kernels if k.name.startswith("all_")]
    tp = perf.conventional(mk.preset("tiny"), "v6e", context=10, tp=2)
    assert sum(k.name == "all_reduce" for k in tp.kernels) == 2 * 2


def test_conventional_moves_at_least_the_roofline_bytes_and_is_never_faster():
    for name in ("tiny", "tiny-moe", "qwen3-8b", "kimi-k3-like"):
        for tp in (1, 8):
            config = mk.preset(name)
            if config.heads % tp:
                continue
            e = perf.predict(config, "tpu7x", batch=2, context=64, tp=tp)
            c = perf.conventional(config, "tpu7x", batch=2, context=64, tp=tp)
            assert sum(k.bytes for k in c.kernels) * tp >= e.total_bytes * (1 - 1e-9)
            assert c.step_ms >= e.step_ms * (1 - 1e-9)
    with pytest.raises(ValueError, match="gap_s=-1"):
        perf.conventional(mk.preset("tiny"), "v6e", gap_s=-1)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_weight_bytes_are_the_arrays_the_megakernel_streams_plus_norms_and_embedding(name):
    # The kernel streams wq..wo, the MLP weights and lm_head from HBM and the norms as
    # f32; perf counts those and the gathered embedding rows (an XLA gather). With every
    # expert touched the rest is equal.
    import jax
    from mk.step import megakernel
    from mk.model.weights import names_of
    from mk.step.plan import DecodePlan, default_block

    config = mk.preset(name)
    block = default_block(config, 64)
    plan = DecodePlan.make(config, batch=1, context=64, block=block)
    params = abstract_params(config)
    weights = jax.eval_shape(lambda p: megakernel.prepare(plan, p), params)
    streamed = ["wq", "wk", "wv", "wo", "lm_head"] + [
        n for kind in ("dense", "moe") if getattr(config, f"{kind}_layers")
        for n in names_of(config, kind, "ring", "dma")]
    arrays = sum(weights[n].size * weights[n].dtype.itemsize for n in streamed)
    e = perf.predict(config, "v6e", batch=64, context=0, routing="disjoint")
    norms = (config.layers * (2 * config.hidden + 2 * config.head_dim) + config.hidden) * 4
    assert e.norm_bytes == norms
    assert e.weight_bytes - e.embed_bytes - norms == arrays
