"""The megakernel issues its DMAs in the order the simulator replays them, one by one.

One decode step of each family's tiny preset (tiny: Qwen3 dense; tiny-moe: Qwen3 MoE with
a dense layer 0; tiny-hybrid: Qwen3.5's gated DeltaNet beside gated full attention;
tiny-kimi: MLA, KDA, a shared expert and the sigmoid router; tiny-gpt-oss: attention with
sinks, biases and sliding layers, biased clamped experts; and Kimi K3's kinds the kernel
runs, each on a family of its own: tiny-situ, tiny-gated-mla, tiny-bounded-kda,
tiny-latent-moe, tiny-res-layer, tests/builders.py) runs in
TPU interpret mode
with every DMA the kernel starts recorded in issue order (`mk.kernels.common.dma_log`;
the megakernel is `sequenced`: its records are chained through an SMEM counter, since
interpret mode runs a kernel's host callbacks in no fixed order). The simulator replays
the same plan tile by tile (its fast-forward off) with every transfer recorded
(`mk.cost.machine.Machine.issued`). The two lists of (what, bytes) must be equal element by
element: the same DMA names (so the same byte families, `mk.step.step_bytes.family_of`),
the same bytes, in the same sequence. Only two things are normalised:
- the simulator's "selected" (the routing flags' VMEM -> SMEM copy) is dropped: it is
  not HBM traffic, the kernel makes it without `start_dma` (as it makes a linear layer's
  gates' VMEM -> SMEM copies, which the simulator does not model), and
  `mk.cost.machine.Simulation.family_bytes` leaves it out too;
- a repeated segment's copy ("we_gate[1]" in the simulator) goes by its segment's name
  (the kernel's record).
No phase is compared as a multiset: where the kernel issues several DMAs at one point (a
layer's two norm vectors, the router and its bias, a linear layer's small weights and
conv state, the K and V tiles) the simulator issues them in the same order, so the whole
sequence is compared.

B = 2 copies of one sequence at one position: the per-sequence streams (KV tiles and
write-backs, a linear layer's states) run twice, both rows route to the same top-k
experts (so the active expert slots are exactly top-k, what the simulator is told), and
every sequence sits at one position, as the simulator assumes.

Planted bugs, in this job: a simulator that issues a layer's q/k norms before its norms,
or DMAs the router after the token mixer at tp = 1 (as it does at tp > 1), moves the same
bytes per family and fails the comparison. And the counter is in the kernel only when a
log is open.

Not here: totals against the plan and mk.cost.perf (tests/test_plan.py), timing (interpret
mode has none), tensor parallelism (the same kernel per device; its DMA log interleaves
devices).
"""

import jax
import jax.numpy as jnp
import pytest

import mk
from mk.kernels import backend
from mk.cost import machine, sim
from mk.step import megakernel
from mk.model import reference
from mk.kernels.common import dma_log
from mk.step.plan import DecodePlan
from mk.step.step_bytes import family_of
from mk.kinds.mlp import kinds as kinds_mlp
from builders import (simulated_step, replay_tile_by_tile, tiny_bounded_kda, tiny_gated_mla,
                      tiny_latent_moe, tiny_res_layer, tiny_situ)

pytestmark = pytest.mark.xdist_group("dma_order")  # one worker runs each kernel once

FAMILIES = ["tiny", "tiny-moe", "tiny-hybrid", "tiny-kimi", "tiny-gpt-oss"]
K3_KINDS = {"tiny-situ": tiny_situ, "tiny-gated-mla": tiny_gated_mla,  # no presets
            "tiny-bounded-kda": tiny_bounded_kda, "tiny-latent-moe": tiny_latent_moe,
            "tiny-res-layer": tiny_res_layer}
BATCH, POSITION = 2, 37  # two copies of one sequence, each with 37 cached positions
LOCAL = ("selected",)  # the simulator's transfers that are no HBM DMA of the kernel
_KERNEL: dict = {}  # preset -> its kernel's DMA log (each kernel runs once per session)


def _config(name: str):
    return K3_KINDS[name]() if name in K3_KINDS else mk.preset(name)


def _plan(name: str) -> DecodePlan:
    config = _config(name)
    return DecodePlan.make(config, batch=BATCH, rows=1, context=config.max_context)


def kernel_dmas(name: str) -> list:
    """(what, bytes) of every DMA one megakernel step of `name` issues, in issue order."""
    if name not in _KERNEL:
        plan = _plan(name)
        config = plan.config
        cache = reference.init_cache(config, BATCH)
        tokens = jnp.full((BATCH, 1), 5, jnp.int32)
        positions = jnp.full((BATCH,), POSITION, jnp.int32)
        with dma_log(megakernel.traced_step) as log, backend.use("interpret"):
            weights = megakernel.prepare(plan, mk.init_params(config))
            jax.block_until_ready(megakernel.decode_step(plan, weights, cache, tokens,
                                                         positions))
        _KERNEL[name] = [(what, int(nbytes)) for what, nbytes in log]
    return _KERNEL[name]


def simulated_dmas(name: str, monkeypatch) -> list:
    """(what, bytes) of every transfer the simulator's replay of the same step issues, in
    issue order, tile by tile, normalised as the module docstring says."""
    issued = []
    monkeypatch.setattr(machine.Machine, "issued", issued)
    replay_tile_by_tile(monkeypatch)  # the fast-forward records no transfer
    plan = _plan(name)
    config = plan.config
    simulated_step(config, "v5e", batch=BATCH, rows=1, context=POSITION, block=plan.block,
                   experts_active=config.experts_per_token if config.is_moe else None)
    return [(what.split("[")[0], int(nbytes)) for what, nbytes in issued
            if what not in LOCAL]


def first_difference(kernel: list, simulated: list) -> str | None:
    """None if equal, else where the two sequences part, with a few DMAs either side."""
    if kernel == simulated:
        return None
    n = next((i for i, (a, b) in enumerate(zip(kernel, simulated)) if a != b),
             min(len(kernel), len(simulated)))

    def around(seq):
        return [(i, family_of(w), w, b) for i, (w, b) in enumerate(seq)][max(0, n - 3):n + 4]
    return (f"DMA {n} differs ({len(kernel)} in the kernel, {len(simulated)} simulated):\n"
            f"  kernel:    {around(kernel)}\n  simulator: {around(simulated)}")


def family_totals(dmas: list) -> dict:
    out: dict = {}
    for what, nbytes in dmas:
        out[family_of(what)] = out.get(family_of(what), 0) + nbytes
    return out


# Seconds (kernel step and replay) on the shared 2 cores: 6-12, 14-19, 13-18, 14-24; the
# planted bugs reuse the logs. tiny-bounded-kda (~10 s) and tiny-res-layer (~13 s) in make
# test-slow: CI's budget
@pytest.mark.parametrize("name", FAMILIES + [
    pytest.param(n, marks=pytest.mark.slow) if n in ("tiny-bounded-kda", "tiny-res-layer")
    else n for n in K3_KINDS])
def test_the_kernel_issues_its_dmas_in_the_simulators_order(name, monkeypatch):
    kernel = kernel_dmas(name)
    simulated = simulated_dmas(name, monkeypatch)
    difference = first_difference(kernel, simulated)
    if difference:
        pytest.fail(difference)
    families = {family_of(what) for what, _ in kernel}
    config = _config(name)  # the comparison covers each family's own DMAs
    assert {"norms", "lm_head"} <= families
    # tiny-bounded-kda has no full layer, so no attention weights and no KV cache
    assert ({"attention", "kv_read", "kv_write"} <= families) == bool(config.full_layers)
    assert ("experts" in families) == config.is_moe
    assert ("state_read" in families) == bool(config.linear_layers)


def _norms_after_qk_norms(self, layer, tag=""):
    """`mk.cost.sim.Replay.vectors` with its two DMAs swapped (a planted bug)."""
    c = self.c
    return max(self.mc.dma(8 * c.head_dim, layer, "qk_norms", tag),
               self.mc.dma(8 * c.hidden, layer, "norms", tag))


@pytest.mark.parametrize("name, planted", [
    ("tiny", lambda mp: mp.setattr(sim.Replay, "vectors", _norms_after_qk_norms)),
    ("tiny-moe", lambda mp: mp.setattr(kinds_mlp, "router_after_mixer", lambda tp: True))])
def test_a_simulator_issuing_the_same_bytes_in_another_order_fails(name, planted,
                                                                    monkeypatch):
    kernel = kernel_dmas(name)
    planted(monkeypatch)
    simulated = simulated_dmas(name, monkeypatch)
    assert family_totals(simulated) == family_totals(kernel)  # totals cannot see it
    assert sorted(simulated) == sorted(kernel)  # nor the DMAs as a multiset
    assert first_difference(kernel, simulated) is not None


def test_the_dma_counter_is_in_the_kernel_only_while_a_log_is_open():
    plan = _plan("tiny")
    config = plan.config
    params = jax.eval_shape(lambda: mk.init_params(config))
    weights = jax.eval_shape(lambda p: megakernel.prepare(plan, p), params)
    cache = jax.eval_shape(lambda: reference.init_cache(config, BATCH))
    tokens = jax.ShapeDtypeStruct((BATCH, 1), jnp.int32)
    positions = jax.ShapeDtypeStruct((BATCH,), jnp.int32)

    def traced() -> str:
        return str(jax.make_jaxpr(lambda *a: megakernel.traced_step(plan, *a))(
            weights, cache, tokens, positions))

    plain = traced()
    with dma_log(megakernel.traced_step):
        logged = traced()
    again = traced()
    for marker in ("io_callback", "run_scoped"):
        assert marker in logged and marker not in plain and marker not in again
