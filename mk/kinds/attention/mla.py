"""Multi-head latent attention (Kimi Linear's full layers, and Kimi K3's, whose output gate
is `mk.kinds.attention.kinds.GatedMLA`'s) inside a kernel: the absorbed prologue and epilogue
around `attend` over the latent cache.

Each head's query is absorbed into the latent space, `attend` reads the latent cache once
as keys and values (W values per cached token, not 2 x N x H), and each head's output is
multiplied by its value up-projection (`mk.model.reference.mla_absorbed` and `mla_output` are
the oracle). The ring streams the matrices with D rows or columns (wq_a or wq, wkv_a
padded to whole tiles, wo); the narrow ones are DMA'd whole at the layer's start.

Here: `mla_weights` (its rows of `mk.model.weights`), `low_rank_q`, `mla_matrices`,
`latent_columns`, `mla_buffers` (VMEM, group "layer"), `start_mla_loads`,
`mla_prologue`, `mla_epilogue`. Not here: `attend` (`mk.kinds.attention.decode_attention`), the
layer around them (`mk.step.one_layer.layer_body`), the stage kernels (MLA runs in the
megakernel only; `latent_attention` is attention's stage wrapper). The absorbed layer
formula by formula, and why the narrow weights are DMA'd:
docs/design/mk.kinds.attention.mla.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import LANES, ModelConfig
from mk.kernels.common import Buffer, start_dma
from mk.model.ops import exact, rms_norm
from mk.model.weights import names_of, param_shapes

F32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # dot_general dims of a @ b.T


def latent_columns(config: ModelConfig) -> int:
    """wkv_a's W = R + Hr columns rounded up to whole 128-lane tiles (as the ring holds it)."""
    return -(-config.latent_width // LANES) * LANES


def mla_weights(config: ModelConfig, *paths: str, kind: str = "mla") -> tuple[str, ...]:
    """An MLA layer's weights moved by one of `paths` (all without), in table order
    (`mk.model.weights.names_of`; `kind`: the layer's kind, MLA or a variant of it): with a q
    low rank, wq_a streams and wq is DMA'd."""
    return names_of(config, kind, *paths)


def low_rank_q(config: ModelConfig) -> bool:
    """Whether the queries come through a low rank: q = RMSNorm(h @ wq_a) @ wq (every
    MLA kind has wq_a and q_a_norm where q_rank > 0: their rows in `mk.model.weights`)."""
    return config.q_rank > 0


def mla_matrices(config: ModelConfig, kind: str = "mla") -> list[tuple[str, int, int]]:
    """The ring segments of an MLA layer of `kind` in consumption order (its ring weights
    in table order: wq_a or wq, wkv_a, a gated one's wg, wo): (name, rows, cols), wkv_a's
    `latent_columns`."""
    shapes = param_shapes(config)
    return [(n, shapes[n][0][1], latent_columns(config) if n == "wkv_a" else shapes[n][0][2])
            for n in mla_weights(config, "ring", kind=kind)]


def mla_buffers(config: ModelConfig, M: int) -> list[Buffer]:
    """An MLA layer's VMEM (group "layer": attributes of the layer scratch): q, the low-rank
    q (with q_rank), kv (wkv_a's padded product), the new latent rows, the absorbed
    queries, attention's output, the heads' outputs o, (its DMA'd weights' buffers are the kind's:
    `mk.kinds.base.Kind.dma_buffers`)."""
    N, H, W, f32 = config.heads, config.head_dim, config.latent_width, "float32"
    buffers = [Buffer("q", (M, N * H), f32), Buffer("kv_a", (M, latent_columns(config)), f32),
               Buffer("latent_new", (M, W), f32), Buffer("queries", (M, N * W), f32),
               Buffer("o_latent", (M, N * W), f32),
               Buffer("o", (M, N * config.value_dim), f32)]
    if low_rank_q(config):
        buffers.append(Buffer("q_a", (M, config.q_rank), f32))
    return buffers


def start_mla_loads(s, hbm: dict, row) -> dict:
    """Issue MLA layer `row`'s DMA'd weights (`hbm`: their HBM refs by name, in table
    order, `mla_weights(config, "dma")`) into the layer scratch `s` (semaphores
    s.mla_sems); returns their copies by name, to wait for at first use."""
    copies = {}
    for i, name in enumerate(hbm):
        into = getattr(s, name)
        copies[name] = pltpu.make_async_copy(hbm[name].at[row], into, s.mla_sems.at[i])
        start_dma(copies[name], name, into.size * into.dtype.itemsize)
    return copies


def mla_prologue(ring, config: ModelConfig, s, loads: dict, *, layer, x, attn_norm):
    """The absorbed queries s.queries [M, N*W] and the new latent rows s.latent_new [M, W]
    of x [M, D] f32 (module docstring); layer: its index in the ring's stream; loads: the
    layer's `start_mla_loads` copies (each waited for here)."""
    N, H, R, W = config.heads, config.head_dim, config.latent_rank, config.latent_width
    Hn, Ho, eps = H - config.rope_dim, config.value_dim, config.rms_eps
    s.h[...] = rms_norm(x, attn_norm, eps, width=config.norm_width).astype(s.h.dtype)
    if low_rank_q(config):
        ring.matmul("wq_a", s.h, s.q_a, layer=layer)
        loads["q_a_norm"].wait()
        q_a = rms_norm(s.q_a[...], s.q_a_norm[...], eps).astype(s.wq.dtype)
        loads["wq"].wait()
        wq = s.wq[...]
        s.q[...] = jnp.dot(q_a, wq, precision=exact(q_a, wq), preferred_element_type=F32)
    else:
        ring.matmul("wq", s.h, s.q, layer=layer)
    ring.matmul("wkv_a", s.h, s.kv_a, layer=layer)
    loads["kv_a_norm"].wait()
    s.latent_new[:, :R] = rms_norm(s.kv_a[:, :R], s.kv_a_norm[...], eps)
    s.latent_new[:, R:] = s.kv_a[:, R:W]
    loads["wkv_b"].wait()
    for n in range(N):  # head n's query, absorbed: [q_nope_n @ W_uk_n^T, q_rope_n]
        w_uk = s.wkv_b[:, n * (Hn + Ho):n * (Hn + Ho) + Hn].astype(F32)  # [R, Hn]
        s.queries[:, n * W:n * W + R] = lax.dot_general(
            s.q[:, n * H:n * H + Hn], w_uk, NT, precision=lax.Precision.HIGHEST,
            preferred_element_type=F32)
        s.queries[:, n * W + R:(n + 1) * W] = s.q[:, n * H + Hn:(n + 1) * H]


def mla_epilogue(config: ModelConfig, s):
    """s.o [M, N*Ho] f32: each head's P @ latent rows (s.o_latent, its first R lanes) times
    its value up-projection W_uv_n."""
    N, R, W = config.heads, config.latent_rank, config.latent_width
    Hn, Ho = config.head_dim - config.rope_dim, config.value_dim
    for n in range(N):
        w_uv = s.wkv_b[:, n * (Hn + Ho) + Hn:(n + 1) * (Hn + Ho)].astype(F32)  # [R, Ho]
        s.o[:, n * Ho:(n + 1) * Ho] = jnp.dot(s.o_latent[:, n * W:n * W + R], w_uv,
                                              precision=lax.Precision.HIGHEST,
                                              preferred_element_type=F32)
