"""The layer kinds' contract (`mk.kinds`), on every preset, without running a kernel: each
layer has one kind per role, the per-layer tables point into each kind's stacked
weights, a kind streams exactly its ring weights of the weight table in stream order, and
the kinds' buffers and scratch do not collide. The kernels' own checks (exact tokens,
bytes, DMA order, bounds) are in test_megakernel, test_counts, test_dma_order and
test_bounds."""

from __future__ import annotations

import pytest

import mk
from mk.step.plan import DecodePlan
from mk.kinds.base import LAYER_PHASES, ROLES, STREAM
from mk.kinds.layers import KINDS, kind_at, layer_kinds, layer_tables, of_role
from mk.model.presets import KIMI_PRESET_NAMES, PRESET_NAMES
from mk.model.weights import names_of, param_shapes

ALL = PRESET_NAMES + KIMI_PRESET_NAMES


@pytest.mark.parametrize("name", ALL)
def test_every_layer_has_one_kind_per_role_and_the_tables_point_into_its_weights(name):
    config = mk.preset(name)
    kinds, tables = layer_kinds(config), layer_tables(config)
    shapes = param_shapes(config)
    for role in ROLES:
        ours = of_role(kinds, role)
        assert ours, f"{name} has no {role} kind"
        owners = [[k for k in ours if layer in k.layers] for layer in range(config.layers)]
        assert all(len(o) == 1 for o in owners), (role, owners)
        for layer in range(config.layers):
            kind, row = kind_at(kinds, role, layer)
            assert ours.index(kind) == tables[f"{role}_kind"][layer]
            assert row == tables[f"{role}_row"][layer] == kind.layers.index(layer)
            for weight in kind.weights("ring", "dma"):  # its stacked weights hold the row
                assert row < shapes[weight][0][0], (name, weight, row)


@pytest.mark.parametrize("name", ALL)
def test_a_kind_streams_exactly_its_ring_weights_in_stream_order(name):
    """The ring segments a kind declares are its rows of the weight table with path
    "ring", in table order (the table is in stream order), and its region is the span a
    layer of another kind skips."""
    config = mk.preset(name)
    for kind in layer_kinds(config):
        ring = names_of(config, kind.name, "ring")
        assert kind.segment_names() == ring, (kind.name, kind.segment_names(), ring)
        assert kind.region() == (ring[0], ring[-1])


def test_the_registry_lists_each_kind_once_in_stream_order():
    names = [k.name for k in KINDS]
    assert len(set(names)) == len(names)
    roles = [k.role for k in KINDS]
    # the mixers' segments come first, then the MLPs'; the stream kind (no segments) last
    assert roles == sorted(roles, key=(*ROLES, STREAM).index)
    for kind in KINDS:
        assert kind.stream_phase in kind.phases and set(kind.phases) <= set(LAYER_PHASES)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-hybrid", "tiny-kimi",
                                  "qwen3-30b-a3b", "kimi-k2-shaped"])
def test_the_kinds_scratch_is_allocated_once_by_name(name):
    """Every kind's VMEM buffers and its semaphores/SMEM land in one namespace per group;
    the plan builds its scratch (a name allocated twice would raise)."""
    plan = DecodePlan.make(mk.preset(name), batch=2, context=256, kernel=False)
    scratch = plan.scratch()
    assert "sems" in scratch["layer"]  # the ring's, beside the kinds'
    for kind in plan.kinds:
        for group, refs in kind.scratch(2, 1, plan.block).items():
            assert set(refs) <= set(scratch[group]), (kind.name, group)


def test_a_name_two_kinds_allocate_is_refused(monkeypatch):
    """The guard of the test above: an MoE kind that also declares the dense MLP's "gate"
    buffer, or a second "sems", is refused by name in a model holding both MLP kinds."""
    from jax.experimental.pallas import tpu as pltpu

    from mk.kernels.common import Buffer
    from mk.kinds.mlp.kinds import MoE

    config = mk.preset("tiny-moe")
    buffers, scratch = MoE.buffers, MoE.scratch
    with monkeypatch.context() as m:
        m.setattr(MoE, "buffers", lambda self, batch, rows, block: [
            *buffers(self, batch, rows, block), Buffer("gate", (batch * rows, 8), "float32")])
        with pytest.raises(ValueError, match="duplicate buffer names"):
            DecodePlan.make(config, batch=2, context=256, kernel=False)
    monkeypatch.setattr(MoE, "scratch", lambda self, batch, rows, block: {
        "layer": scratch(self, batch, rows, block)["layer"]
        | {"sems": pltpu.SemaphoreType.DMA((2,))}})
    plan = DecodePlan.make(config, batch=2, context=256, kernel=False)
    with pytest.raises(ValueError, match=r"layer kind moe: scratch layer.\['sems'\] is "
                                         "already allocated"):
        plan.scratch()
