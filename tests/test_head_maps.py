"""Which key head each query (or value) head reads, in every kernel that maps heads, on
weights that tell the maps apart: G > 1 query heads per kv head, and per-head inputs that
differ, so a kernel reading key head n % K (interleaved) instead of n // G (blocked) gives
a different output.

- GQA attention (`decode_attention`): kv head c's values are all c + 1, so each query
  head's output is exactly the number of the kv head it read.
- gated DeltaNet (`gated_deltanet`): Nk = 2 key heads, Nv = 4 value heads (G = 2),
  against `mk.model.reference.linear_decoder_layer` (blocked, as transformers' `repeat_interleave`);
  its guard: swapping the two key heads' weights changes the reference's output.
- KDA (`gated_deltanet` on tiny-kimi): Nk = Nv by its config (G = 1, the map is the
  identity); its two heads, with their own per-channel decays, under the same guard
  (tests/kernels/test_deltanet.py also plants one decay per head).
- MLA: all N query heads read the one latent row (G = N = 2 in tiny-kimi); what maps per
  head is its slice of wkv_b (W_uk for the absorbed query, W_uv for the output), which
  tests/test_kimi.py plants swapped between heads (`swapped_heads`) in CI.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import mk
from mk.kernels import backend
from mk.model import ops, reference
from mk.kernels.common import BlockSizes
from mk.kinds.attention.decode_attention import decode_attention
from mk.kinds.linear.deltanet import gated_deltanet


def test_gqa_query_head_n_reads_kv_head_n_over_g():
    """kv head c's values are c + 1 plus a small random part: the output's mean over a
    head's lanes names the kv head it read (blocked n // G, not interleaved n % K), and
    the whole output equals the reference's (which query each block computed)."""
    B, T, N, K, H, S, tile = 2, 2, 4, 2, 128, 256, 128
    G = N // K
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (B * T, N * H))
    k_new = jax.random.normal(keys[1], (B * T, K * H))
    head = jnp.arange(K, dtype=jnp.float32) + 1  # kv head c holds values about c + 1
    v_new = (jnp.repeat(head, H)[None] + 0.1 * jax.random.normal(keys[2], (B * T, K * H)))
    k_cache = jax.random.normal(keys[3], (1, B, K, S, H)).astype(jnp.bfloat16)
    v_cache = (head[None, None, :, None, None]
               + 0.1 * jax.random.normal(keys[4], (1, B, K, S, H))).astype(jnp.bfloat16)
    positions = jnp.array([tile - 1, 5], jnp.int32)  # the first sequence straddles a tile
    with backend.use("interpret"):
        o, _, _ = decode_attention(q, k_new, v_new, k_cache, v_cache, positions,
                                   block=BlockSizes(kv_tile=tile, kv_slots=2))
    o = np.asarray(o).reshape(B * T, N, H)
    blocked = np.arange(N) // G + 1
    interleaved = np.arange(N) % K + 1
    assert (blocked != interleaved).any()  # the case tells the maps apart
    np.testing.assert_array_equal(np.rint(o.mean(-1)), np.broadcast_to(blocked, (B * T, N)))
    k, v = (ops.write_rows(c[0], n.reshape(B, T, K, H), positions)
            for c, n in ((k_cache, k_new), (v_cache, v_new)))
    want = ops.attention(q.reshape(B, T, N, H), k, v, positions)
    np.testing.assert_allclose(o, np.asarray(want).reshape(B * T, N, H), atol=2e-2, rtol=0)


def _two_key_heads():
    """tiny-hybrid's linear layers with Nk = 2 key heads and Nv = 4 value heads."""
    config = dataclasses.replace(mk.preset("tiny-hybrid"), name="tiny-hybrid-g2",
                                 linear_key_heads=2, linear_value_heads=4)
    return config, mk.init_params(config, seed=3)


def _swap_key_heads(config, params, layer):
    """params with key heads 0 and 1 swapped in the q and k channels of lin_qkv and
    the conv (`mk.model.linear_attention.conv_qkv`'s channel order: q | k | v, each by key head)."""
    Hk, Nk = config.linear_key_dim, config.linear_key_heads
    order = np.arange(config.conv_channels)
    for part in range(2):  # q, then k
        first = part * Nk * Hk
        order[first:first + Hk], order[first + Hk:first + 2 * Hk] = \
            np.arange(first + Hk, first + 2 * Hk), np.arange(first, first + Hk)
    out = dict(params)
    out["lin_qkv"] = params["lin_qkv"].at[layer].set(
        params["lin_qkv"][layer][:, order])
    out["lin_conv"] = params["lin_conv"].at[layer].set(params["lin_conv"][layer][:, order])
    return out


def _layer_and_guard(config, params, layer, seed):
    """The kernel's and the reference's x after the linear mixer of `layer` and its state
    rows, and the reference's x with the two key heads' weights swapped."""
    B, T = 2, 2
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (B, T, config.hidden))
    conv = jax.random.normal(keys[1], (B, config.conv_kernel - 1, config.conv_channels)
                             ).astype(config.dtype)
    state = 0.1 * jax.random.normal(keys[2], (B, config.linear_value_heads,
                                               config.linear_key_dim,
                                               config.linear_value_dim))
    with backend.use("interpret"):
        got = gated_deltanet(config, params, x, conv, state, layer=layer)
    *_, want_state, want_x = reference.linear_decoder_layer(config, params, layer, x, conv,
                                                            state)
    *_, swapped = reference.linear_decoder_layer(
        config, _swap_key_heads(config, params, layer), layer, x, conv, state)
    return x, (got[0], got[2]), (want_x, want_state), swapped


def _assert_heads_mapped(config, params, layer, seed):
    x, (got_x, got_state), (want_x, want_state), swapped = _layer_and_guard(
        config, params, layer, seed)
    scale = float(jnp.abs(want_x - x).max())  # the mixer's output
    np.testing.assert_allclose(got_x, want_x, atol=2e-2 * scale, rtol=0)
    np.testing.assert_allclose(got_state, want_state, atol=2e-2, rtol=2e-2)
    # the guard: the two key heads are not interchangeable in these weights
    assert float(jnp.abs(swapped - want_x).max()) > 0.2 * scale


def test_gated_deltanet_value_head_h_reads_key_head_h_over_g():
    config, params = _two_key_heads()
    assert config.linear_value_heads // config.linear_key_heads == 2
    _assert_heads_mapped(config, params, 0, seed=5)


def test_kda_head_h_reads_its_own_key_head_and_decays():
    """KDA (Nk = Nv, G = 1: the map is the identity) on tiny-kimi's two heads, whose
    per-channel decays differ; a head reading the other's keys or decays changes x."""
    config = mk.preset("tiny-kimi")
    assert config.channel_decay and config.linear_key_heads == 2
    _assert_heads_mapped(config, mk.init_params(config, seed=3), 0, seed=6)
