"""The layer kinds a model has, in stream order, and the per-layer tables the kernel reads.

`layer_kinds(config)`: its kinds (`mk.kinds.base.Kind` objects bound to `config`), token
mixers first (linear ones before full attention), then MLPs (MoE before dense): the order
their segments sit in each layer's period of the stream and the order `layer_body` runs
them; last a residual-stream kind (`ResLayer`, attention residuals: no segments). Which
kinds a config has is `mk.model.weights.kinds_of`'s one rule. Also here: `stream_kind`,
`full_attention`, `of_role`, `kind_at` (a layer's kind of a role and its row in that
kind's stacked weights), `kinds_at` (a layer's two kinds), `layer_tables` / `TABLES` (the
kernel's SMEM tables: each layer's kind and row per role), `layer_matrices` (one layer's
ring segments), `segment_kinds` (each segment's role and kind) and `check_kind` (run on
every kind at import: each acts only in `LAYER_PHASES`).
"""

from __future__ import annotations

import numpy as np

from mk.model.config import ModelConfig
from mk.kinds.attention.kinds import GQA, MLA, GatedMLA, SinkGQA
from mk.kinds.base import LAYER_PHASES, ROLES, STREAM, Kind
from mk.kinds.mlp.latent import LatentMoE
from mk.kinds.linear.kinds import KDA, BoundedKDA, DeltaNet
from mk.kinds.mlp.kinds import ClampedMoE, Dense, MoE, SituDense
from mk.kinds.residual import ResLayer
from mk.model.weights import kinds_of

KINDS = (DeltaNet, KDA, BoundedKDA, GQA, SinkGQA, MLA, GatedMLA, MoE,  # in stream order
         ClampedMoE, LatentMoE, Dense, SituDense, ResLayer)
TABLES = tuple(f"{role}_{what}" for role in ROLES for what in ("kind", "row"))  # SMEM [L]


def check_kind(kind: type[Kind]) -> type[Kind]:
    """A kind class, after checking its role is one of ROLES and its phases (with its
    stream phase) are among LAYER_PHASES (the list the kernel runs and the simulator
    replays); raises ValueError naming them."""
    if kind.role not in (*ROLES, STREAM) or not set(kind.phases) <= set(LAYER_PHASES) \
            or kind.stream_phase not in kind.phases:
        raise ValueError(f"layer kind {kind.name}: role {kind.role!r} must be one of "
                         f"{(*ROLES, STREAM)} and its phases {kind.phases} (with its stream phase "
                         f"{kind.stream_phase!r}) among LAYER_PHASES {LAYER_PHASES}")
    return kind


for _kind in KINDS:
    check_kind(_kind)


def layer_kinds(config: ModelConfig) -> tuple[Kind, ...]:
    """The kinds `config` has, in stream order; raises NotImplementedError naming a kind
    of its layers that has no class here (the reference runs it, no kernel does yet)."""
    names = kinds_of(config)
    missing = sorted(set(names) - {"model", "layer"} - {kind.name for kind in KINDS})
    if missing:
        raise NotImplementedError(f"{config.name}: its layer kinds {missing} have no kernel "
                                  "yet (mk.kinds.layers.KINDS); mk.model.reference runs them")
    return tuple(kind(config) for kind in KINDS if kind.name in names)


def stream_kind(kinds) -> Kind | None:
    """The residual-stream kind among `kinds` (role STREAM: `ResLayer`), or None where
    the stream is plain (x + each block's output)."""
    return next(iter(of_role(kinds, STREAM)), None)


def full_attention(config: ModelConfig) -> GQA:
    """`config`'s full-attention kind (GQA's when it has no full layer: a cache layout is
    still asked of it)."""
    return next((k for k in layer_kinds(config) if isinstance(k, GQA)), GQA(config))


def of_role(kinds, role: str) -> tuple[Kind, ...]:
    return tuple(k for k in kinds if k.role == role)


def kind_at(kinds, role: str, layer: int) -> tuple[Kind, int]:
    """Layer `layer`'s kind of `role` among `kinds` and its row in that kind's weights."""
    kind = next(k for k in of_role(kinds, role) if layer in k.layers)
    return kind, kind.layers.index(layer)


def kinds_at(config: ModelConfig, layer: int) -> tuple[Kind, Kind]:
    """Layer `layer`'s token mixer and MLP kinds."""
    kinds = layer_kinds(config)
    return tuple(kind_at(kinds, role, layer)[0] for role in ROLES)


def layer_tables(config: ModelConfig) -> dict[str, np.ndarray]:
    """Per role, each layer's kind (its index among the model's kinds of that role) and
    its row in that kind's stacked weights: int32 [L] each, "<role>_kind" and
    "<role>_row"."""
    kinds, tables = layer_kinds(config), {}
    for role in ROLES:
        ours = of_role(kinds, role)
        at = [kind_at(kinds, role, layer) for layer in range(config.layers)]
        tables[f"{role}_kind"] = np.array([ours.index(k) for k, _ in at], np.int32)
        tables[f"{role}_row"] = np.array([row for _, row in at], np.int32)
    return tables


def segment_kinds(kinds) -> dict[str, tuple[str, str]]:
    """{segment name: (role, kind name)} of every ring segment of `kinds`
    (`mk.kernels.stream.Segment.kind`)."""
    return {name: (k.role, k.name) for k in kinds for name in k.segment_names()}


def layer_matrices(kinds, M: int) -> list:
    """The ring segments of one layer holding `kinds`, in consumption order (M = B*T
    activation rows bound the expert slots). A layer skips the kinds it is not of
    (`Kind.region`, where the kind's `stream_phase` would consume them); the order puts
    each skip before a collective or the layer's end where it can: a linear layer skips
    attention after its mixer, an MoE layer the dense MLP after its experts, so the refill
    loads during the all-reduce that follows; only a full layer of a hybrid (skipping the
    linear region at its start) and a dense layer of a mixed model (the MoE region) wait
    for theirs."""
    return [m for kind in kinds for m in kind.matrices(M)]
