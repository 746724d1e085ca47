"""mk.model.cache: each model's cache type comes from its mixer kinds, every field is checked
against its row of the table (naming the field, its value and the limit), and the state
fields are what a step returns per row and a verifier rolls back. No decoding here: the
caches in use are tested through the reference (test_reference, test_hybrid, test_kimi),
their sharding in test_tensor_parallel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.model import cache as C
from mk.step import shards


def _kimi_full_only():
    """Kimi Linear cut to one MLA layer: no linear layer, no MoE."""
    kimi = mk.preset("tiny-kimi")
    return dataclasses.replace(
        kimi, name="kimi-full", layers=1, layer_types=("full",), moe_layers=(), experts=0,
        experts_per_token=0, expert_ffn=0, shared_expert_ffn=0, router_score="softmax",
        expert_groups=1, topk_groups=1, routed_scale=1.0, norm_topk=False,
        linear_key_heads=0, linear_value_heads=0, linear_key_dim=0, linear_value_dim=0,
        conv_kernel=0, channel_decay=False)


@pytest.mark.parametrize("config, kind, states", [
    (mk.preset("tiny"), C.KVCache, False),
    (mk.preset("tiny-moe"), C.KVCache, False),
    (mk.preset("tiny-hybrid"), C.HybridCache, True),
    (mk.preset("tiny-hybrid").first_layers(2), C.HybridCache, True),  # all linear: L=0 KV
    (mk.preset("tiny-kimi"), C.LatentCache, True),
    (_kimi_full_only(), C.LatentCache, False),  # MLA only: zero-layer linear states
], ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))))
def test_the_cache_type_is_the_first_serving_the_models_mixers(config, kind, states):
    cache = C.init_cache(config, 3, 16, spare=2)
    assert type(cache) is kind and C.mixers_of(config) <= kind.serves
    assert (cache.batch, cache.capacity, C.has_states(cache)) == (3, 18, states)
    C.check_cache(config, cache)
    for name, a in cache._asdict().items():
        field = C.FIELDS[name]
        assert a.shape == field.shape(config, 3, 18) and a.dtype == field.dtype_of(config)
        assert a.shape[0] == len(getattr(config, field.layers))


def test_a_mixer_no_cache_type_serves_is_not_implemented():
    gqa_kda = dataclasses.replace(mk.preset("tiny-kimi"), latent_rank=0, q_rank=0,
                                  rope_dim=0, value_dim=0, kv_heads=2, name="gqa-kda")
    with pytest.raises(NotImplementedError, match=r"\['gqa', 'kda'\]"):
        C.init_cache(gqa_kda, 1, 8)


@pytest.mark.parametrize("preset, field, bad, message", [
    ("tiny-hybrid", "state", lambda a: a.astype(jnp.bfloat16),
     r"cache dtype state=bfloat16 must be float32"),
    ("tiny-hybrid", "conv", lambda a: a[..., :-1],
     r"cache conv \[L, B, W-1, C\]=\(3, 2, 3, 511\) does not fit tiny-hybrid \(L=3 "
     r"linear_layers, W-1=3, C=512, B >= 1, S >= 1\)"),
    ("tiny-hybrid", "state", lambda a: a[:, :1],
     r"cache state has B=1; cache k has B=2: every field must hold the same B"),
    ("tiny", "v", lambda a: a[:, :, :, :8],
     r"cache v has S=8; cache k has S=16: every field must hold the same S"),
    ("tiny-kimi", "latent", lambda a: a.astype(jnp.float32),
     r"cache dtype latent=float32 must be tiny-kimi's dtype=bfloat16"),
])
def test_every_field_is_checked_naming_the_field_value_and_limit(preset, field, bad,
                                                                 message):
    config = mk.preset(preset)
    cache = C.init_cache(config, 2, 16)
    planted = cache._replace(**{field: bad(getattr(cache, field))})
    with pytest.raises(ValueError, match=message):
        C.check_cache(config, planted)


def test_rollback_picks_each_sequences_states_after_its_accepted_rows():
    config = mk.preset("tiny-hybrid")
    cache = C.init_cache(config, 2, 16)
    rows = C.LinearRows(*(jnp.stack([jnp.full(a.shape, t, a.dtype) for t in range(3)], 2)
                          for a in (cache.conv, cache.state)))  # row t holds t
    rolled = C.rollback(cache, rows, [2, 3])
    for name in C.state_fields(cache):
        got = np.asarray(getattr(rolled, name), np.float32)
        assert (got[:, 0] == 1).all() and (got[:, 1] == 2).all(), name
    assert rolled.k is cache.k  # a field with S needs no rollback
    with pytest.raises(ValueError, match=r"accepted=\[0, 3\] must be \[B=2\] counts in "
                                         r"\[1, T=3\]"):
        C.rollback(cache, rows, [0, 3])


def test_sharded_fields_follow_their_split_rule():
    """tp=2 on the Kimi preset: the latent whole on both devices, conv by q|k|v heads, the
    state by value heads; a cache sharded for tp=2 is refused at tp=1 naming its field."""
    config = mk.preset("tiny-kimi")
    cache = C.init_cache(config, 1, 8)
    rng = np.random.default_rng(0)
    cache = cache._replace(**{n: jnp.asarray(rng.standard_normal(a.shape), a.dtype)
                              for n, a in cache._asdict().items()})
    sharded = shards.shard_cache(config, cache, 2)
    shards.check_sharded_cache(config, sharded, 2)
    np.testing.assert_array_equal(sharded.latent[1], cache.latent)
    half = config.linear_value_heads // 2
    np.testing.assert_array_equal(sharded.state[1], cache.state[:, :, half:])
    assert sharded.conv.shape[-1] == config.conv_channels // 2
    with pytest.raises(ValueError, match=r"\(latent: \[tp, L, B, S, R \+ Hr\]\)"):
        shards.check_sharded_cache(config, cache, 1)


def test_an_mla_only_models_empty_linear_fields_shard_to_tp_devices():
    """No linear layer: conv and state hold zero layers, and each still shards [tp, 0,
    ...] (the state's split by value heads once took an empty index and lost its tp axis,
    an IndexError in `mk.step.tensor_parallel`'s per-device unstacking)."""
    config = _kimi_full_only()
    cache = C.init_cache(config, 2, 8)
    sharded = shards.shard_cache(config, cache, 2)
    shards.check_sharded_cache(config, sharded, 2)
    assert sharded.latent.shape == (2, *cache.latent.shape)
    assert sharded.conv.shape == (2, *cache.conv.shape)  # [tp, 0, B, W-1 = 0, C/tp = 0]
    assert sharded.state.shape == (2, *cache.state.shape)  # [tp, 0, B, Nv/tp = 0, Hk, Hv]
