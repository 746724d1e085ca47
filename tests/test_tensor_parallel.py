"""mk.step.tensor_parallel: the megakernel with tp > 1 against the single-device reference.

The token checks run in subprocesses with 2 tp virtual CPU devices (tests/multidevice.py),
in TPU interpret mode with the race detector on; a planted cross-device race runs after
them in the same subprocess, and a run whose detector missed it is inconclusive
(skipped). Each uses a model made for its tp (tiny
widths: every shard is one or two 128-wide tiles; kv heads replicated when tp > 2).

Time budget: the CPU compile of the interpreted kernel dominates (about 30 s of CPU for a
model holding both MLP kinds, half that for a dense one; each step then costs about 1 s
per device pair), so the default run checks tp=2 on a dense + MoE model (one compile, both
MLP kinds) and tp=4, 8 on a dense model, 6 tokens each. The tests marked slow (`make
test-slow`) run the issue's full check: the dense + MoE model at tp = 2, 4, 8 for 32
tokens (12.7 CPU minutes; they pass). Kimi Linear's MoE with FP4 experts packed, gate and up
joined in one lane tile and two-phase all-reduces runs against transformers' own greedy
tokens (a transformers-written checkpoint whose experts lie on the FP4 grid): 6 tokens at
tp 2 in CI (~55 s), 32 at tp 2 and 4 in the slow run (~140 s and ~260 s; they pass).
Kimi K3's kinds the kernel runs (gated MLA, bounded KDA, SiTU dense) at tp 2 in the slow
run (~35 s).
Not covered by interpret mode: time, ICI routing, the scoped VMEM limit; the ahead-of-time
compiles cover lowering and capacity on real topologies.
"""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.kernels import backend
from mk.model import reference
from mk.measure import tpu
from mk.step.shards import kv_heads_of, shard_cache, shard_params
from mk.step import tensor_parallel as tpar
from mk.model.config import ModelConfig, Yarn
from mk.step import plan
from mk.kinds.layers import layer_kinds
from mk.model.weights import param_shapes
from builders import bar_count
from multidevice import planted_race_caught, race_free, run

CASES = [(2, True), (4, False), (8, False)]  # (tp, with an MoE layer): 6 steps each
FULL_STEPS = 32  # the check, dense + MoE at every tp: `make test-slow`


def tp_config(tp: int, moe: bool = True, **overrides) -> ModelConfig:
    """Two layers (dense, then MoE unless moe=False) whose shards are whole 128-wide tiles
    at this tp."""
    fields = dict(name=f"tp{tp}-tiny", vocab=256 * tp, hidden=128, layers=2, heads=2 * tp,
                  kv_heads=2, head_dim=128, ffn=128 * tp, rope_theta=10_000.0,
                  max_position=4096, max_context=128)
    if moe:
        fields |= dict(experts=4, experts_per_token=2, expert_ffn=128 * tp, moe_layers=(1,),
                       norm_topk=True)
    return ModelConfig(**(fields | overrides))


def tp_hybrid_config(tp: int) -> ModelConfig:
    """Qwen3.5's layers (linear, full, linear; gated attention, partial RoPE) in float32
    (the reference's tokens exactly), with tp key heads and 2 tp value heads: one key head
    and two value heads per device, every shard whole 128-lane tiles."""
    return tp_config(tp, moe=False, name=f"tp{tp}-hybrid", layers=3, dtype="float32",
                     layer_types=("linear", "full", "linear"), linear_key_heads=tp,
                     linear_value_heads=2 * tp, linear_key_dim=128, linear_value_dim=128,
                     conv_kernel=4, attn_output_gate=True, partial_rotary_factor=0.25,
                     norm_offset=1.0)


def tp_kimi_config(tp: int) -> ModelConfig:
    """Kimi Linear's layers (KDA, MLA with a q low rank, KDA) in float32: 2 tp MLA heads
    (nope 128 + a shared part of 64, a latent of 128; two a device, so wq's shard is whole
    tiles, as Kimi K3's at TP32) and tp KDA heads of 128, MoE in the
    last two with a shared expert and the grouped sigmoid router: every shard whole
    128-lane tiles."""
    return tp_config(tp, name=f"tp{tp}-kimi", layers=3, dtype="float32", qk_norm=False,
                     heads=2 * tp, kv_heads=2 * tp, head_dim=192, latent_rank=128, q_rank=128,
                     rope_dim=64, value_dim=128,
                     layer_types=("linear", "full", "linear"), linear_key_heads=tp,
                     linear_value_heads=tp, linear_key_dim=128, linear_value_dim=128,
                     conv_kernel=4, channel_decay=True, moe_layers=(1, 2),
                     shared_expert_ffn=128 * tp, router_score="sigmoid", expert_groups=2,
                     topk_groups=1, routed_scale=2.5)


def tp_k3_kinds_config(tp: int) -> ModelConfig:
    """The Kimi K3 kinds the megakernel runs, in float32: an MLA layer with K3's output
    gate (2 tp heads, a q low rank, as `tp_kimi_config`'s) then K3's KDA layer (its
    bound -5, its full-rank gate), dense SiTU MLPs at K3's betas; every shard whole
    128-lane tiles."""
    return tp_config(tp, moe=False, name=f"tp{tp}-k3-kinds", dtype="float32", qk_norm=False,
                     heads=2 * tp, kv_heads=2 * tp, head_dim=192, latent_rank=128,
                     q_rank=128, rope_dim=64, value_dim=128, layer_types=("full", "linear"),
                     linear_key_heads=tp, linear_value_heads=tp, linear_key_dim=128,
                     linear_value_dim=128, conv_kernel=4, channel_decay=True,
                     kda_full_gate=True, kda_gate_bound=-5.0, attn_output_gate=True,
                     situ_beta=4.0, situ_linear_beta=25.0)


def tp_gpt_oss_config(tp: int) -> ModelConfig:
    """gpt-oss's layers in float32: attention with sinks and biases (a 3-position sliding
    window on layer 0, full on layer 1), YaRN RoPE, a dense layer then the biased
    clamped-SwiGLU experts (a clamp of 1, low enough to bind); every shard whole 128-lane
    tiles."""
    return tp_config(tp, name=f"tp{tp}-gpt-oss", dtype="float32", qk_norm=False,
                     attention_sinks=True, attention_bias=True, sliding_window=3,
                     sliding_layers=(0,), yarn=Yarn(factor=32.0, original_max_position=4096),
                     swiglu_limit=1.0, swiglu_alpha=1.702)


def _tokens(tp: int, moe: bool, steps: int, config: ModelConfig | None = None) -> dict:
    config = config or tp_config(tp, moe)
    params = mk.init_params(config, seed=tp)
    if "router_bias" in params:  # init_params' zero bias would hide a lost one
        bias = np.random.default_rng(tp).normal(0, 0.5, params["router_bias"].shape)
        params["router_bias"] = jnp.asarray(bias, params["router_bias"].dtype)
    prompt = jax.random.randint(jax.random.key(tp), (2, 5), 0, config.vocab)
    want = reference.generate(config, params, prompt, steps)
    drawn = io.StringIO()
    with backend.use("interpret", detect_races=True), contextlib.redirect_stderr(drawn):
        got = tpar.generate(config, params, prompt, steps, tp=tp, steps_per_call=steps,
                            progress=True)
        jax.block_until_ready(got)
        races = backend.races_found()
    return dict(want=want, got=got, races=races, bar=bar_count(drawn.getvalue()) or (0, 0),
                planted_caught=planted_race_caught(tp))


def tokens(tp: int) -> dict:
    """Runs in the subprocess: reference and TP greedy tokens, race detector on."""
    return _tokens(tp, dict(CASES)[tp], 6)


def tokens_full(tp: int) -> dict:
    return _tokens(tp, True, FULL_STEPS)


def hybrid_tokens(tp: int) -> dict:
    return _tokens(tp, False, 6, tp_hybrid_config(tp))


def kimi_tokens(tp: int) -> dict:
    return _tokens(tp, True, 6, tp_kimi_config(tp))


def k3_kinds_tokens(tp: int) -> dict:
    return _tokens(tp, False, 6, tp_k3_kinds_config(tp))


def mla_only_tokens(tp: int) -> dict:
    """`tp_k3_kinds_config`'s gated MLA in both layers: no linear layer, so the cache's
    linear fields hold zero layers (tests/test_cache.py shards them)."""
    config = dataclasses.replace(
        tp_k3_kinds_config(tp), name=f"tp{tp}-mla-only", layer_types=("full", "full"),
        linear_key_heads=0, linear_value_heads=0, linear_key_dim=0, linear_value_dim=0,
        conv_kernel=0, channel_decay=False, kda_full_gate=False, kda_gate_bound=0.0)
    return _tokens(tp, False, 6, config)


def gpt_oss_tokens(tp: int) -> dict:
    return _tokens(tp, True, 6, tp_gpt_oss_config(tp))


def tp_k3_config(tp: int, latent: int = 128) -> ModelConfig:
    """`tiny-k3` (every K3 feature: KDA, gated MLA, SiTU, attention residuals, the latent
    MoE) in float32, its heads, experts' and shared expert's widths scaled by tp so each
    shard is whole tiles, its latent `latent` wide: at tp 2 its one tile is device 0's
    and device 1 holds zeros (as 4 of Kimi K3's 32 devices do); 256 at tp 4, two
    holders and two zero devices."""
    k3 = mk.preset("tiny-k3")
    return dataclasses.replace(
        k3, name=f"tp{tp}-k3", dtype="float32", heads=tp, kv_heads=tp,
        linear_key_heads=tp, linear_value_heads=tp, moe_latent=latent,
        expert_ffn=128 * tp, shared_expert_ffn=128 * tp, ffn=256 * tp, vocab=256 * tp)


def k3_tokens(tp: int) -> dict:
    return _tokens(tp, True, 6, tp_k3_config(tp, 128 * (tp // 2)))


@pytest.mark.parametrize("target, tp", [
    # bf16 MoE at tp 2 in slow: CI runs the fp4 MoE at tp 2 (tests/test_quant_shards.py),
    # through the same all-reduces and routing
    *(pytest.param("tokens", t, marks=pytest.mark.slow) for t, _ in CASES),
    *(pytest.param("tokens_full", t, marks=pytest.mark.slow) for t in (2, 4, 8)),
    # a hybrid: ~45 CPU s at tp 2; CI compiles the 27B at TP8 and checks the linear shards
    pytest.param("hybrid_tokens", 2, marks=pytest.mark.slow),
    pytest.param("hybrid_tokens", 4, marks=pytest.mark.slow),
    # Kimi's MLA, KDA and MoE (shared expert, sigmoid router): ~54 CPU s at tp 2, over
    # CI's budget; CI compiles Kimi K3's TP32 shard (its first layers) below
    pytest.param("kimi_tokens", 2, marks=pytest.mark.slow),
    # gpt-oss's sinks, window, biases (o's and the experts' down added once) and clamp:
    # ~40 s, over CI's budget (CI runs the fp4 MoE at tp 2 through the same collectives)
    pytest.param("gpt_oss_tokens", 2, marks=pytest.mark.slow),
    # Kimi K3's gated MLA (wg split by heads), bounded KDA (kda_g too) and SiTU dense
    # MLP, over CI's budget
    pytest.param("k3_kinds_tokens", 2, marks=pytest.mark.slow),
    # an MLA model with no linear layer (its cache's empty linear fields at tp)
    pytest.param("mla_only_tokens", 2, marks=pytest.mark.slow),
    # every Kimi K3 kind at tp: the latent MoE's all-gather and all-reduce, a device that
    # holds zeros of the latent (CI's one K3 case at tp), then two holders and two zero
    # devices
    ("k3_tokens", 2), pytest.param("k3_tokens", 4, marks=pytest.mark.slow)],
    ids=[f"tp{t}-{'moe' if m else 'dense'}-6" for t, m in CASES]
    + [f"tp{t}-moe-{FULL_STEPS}" for t in (2, 4, 8)]
    + ["tp2-hybrid-6", "tp4-hybrid-6", "tp2-kimi-6", "tp2-gpt-oss-6", "tp2-k3-kinds-6",
       "tp2-mla-only-6", "tp2-k3-6", "tp4-k3-6"])
def test_greedy_tokens_equal_the_reference_on_every_device_race_free(target, tp):
    out = run(f"test_tensor_parallel:{target}", tp)
    assert out["got"].shape == (tp, *out["want"].shape)
    steps = out["want"].shape[1]
    assert tuple(out["bar"]) == (steps, steps), "the progress bar miscounted"
    for device in range(tp):
        np.testing.assert_array_equal(out["got"][device], out["want"], f"device {device}")
    # "No race" counts only when the planted race of the same subprocess was caught.
    race_free(out["races"], out["planted_caught"])


# -- Kimi Linear's MoE at tp, FP4 experts packed, against transformers ------------------------
# A TPU-shaped kimi_linear written by transformers (tests/test_kimi.py's kda-mla-kda pattern
# with 8 MLA heads and 4 KDA heads, so tp 2 and 4 split them into whole tiles: an MLA
# head's query is 192 wide, two a device), its experts rounded onto the FP4
# grid before saving: transformers' greedy tokens are then the oracle of the megakernel
# on the FP4-packed shards (the 128 expert columns are 64 a device at tp 2, 32 at tp 4:
# gate and up joined in one lane tile), the router split by experts (Kimi K3's layout at
# TP32; the logits all-gathered), two-phase collectives, race detector on.
def kimi_hf_fields() -> dict:
    from test_kimi import TPU_CASES, TPU_COMMON
    return {**TPU_COMMON, **TPU_CASES["kda-mla-kda"], "num_attention_heads": 8,
            "num_key_value_heads": 8, "linear_num_heads": 4}


def _on_fp4_grid(model) -> None:
    """Round every routed expert matrix of the transformers `model` onto mk.model.quant's FP4
    values (its [E, out, in] groups of 32 along in), in place."""
    import torch

    from mk.model import quant
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                w = param.numpy().swapaxes(-1, -2)  # mk's [E, in, out]
                q = quant.quantize_weight(jnp.asarray(w), "fp4", name)
                rounded = np.asarray(quant.dequantize({name: q}, jnp.float32)[name])
                param.copy_(torch.from_numpy(np.ascontiguousarray(rounded.swapaxes(-1, -2))))


def kimi_fp4_hf_tokens(tp: int) -> dict:
    """The issue's check: 32 tokens (`make test-slow`)."""
    return _kimi_fp4_hf_tokens(tp, FULL_STEPS)


def kimi_fp4_hf_tokens_ci(tp: int) -> dict:
    """CI's case: 6 tokens (~55 s at tp 2, of which the compile is most)."""
    return _kimi_fp4_hf_tokens(tp, 6)


def _kimi_fp4_hf_tokens(tp: int, steps: int) -> dict:
    """Runs in the subprocess: transformers' `steps` greedy tokens against the megakernel's
    at tp on the FP4-packed experts ("two_phase" all-reduces, race detector on)."""
    import tempfile

    from builders import build_hf_model, hf_greedy
    from mk.model import quant

    model = build_hf_model("kimi_linear", kimi_hf_fields(), seed=tp)
    _on_fp4_grid(model)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        config, params = mk.load_checkpoint(folder)
    config = dataclasses.replace(config, router_split="experts")
    qparams = quant.quantize(config, params, experts="fp4")
    exact = all(np.array_equal(np.asarray(quant.dequantize(qparams, jnp.float32)[n]),
                               np.asarray(params[n])) for n in ("we_gate", "we_up", "we_down"))
    prompt = np.random.default_rng(tp).integers(0, config.vocab, (2, 8))
    want = hf_greedy(model, prompt, steps)
    with backend.use("interpret", detect_races=True):
        got = tpar.generate(config, qparams, prompt, steps, tp=tp, steps_per_call=steps,
                            collective="two_phase")
        jax.block_until_ready(got)
        races = backend.races_found()
    moe = [k for k in plan.DecodePlan.make(config, tp=tp, batch=2, context=64).kinds
           if k.name == "moe"]
    return dict(want=want, got=got, races=races, exact=exact,
                joined=np.asarray([k.joined for k in moe]),
                split=np.asarray([k.router_shards for k in moe]),
                planted_caught=planted_race_caught(tp))


@pytest.mark.parametrize("target, tp, steps", [
    ("kimi_fp4_hf_tokens_ci", 2, 6),  # 32 tokens at tp 2: ~140 CPU s, over CI's budget
    pytest.param("kimi_fp4_hf_tokens", 2, FULL_STEPS, marks=pytest.mark.slow),
    pytest.param("kimi_fp4_hf_tokens", 4, FULL_STEPS, marks=pytest.mark.slow)])
def test_kimi_fp4_experts_joined_at_tp_give_transformers_greedy_tokens(target, tp, steps):
    out = run(f"test_tensor_parallel:{target}", tp)
    assert out["exact"], "the FP4-rounded experts must pack without loss"
    assert out["joined"].tolist() == [128], "gate and up must stream joined at this tp"
    assert out["split"].tolist() == [tp], "the router must be split by experts"
    assert out["want"].shape == (2, steps)
    for device in range(tp):
        np.testing.assert_array_equal(out["got"][device], out["want"], f"device {device}")
    race_free(out["races"], out["planted_caught"])


def test_shards_put_back_together_are_the_weights():
    config = tp_config(4)
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape).astype(np.float32)
              for name, (shape, _) in param_shapes(config).items()}
    shards = shard_params(config, params, 4)
    np.testing.assert_array_equal(jnp.concatenate(list(shards["wq"]), axis=-1),
                                  params["wq"])
    np.testing.assert_array_equal(jnp.concatenate(list(shards["wo"]), axis=-2),
                                  params["wo"])
    np.testing.assert_array_equal(jnp.concatenate(list(shards["we_down"]), axis=-2),
                                  params["we_down"])
    np.testing.assert_array_equal(shards["router"][3], params["router"])
    # 2 kv heads on 4 devices: devices 0, 1 hold kv head 0; devices 2, 3 kv head 1, which
    # serves query heads 4..7 (GQA group 4), the query heads of devices 2 and 3.
    assert kv_heads_of(config, 4) == [[0], [0], [1], [1]]
    H = config.head_dim
    np.testing.assert_array_equal(shards["wk"][2], params["wk"][..., H:2 * H])
    local = plan.shard_config(config, 4)
    assert (local.heads, local.kv_heads, local.ffn, local.vocab) == (2, 1, 128, 256)


def test_a_linear_layer_is_split_by_its_heads_q_k_and_v_channels_each():
    """in_proj_qkv's columns and the conv's channels are q | k | v: device i holds its key
    heads' q and k channels and its value heads' v channels, in that order; its state
    rows are its value heads'."""
    config = tp_hybrid_config(2)
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape).astype(np.float32)
              for name, (shape, _) in param_shapes(config).items()}
    shards = shard_params(config, params, 2)
    kw, Hk, Hv = config.linear_key_width, config.linear_key_dim, config.linear_value_dim
    qkv = params["lin_qkv"]
    want = np.concatenate([qkv[..., Hk:2 * Hk], qkv[..., kw + Hk:kw + 2 * Hk],
                           qkv[..., 2 * kw + 2 * Hv:]], axis=-1)  # device 1: head 1, 2-3
    np.testing.assert_array_equal(shards["lin_qkv"][1], want)
    np.testing.assert_array_equal(shards["lin_out"][1], params["lin_out"][:, 2 * Hv:])
    np.testing.assert_array_equal(shards["wq_gate"][0],
                                  params["wq_gate"][..., :config.q_width // 2])
    cache = reference.init_cache(config, 1, 16)
    cache = cache._replace(state=jnp.asarray(rng.standard_normal(cache.state.shape)))
    sharded = shard_cache(config, cache, 2)
    np.testing.assert_array_equal(sharded.state[1], cache.state[:, :, 2:])
    assert sharded.conv.shape[-1] == config.conv_channels // 2


def test_a_split_width_short_of_a_tile_is_padded_with_zeros():
    config = tp_config(4, expert_ffn=256)  # 64 columns per device: padded to 128
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape).astype(np.float32)
              for name, (shape, _) in param_shapes(config).items()}
    shards = shard_params(config, params, 4)
    assert plan.shard_config(config, 4).expert_ffn == 128
    assert shards["we_gate"].shape[-1] == shards["we_down"].shape[-2] == 128
    np.testing.assert_array_equal(shards["we_gate"][1, ..., :64],
                                  params["we_gate"][..., 64:128])
    assert not np.any(shards["we_gate"][..., 64:]) and not np.any(shards["we_up"][..., 64:])
    assert not np.any(shards["we_down"][..., 64:, :])
    # the kernel's layout: gate's and up's 64 columns side by side in one 128-lane tile
    moe = next(k for k in layer_kinds(plan.shard_config(config, 4)) if k.name == "moe")
    assert moe.joined == 128 and moe.operands()[-2:] == ("we_gate_up", "we_down")
    device = moe.prepare({name: a[1] for name, a in shards.items()})
    assert "we_gate" not in device and device["we_gate_up"].shape[-1] == 128
    np.testing.assert_array_equal(device["we_gate_up"][..., :64], params["we_gate"][..., 64:128])
    np.testing.assert_array_equal(device["we_gate_up"][..., 64:], params["we_up"][..., 64:128])
    wide = next(k for k in layer_kinds(plan.shard_config(tp_config(4), 4)) if k.name == "moe")
    assert wide.joined is None  # 128 columns a device: whole tiles apart, nothing to join


def test_kimis_mla_kda_gates_and_shared_expert_are_split_by_heads_and_width():
    """A KDA layer's low-rank gates: the up-projections (f_b, g_b) and the per-channel
    dt_bias by heads, the down-projections (f_a, g_a) whole; MLA's wq and wkv_b by heads,
    wo by rows, its low-rank wq_a and wkv_a and their norms whole; the shared expert as a
    dense MLP (gate, up by columns, down by rows); the sigmoid router's bias whole."""
    config = tp_kimi_config(2)
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape).astype(np.float32)
              for name, (shape, _) in param_shapes(config).items()}
    shards = shard_params(config, params, 2)
    half = config.linear_value_heads // 2 * config.linear_key_dim  # one device's channels
    for name in ("kda_f_b", "kda_g_b", "lin_dt_bias"):
        np.testing.assert_array_equal(shards[name][1], params[name][..., half:])
    for name in ("kda_f_a", "kda_g_a", "lin_norm", "router_bias", "wq_a", "q_a_norm",
                 "wkv_a", "kv_a_norm"):
        np.testing.assert_array_equal(shards[name][1], params[name])
    up = params["wkv_b"].shape[-1] // 2  # device 1's head: its W_uk and W_uv columns
    np.testing.assert_array_equal(shards["wkv_b"][1], params["wkv_b"][..., up:])
    np.testing.assert_array_equal(shards["wq"][1], params["wq"][..., config.q_width // 2:])
    Fs = config.shared_expert_ffn // 2
    np.testing.assert_array_equal(shards["ws_gate"][1], params["ws_gate"][..., Fs:])
    np.testing.assert_array_equal(shards["ws_down"][0], params["ws_down"][:, :Fs])
    local = plan.shard_config(config, 2)
    assert (local.linear_value_heads, local.shared_expert_ffn) == (1, 128)
    assert {k: v.shape[1:] for k, v in shards.items() if k != "embed"} == {
        k: s for k, (s, _) in param_shapes(local).items() if k != "embed"}


def test_the_router_is_split_by_experts_where_the_plan_says_it_pays():
    """`router_columns`: Kimi K3's router (7168 x 896 bf16, 12.25 MiB a layer) is split by
    experts at TP32, 28 a device (its rows: the kernel holds it transposed); the presets'
    small routers stay whole (the gather's latency would outweigh the bytes); "whole"
    and "experts" force either. A forced split's shards put back together are the router
    and each device's is its experts' columns."""
    k3 = mk.preset("kimi-k2-shaped")
    assert plan.shard_config(k3, 32).router_columns == 28
    assert plan.shard_config(dataclasses.replace(k3, router_split="whole"),
                             32).router_columns == 0
    for name in ("qwen3-30b-a3b", "gpt-oss-20b", "tiny-moe"):
        local = plan.shard_config(mk.preset(name), 2)
        assert (local.router_split, local.router_columns) == ("whole", 0), name
    tiny = dataclasses.replace(mk.preset("tiny-moe"), router_split="experts")
    local = plan.shard_config(tiny, 2)
    assert (local.router_split, local.router_columns) == ("experts", tiny.experts // 2)
    kind = next(k for k in layer_kinds(local) if k.name == "moe")
    assert kind.router_shards == 2 and "router split by experts (4 of 8" in kind.described()
    params = mk.init_params(tiny)
    shards = shard_params(tiny, params, 2)
    assert shards["router"].shape[1:] == param_shapes(local)["router"][0]
    np.testing.assert_array_equal(shards["router"][1], params["router"][..., 4:])
    np.testing.assert_array_equal(np.concatenate(list(shards["router"]), -1), params["router"])


@pytest.mark.parametrize("overrides, tp, match", [
    (dict(router_split="rows"), 2, r"router_split='rows' must be one of \('auto', 'whole', "
     r"'experts'\)"),
    (dict(router_split="experts", experts=4), 8, r"router_split='experts' needs tp=8 to "
     r"divide experts=4"),
    (dict(router_columns=3), 2, r"router_columns=3 must be 0 \(every expert\) or a divisor "
     r"of experts=4"),
    (dict(moe_layers=(), experts=0, experts_per_token=0, expert_ffn=0,
          router_split="experts"), 2, r"router_split.* are set but moe_layers is empty"),
])
def test_a_router_split_that_cannot_be_made_is_refused(overrides, tp, match):
    with pytest.raises(ValueError, match=match):
        plan.shard_config(tp_config(tp, **overrides), tp)


@pytest.mark.parametrize("overrides, match", [
    (dict(heads=6), r"heads=6 is not a multiple of tp=4"),
    (dict(vocab=1002), r"vocab=1002 is not a multiple of tp=4"),
    (dict(expert_ffn=130), r"expert_ffn=130 is not a multiple of tp=4"),
    (dict(shared_expert_ffn=130), r"shared_expert_ffn=130 is not a multiple of tp=4"),
    (dict(heads=12, kv_heads=3), r"kv_heads=3 and tp=4: one must divide the other"),
])
def test_a_width_tp_does_not_split_is_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        tpar.generate(tp_config(4, **overrides), {}, jnp.zeros((1, 4), int), 2, tp=4)


@pytest.mark.parametrize("tp", [0, 3, 16.0])
def test_a_tp_that_is_not_a_power_of_two_is_refused(tp):
    with pytest.raises(ValueError, match=r"tp=.* must be a power of two"):
        plan.shard_config(tp_config(2), tp)


@pytest.mark.parametrize("chip, chips, name", [
    ("tpu7x", 4, "tpu7x:2x2x1"), ("tpu7x", 16, "tpu7x:2x2x4"), ("v6e", 4, "v6e:2x2"),
    ("v5e", 1, "v5e:1x1")])
def test_a_published_runs_chips_name_a_libtpu_topology_with_its_cores(chip, chips, name):
    """`mk.measure.tpu.topology_for`: the topology the published runs compile on (4 and 16 TPU7x
    chips: TP8 and TP32) has chips x cores per chip devices in libtpu."""
    assert tpu.topology_for(chip, chips) == name
    assert len(tpu.devices(name)) == chips * mk.chip(chip).cores_per_chip


@pytest.mark.parametrize("chip, chips, message", [
    ("tpu7x", 6, r"chips=6 on tpu7x: .*\(a multiple of 4\)"), ("v6e", 8, "chips=8 on v6e"),
    ("tpu7x", 0, "chips=0 must be a positive integer"), ("gb200", 4, "only TPUs")])
def test_a_chip_count_with_no_topology_is_refused(chip, chips, message):
    with pytest.raises(ValueError, match=message):
        tpu.topology_for(chip, chips)


@pytest.mark.parametrize("name, topology, chip", [
    ("qwen3.5-27b", "tpu7x:2x2x1", "tpu7x"),  # TP8: 4 chips, 8 cores
    ("qwen3-30b-a3b", "v5e:2x4", "v5e"),  # TP8: at TP4 it does not fit (next test)
])
def test_sharded_model_compiles_for_a_multi_chip_topology(name, topology, chip):
    report = tpu.compile_megakernel(plan.DecodePlan.make(mk.preset(name), chip=chip, tp=8,
                                                         batch=8, context=4096),
                                    topology=topology)
    assert report.ok, report.error
    assert report.tp == 8
    assert 0 < report.vmem.total_bytes < report.vmem.limit_bytes
    assert report.argument_bytes <= mk.chip(chip).hbm_bytes


def test_kimi_k3s_whole_tp32_shard_compiles_with_fp4_experts_packed():
    """One device's shard of the release's Kimi K3 (gated MLA, bounded KDA, SiTU, attention
    residuals, the latent MoE with its shared expert; all 93 layers) at TP32 on 16 TPU7x
    chips, its FP4 experts packed (3072 expert columns, 96 a device padded to 128; whole
    scale blocks: `mk.step.shards`), its latent dealt in whole tiles (128 of 3584 columns a
    device: 28 devices hold one tile, 4 hold zeros; `mk.kinds.mlp.latent_moe`), at the
    headline's B=1 T=8: it fits a core's HBM and compiles whole, VMEM in budget, under the
    issue's 90 s (libtpu compiles the layer loop once: its code does not grow with the
    layers; ~53 s on this CPU). With bf16 experts it is refused by HBM, with the numbers,
    before any compile."""
    k3 = mk.preset("kimi-k3")
    plan_ = plan.DecodePlan.make(k3, tp=32, batch=1, rows=8, context=4096, chip="tpu7x")
    report = tpu.compile_megakernel(plan_, topology="tpu7x:2x2x4")
    assert report.ok, report.error
    assert report.compile_seconds < 90
    assert report.argument_bytes <= report.hbm_bytes <= mk.chip("tpu7x").hbm_bytes
    assert 0 < report.vmem.total_bytes < report.vmem.limit_bytes
    names = {b.name for b in report.vmem.buffers}
    assert {"wq", "wkv_b", "latent_new", "queries", "k_tiles", "ring_fp4_3584x128",
            "ring_fp4_3584x128_scales", "ring_fp4_128x3584", "latent_part",
            "latent_gather.gathered", "latent_reduce.gathered"} <= names
    assert "v_tiles" not in names  # the latent rows are keys and values
    assert plan_.stream.schemes == ("fp4",)
    assert [s.name for s in plan_.stream.segments if s.stride] == ["we_gate", "we_up",
                                                                   "we_down"]
    assert (plan_.local.latent_columns, plan_.local.latent_shards) == (128, 32)
    bf16 = dataclasses.replace(k3, formats=(), expert_fp8_block=0)  # fp8 gate/up: fp4's
    whole = tpu.compile_megakernel(plan.DecodePlan.make(bf16, chip="tpu7x", tp=32, batch=1,
                                                        context=4096),
                                   topology="tpu7x:2x2x4")
    assert not whole.ok and re.search(r"need \d{3}\.\d\d GiB of HBM, over the 94\.75 GiB",
                                      whole.error)


def test_a_shard_too_big_for_hbm_is_reported_with_numbers():
    # qwen3-30b-a3b in bf16 on 4 v5e chips: its experts split 768/4 = 192 wide, padded to
    # 256, so each chip needs more than its 16 GiB.
    report = tpu.compile_megakernel(plan.DecodePlan.make(mk.preset("qwen3-30b-a3b"),
                                                         chip="v5e", tp=4, batch=8,
                                                         context=4096),
                                    topology="v5e:2x2")
    assert not report.ok
    assert re.search(r"need [\d.]+ GiB of HBM, over the 15\.75 GiB the compiler gives one "
                     r"v5e core", report.error)
    assert report.hbm_bytes > mk.chip("v5e").hbm_bytes
