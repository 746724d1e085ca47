"""Stage 05b (first piece), the gated delta rule: B sequences x T rows against a recurrent
state that lives in HBM.

A gated-DeltaNet layer keeps, per sequence and value head, a float32 state S [Hk, Hv]
instead of KV rows. Each decode row t decays it, writes the row's correction into it and
reads it (`mk.linear_attention.delta_rule`, the oracle):

    S <- decay_t S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   out_t = q_t^T S

The state [B, Nv, Hk, Hv] stays in HBM (`memory_space=pl.ANY`). Sequence b's state comes
into VMEM by an async copy issued while sequence b-1 computes (two slots), and the T
states after each of b's rows leave by one async copy that overlaps sequence b+1 (two
slots): a verifier that accepts k of the T rows restarts from row k-1's state. Bytes per
step: B * Nv * Hk * Hv * 4 in and T times that out, whatever the context length.

Rows of a sequence sit in one 8-row-aligned block [R, H] (R = T rounded up to 8); row t is
picked by a row mask, so every product is an [R, .] matmul (rows other than t are zero)
and no dynamic sublane slicing is needed. decay (= exp(g)) and beta are per-row scalars in
SMEM.

Here: `delta_rule_step` and its body. Not here (the rest of the layer's stage kernel,
still to do): the projections through the weight ring, the conv-state shift, the L2 norms,
the gated RMSNorm and out_proj; those run in `mk.reference.linear_attention` today.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.config import MAX_ROWS
from mk.kernels.common import LANES

ALIGN = 8  # rows of an f32 (8, 128) tile
F32 = jnp.float32
TN = (((0,), (0,)), ((), ()))  # dot_general dims of a.T @ b


class RowStore:
    """rows_vmem[slot, t, h] <- the state after row t (what a verifier's rollback needs)."""

    def __init__(self, rows_vmem, slot, h, rows: int):
        self.rows_vmem, self.slot, self.h, self.rows = rows_vmem, slot, h, range(rows)

    def __call__(self, t, s):
        self.rows_vmem[self.slot, t, self.h] = s


def delta_rule_head(q, k, v, s, decay, beta, rows_out):
    """T rows of one value head, in VMEM: q, k [R, Hk], v [R, Hv] values; s [Hk, Hv] the
    state before row 0; decay(t), beta(t) the row's scalars; rows_out(t, s) stores the
    state after row t. Returns out [R, Hv] float32 (rows >= T zero)."""
    row_id = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0)
    out = jnp.zeros(v.shape, F32)
    for t in range(len(rows_out.rows)):
        at_t = row_id == t
        k_t = jnp.where(at_t, k, 0.0)
        s = s * decay(t)
        remembered = jnp.dot(k_t, s, preferred_element_type=F32)
        delta = jnp.where(at_t, (v - remembered) * beta(t), 0.0)
        s = s + lax.dot_general(k_t, delta, TN, preferred_element_type=F32)
        rows_out(t, s)
        out = out + jnp.where(at_t, jnp.dot(q, s, preferred_element_type=F32), 0.0)
    return out


def delta_rule_kernel(
    # Inputs
    q_vmem,  # [B, Nv, R, Hk] f32, rows >= T zero
    k_vmem,  # [B, Nv, R, Hk] f32
    v_vmem,  # [B, Nv, R, Hv] f32
    decay_smem,  # [B * Nv * T] f32, exp(g)
    beta_smem,  # [B * Nv * T] f32
    state_hbm,  # [B, Nv, Hk, Hv] f32, left in HBM
    # Outputs
    out_vmem,  # [B, Nv, R, Hv] f32
    rows_hbm,  # [B, T, Nv, Hk, Hv] f32: the state after each row
    # Scratch
    state_vmem,  # [2, Nv, Hk, Hv] f32
    rows_vmem,  # [2, T, Nv, Hk, Hv] f32
    load_sems,  # DMA [2]
    store_sems,  # DMA [2]
    *,
    rows: int,
):
    B, Nv, R, _ = q_vmem.shape
    T = rows

    def load(b, slot):
        return pltpu.make_async_copy(state_hbm.at[b], state_vmem.at[slot], load_sems.at[slot])

    def store(b, slot):
        return pltpu.make_async_copy(rows_vmem.at[slot], rows_hbm.at[b], store_sems.at[slot])

    load(0, 0).start()

    def sequence(b, carry):
        slot = b % 2
        load(b, slot).wait()

        @pl.when(b + 1 < B)
        def prefetch_next_state():
            load(b + 1, 1 - slot).start()

        @pl.when(b >= 2)
        def free_row_slot():  # the write-back of sequence b-2 used this slot
            store(b - 2, slot).wait()

        def head(h, carry):
            first = (b * Nv + h) * T
            out_vmem[b, h] = delta_rule_head(
                q_vmem[b, h], k_vmem[b, h], v_vmem[b, h], state_vmem[slot, h],
                lambda t: decay_smem[first + t], lambda t: beta_smem[first + t],
                RowStore(rows_vmem, slot, h, T))
            return carry

        lax.fori_loop(0, Nv, head, 0)
        store(b, slot).start()
        return carry

    lax.fori_loop(0, B, sequence, 0)
    for b in range(max(B - 2, 0), B):  # drain the last write-backs
        store(b, b % 2).wait()


def delta_rule_step(q, k, v, decay, beta, state, *, kernel=None):
    """The gated delta rule over T rows of B sequences, state in HBM.

    q, k [B, T, Nv, Hk] (normalised, q scaled, one per value head); v [B, T, Nv, Hv];
    decay (= exp(g)), beta [B, T, Nv]; state [B, Nv, Hk, Hv] float32. Returns
    (out [B, T, Nv, Hv] float32, rows [B, T, Nv, Hk, Hv] float32: the state after each row).
    `kernel` replaces `delta_rule_kernel` (same arguments): tests plant bugs through it.
    """
    B, T, Nv, Hk = q.shape
    Hv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, T, Nv) or decay.shape != (B, T, Nv) \
            or beta.shape != (B, T, Nv) or state.shape != (B, Nv, Hk, Hv):
        raise ValueError(f"shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}, decay "
                         f"{decay.shape}, beta {beta.shape}, state {state.shape}")
    if Hk % LANES or Hv % LANES:
        raise ValueError(f"head dims Hk={Hk}, Hv={Hv} must be multiples of {LANES} on TPU")
    if not 1 <= B * T <= MAX_ROWS:
        raise ValueError(f"rows M=B*T={B * T} must be in [1, {MAX_ROWS}]")
    R = -(-T // ALIGN) * ALIGN

    def blocks(x):  # [B, T, Nv, H] -> [B, Nv, R, H] f32, rows >= T zero
        x = jnp.moveaxis(x.astype(F32), 2, 1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, R - T), (0, 0)))

    def scalars(x):  # [B, T, Nv] -> [B * Nv * T], index (b * Nv + h) * T + t
        return jnp.moveaxis(x.astype(F32), 1, 2).reshape(-1)

    vmem, smem = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    state_bytes = B * Nv * Hk * Hv * 4
    out, rows = pl.pallas_call(
        functools.partial(kernel or delta_rule_kernel, rows=T),
        out_shape=(jax.ShapeDtypeStruct((B, Nv, R, Hv), F32),
                   jax.ShapeDtypeStruct((B, T, Nv, Hk, Hv), F32)),
        in_specs=[vmem, vmem, vmem, smem, smem, any_],
        out_specs=(vmem, any_),
        scratch_shapes=[pltpu.VMEM((2, Nv, Hk, Hv), F32), pltpu.VMEM((2, T, Nv, Hk, Hv), F32),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))],
        name="mk_delta_rule_step",
        cost_estimate=pl.CostEstimate(
            flops=B * T * Nv * 3 * 2 * R * Hk * Hv, transcendentals=0,
            bytes_accessed=(1 + T) * state_bytes + B * Nv * R * (2 * Hk + 2 * Hv) * 4),
    )(blocks(q), blocks(k), blocks(v), scalars(decay), scalars(beta), state.astype(F32))
    return jnp.moveaxis(out[:, :, :T], 1, 2), rows
