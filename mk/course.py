"""What the course notebooks share: the hard-path defaults, the break-it exercises (the
mistakes a student plants) and the checks that catch them.

Defaults that exercise the hard paths (STYLE.md): `hard_positions` (non-zero first rows,
sequence 0 at the last row of a tile so that T >= 2 new rows straddle a tile edge; used by
notebooks 02, 03, 05) and `moe_inputs` (the MoE weights of layer 0 and activations drawn
with a router seed, so 04 can pick one whose experts are not the prefix 0..count-1).

Exercises: `planted(name)` swaps ONE line of the real kernel code for a wrong one for the
duration of a `with` block (restored on exit), so the notebook runs the real kernel with
the student's mistake in it:
- "ring_race" (01): `Ring.slot` returns the slot of tile g + 1, whose DMA is in flight.
- "rope_off" (02): `rope_rows` returns its input (RoPE is the identity at position 0 only).
- "wrong_expert" (04): expert slot s streams expert s instead of `ids_smem[s]` (the same
  as the right one when the picked experts are 0..count-1).
- "dropped_all_reduce" (10): the in-kernel all-reduce returns the device's own partial sum.
- "conv_unshifted" (05b): the gated DeltaNet writes, as the conv state after row t, the
  window before that row (the layer's output is still right; the state a verifier
  restarts from is not).
- "head_decay" (05c): Kimi Delta Attention decays every key channel of a head by the head's
  first channel's decay (the gated DeltaNet's one decay per head) instead of its own.
A too-shallow ring (11) needs no patch: it is a `slots` parameter, and
`check_ring_depth` catches it in the simulated step against a ring of Little's law depth.

Checks raise `ExerciseFailed` (an AssertionError, so a notebook's last cell fails
papermill) with a message naming what is wrong. Not here: the kernels themselves
(`mk.kernels`), the simulator (`mk.sim`), drawing (`mk.plots`).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from mk import megakernel, reference
from mk.checkpoint import init_params
from mk.config import ModelConfig
from mk.kernels import attention_prologue, collectives, deltanet, mlp, one_layer, ring

PLANTS = ("ring_race", "rope_off", "wrong_expert", "dropped_all_reduce",
          "conv_unshifted", "head_decay")


class ExerciseFailed(AssertionError):
    """A course check caught a mistake (planted or real)."""


# -- Defaults that exercise the hard paths ----------------------------------------------------
def hard_positions(batch: int, rows: int, context: int, tile: int = 128) -> np.ndarray:
    """[B] int32 first positions: sequence b at the last row of tile b (capped so its T rows
    fit in `context`), so every position is non-zero and, with T >= 2, rows p .. p+T-1
    straddle a tile edge."""
    if not 1 <= rows < context:
        raise ValueError(f"rows={rows} must be in [1, context={context})")
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    return np.asarray([min((b + 1) * tile - 1, context - rows) for b in range(batch)],
                      np.int32)


def straddles(positions, rows: int, tile: int = 128) -> list[bool]:
    """Whether each sequence's new rows p .. p + T - 1 cross a tile edge."""
    return [int(p) // tile != (int(p) + rows - 1) // tile for p in np.asarray(positions)]


def moe_inputs(config: ModelConfig, seed: int, router_seed: int, rows: int):
    """Layer 0's MoE weights (router, we_gate, we_up, we_down) of `init_params(config,
    seed)`, activations h [rows, D] drawn with `router_seed`, and the distinct experts the
    reference router picks for them (sorted)."""
    params = init_params(config, seed)
    weights = [params[n][0] for n in ("router", "we_gate", "we_up", "we_down")]
    h = jax.random.normal(jax.random.key(router_seed), (rows, config.hidden))
    _, experts = reference.route(h, weights[0], config.experts_per_token, config.norm_topk)
    return weights, h, sorted(set(np.asarray(experts).ravel().tolist()))


def is_prefix(experts) -> bool:
    """Whether the experts are 0 .. count - 1, where loading slot s instead of ids[s] is
    harmless."""
    return list(experts) == list(range(len(experts)))


# -- Planted mistakes -------------------------------------------------------------------------
def _slot_of_next_tile(ring, g):
    return ring.slots_vmem.at[(g + 1) % ring.n]  # the mistake: g + 1, not g


def _rope_off(x, pos, theta, dims=None):
    return x  # the mistake: no rotation


class _SlotIsId:
    """Stands in for ids_smem: reading slot s gives s (the mistake: the slot, not its id)."""

    def __getitem__(self, s):
        return s


def _partial_sum_only(x, s, **_):
    return x  # the mistake: no exchange, each device keeps its own partial sum


def _conv_state_before_row(window_vmem, b, t, taps):
    return window_vmem[b, t:t + taps - 1]  # the mistake: rows t.., not t + 1..


def _one_decay_per_head(row):
    return jnp.zeros((row.shape[1], 1), row.dtype) + row[:, :1]  # the mistake: channel 0's


@contextlib.contextmanager
def planted(name: str | None):
    """Run the block with the mistake `name` (one of PLANTS) in the kernel code; None or
    "" plants nothing. Build and call the kernels inside the block."""
    if not name:
        yield
        return
    if name not in PLANTS:
        raise ValueError(f"planted name={name!r} must be one of {PLANTS}")
    with contextlib.ExitStack() as stack:
        if name == "ring_race":
            stack.enter_context(mock.patch.object(ring.Ring, "slot", _slot_of_next_tile))
        elif name == "rope_off":
            stack.enter_context(mock.patch.object(attention_prologue, "rope_rows", _rope_off))
        elif name == "wrong_expert":
            real = mlp.moe_fetch

            def wrong(gate, up, down, row, ids_smem, count_smem):
                return real(gate, up, down, row, _SlotIsId(), count_smem)

            for module in (mlp, one_layer):
                if hasattr(module, "moe_fetch"):
                    stack.enter_context(mock.patch.object(module, "moe_fetch", wrong))
        elif name == "conv_unshifted":
            stack.enter_context(mock.patch.object(deltanet, "conv_state_after",
                                                  _conv_state_before_row))
        elif name == "head_decay":
            stack.enter_context(mock.patch.object(deltanet, "channel_column",
                                                  _one_decay_per_head))
        else:
            for module in (collectives, megakernel):
                if hasattr(module, "all_reduce_body"):
                    stack.enter_context(mock.patch.object(module, "all_reduce_body",
                                                          _partial_sum_only))
        yield


# -- Checks -----------------------------------------------------------------------------------
def check_race_free(what: str, races: bool) -> None:
    if races:
        raise ExerciseFailed(f"{what}: the race detector flagged a race (a slot read while "
                             "a DMA into it was in flight)")


def check_close(what: str, got, want, *, atol: float, rtol: float = 1e-5) -> float:
    """The largest |got - want|; raises when any element is outside atol + rtol * |want|."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    error = np.abs(got - want)
    if got.shape != want.shape or not np.all(error <= atol + rtol * np.abs(want)):
        raise ExerciseFailed(f"{what}: kernel and reference differ (max |kernel - reference| "
                             f"= {float(np.nanmax(error)) if error.size else 'n/a'}, "
                             f"atol={atol}, rtol={rtol}, shapes {got.shape} {want.shape})")
    return float(error.max()) if error.size else 0.0


def check_tokens(what: str, got, want) -> None:
    """Greedy tokens equal, exactly; names the first sequence and step that differ."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise ExerciseFailed(f"{what}: tokens of shape {got.shape}, reference {want.shape}")
    bad = np.argwhere(got != want)
    if bad.size:
        b, t = bad[0][:2] if bad.shape[1] > 1 else (0, bad[0][0])
        raise ExerciseFailed(f"{what}: tokens differ from the reference first at sequence "
                             f"{b}, step {t}")


def check_ring_depth(sim, deep, *, tolerance: float = 0.05) -> float:
    """`sim` and `deep` are simulated steps (`mk.sim.Simulation`) of one configuration,
    `deep` with a ring as deep as Little's law asks (`mk.sim.latency_slots`). Returns
    sim's step / deep's; raises when `sim` is more than `tolerance` slower: its ring holds
    too few bytes in flight to cover the DMA latency, and HBM idles ("ring empty")."""
    ratio = sim.step_s / deep.step_s
    if ratio > 1 + tolerance:
        empty = sim.bubble_share().get("ring empty", 0.0) / sim.step_s
        raise ExerciseFailed(
            f"ring too shallow: {sim.block.slots} slots make the simulated step {ratio:.2f}x "
            f"the one with {deep.block.slots} slots (Little's law depth); HBM idles "
            f"{empty:.0%} of it waiting for tiles (ring empty)")
    return ratio
