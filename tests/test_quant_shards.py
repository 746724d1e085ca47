"""Quantised weights on every shard: `mk.step.shards.shard_params` splits
`mk.model.quant.QuantWeight`s by their weights' split rules, and the tensor-parallel megakernel
streams each device's packed tiles.

Here: the identity a device's quantised shard must keep (its dequantised values are the
shard of the dequantised weight, exactly, for every scheme, every split rule the tiny
models have, padding included); the clear error where a split would cut a scale block
(before tracing: the plan refuses it); ahead-of-time compiles of the 27B's TP8 shard
with packed weights; greedy tokens of the megakernel at tp 2 (CI) and 4 on quantised
params of a Qwen3-MoE, a Qwen3.5 hybrid and a Kimi Linear model against the reference on
their dequantised values (subprocesses with virtual devices, tests/multidevice.py, race
detector on, a planted race guarding its silence); the bytes a tp 2 step of packed
tiles moves, counted from the kernel's own DMAs, against the plan, the simulator and
mk.cost.perf (tests/test_plan.py's `counted`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.kernels import backend
from mk.cost import perf
from mk.model import quant, reference
from mk.measure import tpu
from mk.step import tensor_parallel as tpar
from mk.step.plan import DecodePlan
from mk.step.shards import check_quantised_splits, shard_params
from multidevice import planted_race_caught, race_free, run
from test_plan import POSITION, counted
from test_tensor_parallel import tp_hybrid_config, tp_kimi_config
from builders import simulated_step

F32 = jnp.float32


def _quantised(config, scheme: str) -> dict:
    """`config`'s params with every format group it has in `scheme`."""
    groups = dict(dense=scheme) | (dict(experts=scheme) if config.experts else {}) | (
        {} if config.tie_embeddings else dict(lm_head=scheme))
    return quant.quantize(config, mk.init_params(config, seed=1), **groups)


def _model(name: str, tp: int):
    """A preset, or tests/test_tensor_parallel.py's hybrid / Kimi model for tp (Kimi's wq
    streamed: no q low rank, so its "dense" group quantises)."""
    if name == "hybrid":
        return tp_hybrid_config(tp)
    if name == "kimi":
        return dataclasses.replace(tp_kimi_config(tp), q_rank=0)
    return mk.preset(name)


# CI: tiny-moe (columns, rows, vocab, the experts' padding) in every scheme, and each other
# model's own split rules in one scheme, a different one each (tiny's dense MLP packed in
# int4, the hybrid's gated attention in fp8's 2-D blocks, Kimi's MLA and shared expert in
# fp4); `make test-slow` every model in every scheme, and tiny-moe at tp 4.
SHARD_CI = {"tiny-moe": quant.SCHEMES, "tiny": ("int4",), "hybrid": ("fp8",),
            "kimi": ("fp4",)}


@pytest.mark.parametrize("name, tp, scheme", [
    pytest.param(name, tp, scheme, marks=() if scheme in SHARD_CI[name] and
                 (name, tp) != ("tiny-moe", 4) else pytest.mark.slow)
    for name, tp in (("tiny-moe", 2), ("tiny-moe", 4), ("tiny", 2), ("hybrid", 2),
                     ("kimi", 4))  # tp 4: kimi
    for scheme in quant.SCHEMES])
def test_a_quantised_shard_dequantises_to_the_shard_of_the_dequantised_weight(
        name, tp, scheme):
    """Every split rule the models' quantised weights have (columns, rows, kv heads
    replicated at tp > K, vocab, the experts' and FFN's columns and rows padded to whole
    tiles: tiny-moe's 128 expert columns are 64 a device at tp 2, 32 at tp 4; a hybrid's
    gated attention, Kimi's MLA and shared expert), every scheme: exact. CI runs the
    cases of SHARD_CI; `make test-slow` the others."""
    config = _model(name, tp)
    q = _quantised(config, scheme)
    shards = shard_params(config, q, tp)
    got = quant.dequantize(shards, F32)
    want = shard_params(config, quant.dequantize(q, F32), tp)
    assert {n for n, p in shards.items() if isinstance(p, quant.QuantWeight)} == {
        n for n, p in q.items() if isinstance(p, quant.QuantWeight)}
    for n in want:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), n)


def test_a_shards_padding_is_zero_values_and_its_rows_the_full_weights():
    """tiny-moe's we_down at tp 2 in int4: each device's 64 of the 128 expert rows and 64
    rows of padding, repacked (a 128-row packing unit: the padding fills the high
    nibbles); the padding dequantises to zero and device 1's rows are the full weight's
    second half (a control that the split moved them)."""
    config = mk.preset("tiny-moe")
    q = _quantised(config, "int4")
    shards = shard_params(config, q, 2)
    values = np.asarray(quant.dequantize(shards, F32)["we_down"])  # [2, Lm, E, 128, D]
    assert not values[:, :, :, 64:].any()
    full = np.asarray(quant.dequantize(q, F32)["we_down"])
    np.testing.assert_array_equal(values[1, :, :, :64], full[:, :, 64:])
    assert values[1, :, :, :64].any()


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_joined_gate_up_dequantises_to_the_joined_values(scheme):
    """The kernel's layout of a shard whose gate and up each hold 64 columns of values
    (tiny-moe at tp 2, `mk.kinds.mlp.kinds.MoE.prepare`): `mk.model.quant.side_by_side` of the
    packed shards dequantises to gate's then up's values in one 128-column matrix, exactly; fp8's
    128-column scale blocks cannot be cut at 64 (its split is refused first: below)."""
    config = mk.preset("tiny-moe")
    q = _quantised(config, scheme)
    if scheme == "fp8":
        with pytest.raises(ValueError, match="fp8 keeps whole blocks of 128 columns"):
            quant.side_by_side([q["we_gate"], q["we_up"]], 64, 128)
        return
    shards = shard_params(config, q, 2)
    parts = [jax.tree.map(lambda a: a[1], shards[n]) for n in ("we_gate", "we_up")]
    joined = quant.dequantize({"we_gate_up": quant.side_by_side(parts, 64, 128)},
                              F32)["we_gate_up"]
    full = quant.dequantize(q, F32)
    np.testing.assert_array_equal(np.asarray(joined[..., :64]),
                                  np.asarray(full["we_gate"][..., 64:]))
    np.testing.assert_array_equal(np.asarray(joined[..., 64:]),
                                  np.asarray(full["we_up"][..., 64:]))


@pytest.mark.parametrize("name, tp, formats, match", [
    # 768 expert columns at tp 4: 192 a device, padded to 256; device 1's first block of
    # 128 holds columns 192..319, of the full weight's fp8 blocks 1 and 2
    ("qwen3-30b-a3b", 4, dict(experts="fp8"),
     r"we_gate \(fp8\): its ffn_columns split at tp=4 cuts a scale block of 128 columns"),
    ("qwen3-30b-a3b", 8, dict(experts="int4"),
     r"we_down \(int4\): its ffn_rows split at tp=8 cuts a scale block of 128 rows"),
    ("kimi-k3-like", 32, dict(dense="fp8"), r"w_gate \(fp8\).*tp=32.*128 columns"),
])
def test_a_split_that_cuts_a_scale_block_is_refused_by_name_before_tracing(
        name, tp, formats, match):
    config = mk.preset(name)
    with pytest.raises(ValueError, match=match):
        check_quantised_splits(config, formats, tp)
    with pytest.raises(ValueError, match=match):  # the plan: before anything is traced
        DecodePlan.make(config, tp=tp, batch=1, context=4096, formats=formats)


def test_a_split_leaving_part_of_a_block_is_refused_with_the_block_size():
    """wo's 256 rows (4 heads of 64) at tp 4: 64 rows a device; int4 packs and scales
    128 rows, so the share is refused naming 128; int8 (per channel) takes any rows."""
    config = dataclasses.replace(mk.preset("tiny"), heads=4, kv_heads=4, head_dim=64,
                                 name="tiny-h64")
    with pytest.raises(ValueError, match=r"wo \(int4\): its rows split at tp=4 gives each "
                                         r"device 64 rows, not a multiple of 128"):
        check_quantised_splits(config, dict(dense="int4"), 4)
    check_quantised_splits(config, dict(dense="int8"), 4)  # int8: per channel, any rows


def test_fp8_experts_stay_apart_where_joining_them_would_cut_a_scale_block():
    """tiny-moe at tp 2 holds 64 of each expert's gate and up columns a device: stored
    with a scale a column (fp4, int8) or plain they stream joined in one 128-lane tile;
    fp8's 128-column blocks would each hold part of gate and part of up, so its experts
    stay apart (`MoE.joined` reads the plan's formats), and a join asked by hand is
    refused with the block size (`quant.side_by_side`)."""
    config = dataclasses.replace(mk.preset("tiny-moe"), dtype="float32")
    for experts, want in (("fp8", ["we_gate", "we_up", "we_down"]),
                          ("fp4", ["we_gate_up", "we_down"]),
                          ("int8", ["we_gate_up", "we_down"]), (None, ["we_gate_up", "we_down"])):
        plan = DecodePlan.make(config, tp=2, batch=1, context=64,
                               formats=dict(experts=experts) if experts else {})
        assert [s.name for s in plan.stream.segments if s.name.startswith("we_")] == want
    gate = quant.quantize_weight(jnp.ones((256, 128)), "fp8")
    with pytest.raises(ValueError, match=r"used=64: fp8 keeps whole blocks of 128 columns"):
        quant.side_by_side([gate, gate], 64, 128)


@pytest.mark.parametrize("name, tp, formats", [
    ("kimi-k3-like", 32, dict(experts="fp4")), ("qwen3-30b-a3b", 8, dict(experts="fp4")),
    ("qwen3-30b-a3b", 2, dict(experts="fp8", dense="int4", lm_head="int8"))])
def test_the_headline_shards_split_whole(name, tp, formats):
    """FP4 experts split whole at Kimi K3's TP32 (2048 columns: 64 a device, padded) and
    every scheme of 30B-A3B at tp 2; the plan packs them (`packed_formats` at tp > 1)."""
    check_quantised_splits(mk.preset(name), formats, tp)
    plan = DecodePlan.make(mk.preset(name), tp=tp, batch=1, context=4096, formats=formats,
                           kernel=True)
    assert set(plan.stream.schemes) == set(formats.values())


@pytest.mark.slow  # ~60-120 s each on 2 cores; CI compiles Kimi K3's packed TP32 shard
@pytest.mark.parametrize("formats", [dict(dense="fp8", lm_head="int4"),
                                     dict(dense="int8", lm_head="fp4")])
def test_the_27bs_tp8_shard_compiles_for_tpu7x_with_its_weights_packed(formats):
    """Qwen3.5-27B (48 DeltaNet layers, plain; its gated attention and FFN quantised) at
    TP8 on 4 TPU7x chips, ahead of time, with the plan's own ring: Little's law would give
    every ring (plain and each scheme's, one slot index) the slots of 128 x 128 packed
    tiles, over VMEM, so the plan shortens it to leave Mosaic its room
    (`DecodePlan.make`)."""
    config = mk.preset("qwen3.5-27b")
    report = tpu.compile_megakernel(DecodePlan.make(config, chip="tpu7x", tp=8, batch=8,
                                                    context=4096, formats=formats),
                                    topology="tpu7x:2x2x1")
    assert report.ok, report.error
    assert 0 < report.vmem.total_bytes < report.vmem.limit_bytes
    assert {f"ring_{s}" for s in formats.values()} <= {b.name for b in report.vmem.buffers}


def test_the_27bs_fp8_lm_head_at_tp8_is_refused_by_its_scale_blocks():
    """248320 / 8 = 31040 vocab columns a device are not whole 128-column scale blocks."""
    with pytest.raises(ValueError, match=r"lm_head \(fp8\): its vocab split at tp=8 gives "
                                         r"each device 31040 columns, not a multiple of 128"):
        DecodePlan.make(mk.preset("qwen3.5-27b"), tp=8, batch=8, context=4096,
                        formats=dict(lm_head="fp8"))


# -- Greedy tokens at tp 2 (subprocesses with virtual devices) ----------------------------
STEPS, FULL_STEPS = 6, 32  # CI's runs; the check (`make test-slow`)


def _tokens(config, groups: dict, tp: int, steps: int = STEPS, feeds=None,
            collective=None) -> dict:
    """Reference greedy tokens on the dequantised params (as `feeds`, {group: MXU feed},
    has the kernel multiply them: `mk.model.quant.dequantize`) against the megakernel at tp on
    the quantised ones (race detector on; `collective`: the collectives' algorithm,
    default the plan's), then the planted race."""
    params = quant.quantize(config, mk.init_params(config, seed=tp), **groups)
    prompt = jax.random.randint(jax.random.key(tp), (2, 5), 0, config.vocab)
    want = reference.generate(config, quant.dequantize(params, feeds=feeds), prompt, steps)
    with backend.use("interpret", detect_races=True):
        got = tpar.generate(config, params, prompt, steps, tp=tp, steps_per_call=steps,
                            feeds=feeds, collective=collective)
        jax.block_until_ready(got)
        races = backend.races_found()
    return dict(want=want, got=got, races=races, planted_caught=planted_race_caught(tp))


def _tiny_moe():
    return dataclasses.replace(mk.preset("tiny-moe"), dtype="float32")


def moe_fp4(tp):
    """FP4 experts (64 columns a device at tp 2, padded), int8 attention and dense MLP;
    the collectives "two_phase" (the plan's default from tp 4; at tp 2 CI's one case of
    it in the megakernel, where the plan's default is "recursive", the slow cases' path)."""
    return _tokens(_tiny_moe(), dict(experts="fp4", dense="int8"), tp, collective="two_phase")


def moe_int8(tp):
    return _tokens(_tiny_moe(), dict(experts="int8", lm_head="int4"), tp)


def moe_fp8(tp):
    return _tokens(_tiny_moe(), dict(experts="fp8", lm_head="fp8"), tp)


def moe_int4(tp):
    return _tokens(_tiny_moe(), dict(experts="int4", dense="fp4"), tp)


def moe_fp8_fed(tp):
    """fp8 experts and fp4 attention and dense MLP fed to the MXU as fp8 (TPU7x's path)."""
    groups = dict(experts="fp8", dense="fp4")
    return _tokens(_tiny_moe(), groups, tp, feeds=dict.fromkeys(groups, "fp8"))


def hybrid_int8(tp):
    """Qwen3.5's layers (tests/test_tensor_parallel.py's model for tp): its gated full
    attention and dense MLP (the "dense" group) and lm_head quantised, DeltaNet plain."""
    return _tokens(tp_hybrid_config(tp), dict(dense="int8", lm_head="fp4"), tp)


def kimi_fp4(tp):
    """Kimi Linear's layers with FP4 experts, its MLA (wq streamed: no q low rank), shared
    expert and dense MLP in int4, its lm_head in fp8; KDA plain."""
    config = dataclasses.replace(tp_kimi_config(tp), q_rank=0)
    return _tokens(config, dict(experts="fp4", dense="int4", lm_head="fp8"), tp)


# The check, 32 tokens: each scheme in the experts (tiny-moe, Kimi) and in the dense
# group (all three models) at tp 2 or 4, an lm_head in each.
FULL = {("moe", 2): dict(experts="int8", dense="fp8", lm_head="fp4"),
        ("moe", 4): dict(experts="int4", dense="fp4", lm_head="int8"),
        ("hybrid", 2): dict(dense="int4", lm_head="fp8"),
        ("hybrid", 4): dict(dense="fp8", lm_head="int4"),
        ("kimi", 2): dict(experts="fp8", dense="int8", lm_head="fp4"),
        ("kimi", 4): dict(experts="fp4", dense="int4", lm_head="int8")}


def _full(name: str, tp: int) -> dict:
    config = _tiny_moe() if name == "moe" else _model(name, tp)
    return _tokens(config, FULL[name, tp], tp, FULL_STEPS)


def moe_full(tp):
    return _full("moe", tp)


def hybrid_full(tp):
    return _full("hybrid", tp)


def kimi_full(tp):
    return _full("kimi", tp)


# CPU seconds at tp 2 (one subprocess each, compile included): ~35-60. CI runs tiny-moe
# (fp4 experts, int8 dense); `make test-slow` the hybrid and Kimi, the other schemes, tp 4.
@pytest.mark.parametrize("target, tp", [
    ("moe_fp4", 2),
    pytest.param("hybrid_int8", 2, marks=pytest.mark.slow),
    pytest.param("kimi_fp4", 2, marks=pytest.mark.slow),
    pytest.param("moe_int8", 2, marks=pytest.mark.slow),
    pytest.param("moe_fp8", 2, marks=pytest.mark.slow),
    pytest.param("moe_int4", 2, marks=pytest.mark.slow),
    pytest.param("moe_fp8_fed", 2, marks=pytest.mark.slow),
    pytest.param("moe_fp4", 4, marks=pytest.mark.slow),
    pytest.param("hybrid_int8", 4, marks=pytest.mark.slow),
    pytest.param("kimi_fp4", 4, marks=pytest.mark.slow),
    *(pytest.param(f"{name}_full", tp, marks=pytest.mark.slow) for name, tp in FULL)])
def test_quantised_greedy_tokens_at_tp_equal_the_reference_race_free(target, tp):
    out = run(f"test_quant_shards:{target}", tp)
    assert out["got"].shape == (tp, *out["want"].shape)
    for device in range(tp):
        np.testing.assert_array_equal(out["got"][device], out["want"], f"device {device}")
    race_free(out["races"], out["planted_caught"])


# -- Bytes at tp 2: kernel = plan = simulator = mk.cost.perf ------------------------------------
BYTES_FORMATS = dict(dense="int8", experts="fp4", lm_head="int4")


def counted_quantised(tp):
    return counted("tiny-moe", tp, BYTES_FORMATS)


def counted_quantised_split(tp):
    return counted("tiny-moe", tp, BYTES_FORMATS, router_split="experts")


@pytest.mark.parametrize("split", [  # tiny-moe's "auto": whole
    "auto", pytest.param("experts", marks=pytest.mark.slow)])
def test_a_quantised_shards_dmas_move_the_bytes_the_plan_the_simulator_and_perf_count(split):
    """tiny-moe at tp 2, every group packed (experts 64 columns a device padded to 128),
    its router whole or split by experts: the bytes its DMAs move per family, summed over
    both devices, are the plan's, the simulator's and mk.cost.perf's, and the packed families'
    are their schemes' share of the plain tiles' (a kernel streaming the dequantised
    tiles would move 2-4x more); a split router moves 1/tp of the whole one's bytes."""
    tp, formats = 2, BYTES_FORMATS
    target = "counted_quantised" + ("_split" if split == "experts" else "")
    got = {f: int(b) for f, b in run(f"test_quant_shards:{target}", tp).items()}
    config = dataclasses.replace(mk.preset("tiny-moe"), router_split=split)
    plan = DecodePlan.make(config, tp=tp, batch=1, rows=1, context=config.max_context,
                           formats=formats)
    assert set(plan.stream.schemes) == {"int8", "fp4", "int4"}
    active = config.experts_per_token
    want = {f: tp * b for f, b in plan.weight_bytes(active).items() if b}
    assert {f: got[f] for f in want} == want
    replay = simulated_step(config, "v5e", batch=1, rows=1, context=POSITION, tp=tp,
                            block=plan.block, experts_active=active, formats=formats)
    assert {f: tp * b for f, b in replay.family_bytes().items()} == got
    roof = perf.predict(config, "v5e", batch=1, rows=1, context=POSITION, tp=tp,
                        routing="shared", formats=formats)
    by_perf = dict(attention=roof.attention_bytes, norms=roof.norm_bytes,
                   dense_mlp=roof.dense_mlp_bytes, router=roof.router_bytes,
                   experts=roof.expert_bytes, lm_head=roof.lm_head_bytes)
    assert {f: b for f, b in by_perf.items() if b} == want
    plain = DecodePlan.make(config, tp=tp, batch=1, rows=1, context=config.max_context,
                            formats={}, block=plan.block)
    elements = {f: tp * b / 2 for f, b in plain.weight_bytes(active).items()}
    rows = plan.block.tile_rows
    for family, per in (("attention", 1 + 4 / rows), ("experts", 0.5 + 1 / 32),
                        ("lm_head", 0.5 + 2 / 128)):
        assert got[family] == pytest.approx(elements[family] * per, rel=1e-12), family
    whole_router = len(config.moe_layers) * config.hidden * config.experts * 2  # bf16
    assert got["router"] == whole_router * (1 if split == "experts" else tp)
