"""The gated delta rule with its state in HBM: the recurrence of a gated-DeltaNet (or KDA)
layer's decode step, for B sequences x T rows (`mk.model.linear_attention.delta_rule` is the
oracle).

Per sequence and value head the state S [Hk, Hv] float32 is decayed, corrected and read
by each row t:

    S <- decay_t S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   out_t = q_t^T S

The state [B, Nv, Hk, Hv] stays in HBM and streams through two VMEM slots each way
(`StateCopies`, across the linear layers of a kernel): B * Nv * Hk * Hv * 4 bytes in and
T times that out per step, whatever the context length.

Here: `delta_rule_head` (one value head's T rows), `StateCopies` and `RowStore`,
`delta_rule_body` (the in-kernel body `mk.kinds.linear.deltanet.linear_mixer` runs) and
`delta_rule_step`, the rule alone as one kernel. Not here: the projections, the conv, the
gates and the gated norm around it (`mk.kinds.linear.deltanet`). The copies' timing and the
row layout: docs/design/mk.kinds.linear.delta_rule.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import LANES, MAX_ROWS
from mk.kernels.common import start_dma
from mk.model.ops import exact

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
        remembered = jnp.dot(k_t, s, precision=exact(k_t, s), preferred_element_type=F32)
        delta = jnp.where(at_t, (v - remembered) * beta(t), 0.0)
        s = s + lax.dot_general(k_t, delta, TN, precision=exact(k_t, delta),
                                preferred_element_type=F32)
        rows_out(t, s)
        out = out + jnp.where(at_t, jnp.dot(q, s, precision=exact(q, s),
                                            preferred_element_type=F32), 0.0)
    return out


class StateCopies:
    """The recurrent states' HBM <-> VMEM copies of every linear layer a kernel runs, as one
    stream of items n = row * B + b (sequence b of linear row `row`): item n's state comes
    into slot n % 2 while item n - 1 computes (across the layer edge too), and its T row
    states leave from slot n % 2, waited for only when item n + 2 needs the slot or at the
    kernel's end (`drain`). state_hbm [Ll, B, Nv, Hk, Hv], rows_hbm [Ll, B, T, Nv, Hk, Hv]."""

    def __init__(self, state_hbm, rows_hbm, state_vmem, rows_vmem, load_sems, store_sems):
        self.state_hbm, self.rows_hbm = state_hbm, rows_hbm
        self.state_vmem, self.rows_vmem = state_vmem, rows_vmem
        self.load_sems, self.store_sems = load_sems, store_sems
        self.batch = state_hbm.shape[1]
        self.items = state_hbm.shape[0] * self.batch

    def load(self, n):
        row, b, slot = n // self.batch, n % self.batch, n % 2
        return pltpu.make_async_copy(self.state_hbm.at[row, b], self.state_vmem.at[slot],
                                     self.load_sems.at[slot])

    def store(self, n):
        row, b, slot = n // self.batch, n % self.batch, n % 2
        return pltpu.make_async_copy(self.rows_vmem.at[slot], self.rows_hbm.at[row, b],
                                     self.store_sems.at[slot])

    def start_load(self, n):
        start_dma(self.load(n), "state_load", math.prod(self.state_vmem.shape[1:]) * 4)

    def start_store(self, n):
        start_dma(self.store(n), "state_rows", math.prod(self.rows_vmem.shape[1:]) * 4)

    def drain(self):
        """At the kernel's end: wait for the last two items' row states."""
        for n in range(max(self.items - 2, 0), self.items):
            self.store(n).wait()


def delta_rule_body(q_vmem, k_vmem, v_vmem, scalars, out_vmem, copies: StateCopies, *,
                    rows: int, row=0):
    """The delta rule of linear row `row`'s B sequences inside a kernel: q, k [B, Nv, R, Hk],
    v and out [B, Nv, R, Hv] f32 VMEM refs; scalars(b, h) -> (decay(t), beta(t)). Expects
    item row * B's state load started (`prime_linear`, or the row before's last sequence);
    starts the next item's load, even the next row's; leaves the row states in flight
    (`StateCopies`)."""
    B, Nv = q_vmem.shape[:2]

    def sequence(b, carry):
        n = row * B + b
        slot = n % 2
        copies.load(n).wait()

        @pl.when(n + 1 < copies.items)
        def prefetch_next_state():
            copies.start_load(n + 1)

        @pl.when(n >= 2)
        def free_row_slot():  # the write-back of item n - 2 used this slot
            copies.store(n - 2).wait()

        def head(h, carry):
            out_vmem[b, h] = delta_rule_head(
                q_vmem[b, h], k_vmem[b, h], v_vmem[b, h], copies.state_vmem[slot, h],
                *scalars(b, h), RowStore(copies.rows_vmem, slot, h, rows))
            return carry

        lax.fori_loop(0, Nv, head, 0)
        copies.start_store(n)
        return carry

    lax.fori_loop(0, B, sequence, 0)


def delta_rule_kernel(
    # Inputs
    q_vmem,  # [B, Nv, R, Hk] f32, rows >= T zero
    k_vmem,  # [B, Nv, R, Hk] f32
    v_vmem,  # [B, Nv, R, Hv] f32
    decay_smem,  # [B * Nv * T] f32, exp(g)
    beta_smem,  # [B * Nv * T] f32
    state_hbm,  # [1, B, Nv, Hk, Hv] f32, left in HBM
    # Outputs
    out_vmem,  # [B, Nv, R, Hv] f32
    rows_hbm,  # [1, B, T, Nv, Hk, Hv] f32: the state after each row
    # Scratch
    state_vmem,  # [2, Nv, Hk, Hv] f32
    rows_vmem,  # [2, T, Nv, Hk, Hv] f32
    load_sems,  # DMA [2]
    store_sems,  # DMA [2]
    *,
    rows: int,
):
    Nv = q_vmem.shape[1]
    copies = StateCopies(state_hbm, rows_hbm, state_vmem, rows_vmem, load_sems, store_sems)

    def scalars(b, h):
        first = (b * Nv + h) * rows
        return lambda t: decay_smem[first + t], lambda t: beta_smem[first + t]

    copies.start_load(0)
    delta_rule_body(q_vmem, k_vmem, v_vmem, scalars, out_vmem, copies, rows=rows)
    copies.drain()


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
                   jax.ShapeDtypeStruct((1, B, T, Nv, Hk, Hv), F32)),
        in_specs=[vmem, vmem, vmem, smem, smem, any_],
        out_specs=(vmem, any_),
        scratch_shapes=[pltpu.VMEM((2, Nv, Hk, Hv), F32), pltpu.VMEM((2, T, Nv, Hk, Hv), F32),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))],
        name="mk_delta_rule_step",
        cost_estimate=pl.CostEstimate(
            flops=B * T * Nv * 3 * 2 * R * Hk * Hv, transcendentals=0,
            bytes_accessed=(1 + T) * state_bytes + B * Nv * R * (2 * Hk + 2 * Hv) * 4),
    )(blocks(q), blocks(k), blocks(v), scalars(decay), scalars(beta),
      state.astype(F32)[None])
    return jnp.moveaxis(out[:, :, :T], 1, 2), rows[0]
