"""What a layer kind is: the `Kind` base class, the kernel's `Step` it acts on, and the
simulator's `Twin` base.

A kind is bound to the model (or the shard) it runs in (`Kind(config)`). The whole-model
kernel, the stage kernel, the plan and the simulator know nothing of any one kind: each
asks the model's kinds (`mk.kinds.layers.layer_kinds`) and calls the hooks of `Kind`. A
kind owns its weights (its rows of `mk.model.weights`), its tensor-parallel split, its ring
segments, buffers and scratch, how its weights are prepared and fetched, its parts of the
cache, its in-kernel code by phase (`LAYER_PHASES`), its simulator twin and its cost. A
layer of another kind of the same role skips this kind's region of the stream.

Every layer has one kind of each of `ROLES`; a model may add one of the `STREAM` role,
which owns the residual stream (attention residuals: `mk.kinds.residual`).

Not here: the kinds themselves (`mk.kinds.attention.kinds`, `mk.kinds.linear.kinds`,
`mk.kinds.mlp.kinds`, `mk.kinds.residual`),
the loop over them (`mk.step.one_layer.layer_body`, `mk.cost.sim`), their config checks
(`mk.model.kind_checks`). Every hook and what it owns: docs/design/mk.kinds.base.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import jax

from mk.model.config import ModelConfig
from mk.kernels.common import Buffer
from mk.kernels.stream import Repeat
from mk.model.weights import FAMILY, KIND_LAYERS, TRANSPOSED, dma_layout, names_of, param_shapes

# The phases of one layer in program order, as data: `layer_body` runs them in this order
# (each under a named scope: the profiler's markers), and `mk.cost.sim` replays the same list.
# The token mixers' phases come first (the linear kinds' "linear", then full attention's
# four), in the order their segments sit in the stream.
LAYER_PHASES = ("linear", "prologue", "attend", "kv_prime", "wo", "after_mixer",
                "attn_all_reduce", "mlp_norm", "before_mlp", "mlp", "mlp_all_reduce",
                "residual")
ROLES = ("mixer", "mlp")  # every layer has one kind of each role
STREAM = "stream"  # the role of a residual-stream kind (attention residuals: every layer's,
#                    besides its two; without one, the plain residual stream x + out)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One layer kind of `config` (module docstring). Subclasses set the class fields and
    override the hooks they need; a hook they do not override does nothing."""

    config: ModelConfig
    name: ClassVar[str] = ""  # its rows' kind in `mk.model.weights`
    role: ClassVar[str] = ""  # one of ROLES
    phases: ClassVar[tuple[str, ...]] = ()  # the LAYER_PHASES it acts in
    stream_phase: ClassVar[str] = ""  # the phase that consumes its segments
    skip_tag: ClassVar[str] = ""  # the simulator's cause for an HBM gap its skip leaves
    elementwise: ClassVar[tuple[str, ...]] = ()  # its weights applied off the MXU
    title: ClassVar[str] = ""  # what its layers are called in prose (`described`)
    note: ClassVar[str] = ""  # what the ledger says of a modelled run with its layers

    @property
    def layers(self) -> tuple[int, ...]:
        """The model's layers of this kind."""
        layers = getattr(self.config, KIND_LAYERS[self.name])
        return tuple(range(layers)) if isinstance(layers, int) else tuple(layers)

    def weights(self, *paths: str) -> tuple[str, ...]:
        """Its weights the megakernel moves by one of `paths` (`mk.model.weights.names_of`)."""
        return names_of(self.config, self.name, *paths)

    def split_widths(self) -> dict[str, int]:
        """The config widths tensor parallelism splits tp ways (each a multiple of tp)."""
        return {}

    def shard_fields(self, tp: int) -> dict:
        """Its config fields on one of tp devices (`mk.step.plan.shard_config`)."""
        return {}

    def matrices(self, M: int) -> list:
        """Its ring segments of one layer (M = B*T activation rows), in consumption order."""
        return []

    def segment_names(self) -> tuple[str, ...]:
        """The names of its segments, in stream order (a repeated group's once)."""
        return tuple(name for m in self.matrices(1)
                     for name, *_ in (m.matrices if isinstance(m, Repeat) else (m,)))

    def region(self) -> tuple[str, str]:
        """The first and last of its segments: the region a layer of another kind skips."""
        names = self.segment_names()
        return names[0], names[-1]

    def buffers(self, batch: int, rows: int, block) -> list:
        """Its VMEM buffers (`mk.kernels.common.Buffer`)."""
        return []

    def fit_note(self, batch: int, rows: int) -> str:
        """What its own VMEM buffers need and what would shrink them, in prose (" ..."),
        appended to the plan's error when a step's buffers do not fit; "" by default."""
        return ""

    def scratch(self, batch: int, rows: int, block) -> dict[str, dict]:
        """Its semaphores and SMEM by buffer group ({group: {name: scratch}})."""
        return {}

    def operands(self) -> tuple[str, ...]:
        """Its weights as the megakernel's operands (`prepare`'s names), in stream order: by
        default the ones it streams or DMAs."""
        return self.weights("ring", "dma")

    def vectors(self) -> dict[str, int]:
        """Its per-layer float32 vectors besides the norms, {name: width}: prepared as
        [L, 2, width] operands, DMA'd a layer ahead with the norms into a two-slot
        [2, 2, width] buffer of the "vectors" group, read as `Step.vectors`."""
        return {}

    def prepare(self, params) -> dict:
        """Its weights as the megakernel reads them (before `mk.kernels.ring.ring_layout`):
        as stored, but each weight it moves by whole DMA laid out per layer as its
        `dma_buffers` buffer (`mk.model.weights.dma_layout`; `TRANSPOSED` ones transposed)."""
        out = {}
        for name in self.weights("ring", "dma"):
            w = params[name]
            if name in self.weights("dma") and isinstance(w, jax.Array):
                shape, dtype = dma_layout(name, w.shape[1:], w.dtype)
                w = w.swapaxes(-1, -2) if name in TRANSPOSED else w
                w = w.reshape(w.shape[:1] + shape).astype(dtype)
            out[name] = w
        return out

    def dma_buffers(self) -> list:
        """A VMEM buffer per weight it moves by whole DMA, named after it: one layer's, as
        `prepare` lays it out (`mk.model.weights.dma_layout`)."""
        shapes = param_shapes(self.config)
        return [Buffer(name, *dma_layout(name, shapes[name][0][1:], self.config.dtype))
                for name in self.weights("dma")]

    def fetch(self, k: Step) -> dict:
        """The ring's Fetch callables of its segments: by default each ring weight's row
        of this layer (`Step.row`), switched off in a layer of another kind (`Step.on`)."""
        row, on = k.row(self), k.on(self)

        def at_row(name):
            return lambda step: (k.inputs[name].at[row(step)], None if on is None else on(step))
        return {name: at_row(name) for name in self.weights("ring")}

    def cache_operands(self, cache) -> dict:
        """Its parts of the decode cache the kernel updates in place (aliased operands)."""
        return {}

    def state_operands(self, cache, batch: int, rows: int) -> tuple[dict, dict]:
        """Its states the kernel reads (inputs) and writes after each of the `rows` rows
        (outputs, as shapes)."""
        return {}, {}

    def cache_fields(self, out) -> dict:
        """Its fields of the cache after the step (for `cache._replace`), from the
        kernel's outputs by name."""
        return {}

    def setup(self, k: Step) -> None:
        """In the kernel, before the ring is primed."""

    def start(self, k: Step) -> None:
        """In the kernel, at the step's start (after the ring and the norms are issued)."""

    def begin(self, k: Step) -> None:
        """At the start of each of its layers."""

    def run(self, k: Step, phase: str) -> None:
        """Its part of `phase` (one of its `phases`) in one of its layers."""

    def finish(self, k: Step) -> None:
        """In the kernel, at the step's end."""

    def twin(self, sim) -> Twin:
        """Its simulator twin on `sim` (`mk.cost.sim`'s kernel replay)."""
        return Twin(self, sim)

    # -- Its cost (`mk.cost.perf`): one layer's, in a step of `batch` sequences x `rows` query
    #    rows over `context` cached positions (M = batch * rows activation rows)
    @property
    def routes(self) -> tuple[int, int] | None:
        """(experts, experts per token) its tokens are routed among, or None."""
        return None

    def matmuls(self) -> tuple[str, ...]:
        """Its weights a token multiplies by (on the MXU): all but the norms and its
        `elementwise` ones, in table order."""
        return tuple(n for n in self.weights()
                     if FAMILY[n] != "norms" and n not in self.elementwise)

    def layout_note(self) -> str:
        """What its shard's layout changes in the bytes it streams, in prose (", ..."), or
        "" where nothing: the ledger's notes."""
        return ""

    def described(self) -> str:
        """Its layers in prose, e.g. "23 MLA layers" (the ledger's notes)."""
        n = len(self.layers)
        return f"{n} {self.title} layer{'s' * (n != 1)}"

    def streamed(self, experts: float) -> dict[str, float]:
        """Elements of each weight family (`mk.model.weights.FAMILY`) one of its layers moves
        in a step: its ring segments as the ring lays them out (a repeated group once per
        active expert: `experts`, a mean) and its weights moved by whole DMA."""
        out: dict[str, float] = {}
        for m in self.matrices(1):
            group, copies = (m.matrices, experts) if isinstance(m, Repeat) else ((m,), 1)
            for name, rows, cols in group:
                out[FAMILY[name]] = out.get(FAMILY[name], 0) + copies * rows * cols
        shapes = param_shapes(self.config)
        for name in self.weights("dma"):
            out[FAMILY[name]] = out.get(FAMILY[name], 0) + math.prod(shapes[name][0][1:])
        return out

    def once(self) -> dict[str, float]:
        """Elements of each weight family it moves once a step (not per layer): none by
        default."""
        return {}

    def params(self) -> int:
        """Matmul parameters one token multiplies by in one layer (its `matmuls`' elements
        per layer in the weight table)."""
        shapes = param_shapes(self.config)
        return sum(math.prod(shapes[n][0][1:]) for n in self.matmuls())

    def mixing_flops(self, batch: int, rows: int, context: int) -> float:
        """Its FLOPs besides its weights' matmuls (attention over the cache, the delta
        rule) in one layer."""
        return 0.0

    def cache_bytes(self, batch: int, rows: int, context: int, kv_tile: int) -> dict:
        """Bytes its layers' KV caches move in one step on one device, by step family
        ("kv_read", "kv_write": `mk.step.step_bytes.STEP_FAMILIES`), every sequence at
        `context` with `rows` new rows and KV tiles of `kv_tile` positions: none by
        default (a full-attention kind's: `mk.kinds.attention.kinds.GQA.cache_bytes`)."""
        return {}

    def collectives_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """Seconds of its own collectives in one of its layers over M = m rows on a shard
        (besides the layer's two all-reduces: `mk.cost.perf`, the simulator): none by default."""
        return 0.0

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """Its MXU passes of one layer, each (rows, weight elements, weight loads): what
        `mk.cost.perf.mxu_flops(rows, elements, loads * mxu_rows)` charges (`touched`: the
        distinct experts a routed layer reads). By default the M rows through `params`."""
        return [(batch * rows, self.params(), 1)]

    def conventional(self, e) -> list:
        """Its ops in one layer of the conventional one-kernel-per-op execution
        (`mk.cost.perf.conventional`), after the layer's norm: (name, weight bytes of all
        devices, FLOPs, activation widths read and written) each, its bytes a share of the
        step estimate `e`'s (`mk.cost.perf.StepEstimate`)."""
        return []


@dataclasses.dataclass
class Step:
    """What a kind's kernel code acts on: the step's fixed parts (set by the kernel) and
    the layer's (set by `layer_body` before each layer). row(kind)(step): the layer's row
    in that kind's stacked weights; on(kind): None when every layer of the kind's role is
    of that kind, else on(kind)(step) is a traced flag, whether the layer is."""

    config: ModelConfig
    block: Any
    batch: int
    rows: int
    tp: int
    s: Any  # the layer scratch by name (attributes)
    inputs: dict
    outputs: dict
    row: Callable
    on: Callable
    groups: dict = dataclasses.field(default_factory=dict)  # the scratch by group
    collective: str = "recursive"  # the in-kernel collectives' algorithm (the plan's)
    ring: Any = None
    prime_next: bool = False  # a full layer primes the next one's KV tiles
    first_row: Any = 0  # the row of the kernel's first layer of each kind
    step: Any = 0  # the layer's index in the stream
    x: Any = None  # the residual stream [M, D] f32
    norms: tuple = ()  # (attn_norm, mlp_norm, q_norm, k_norm) values
    vectors: dict = dataclasses.field(default_factory=dict)  # the kinds' `Kind.vectors`
    #                                                          of the layer, [2, width] each
    x_attn: Any = None  # the residual stream after the layer's mixer (set by `layer_body`)

    @property
    def positions(self):
        return self.inputs["positions"]

    def here(self, kind: Kind):
        """Whether this layer is of `kind`: a traced flag, or None when every layer of its
        role is."""
        on = self.on(kind)
        return None if on is None else on(self.step)


class Twin:
    """A kind's simulator twin: the same hooks as its kernel code, on `mk.cost.sim`'s replay
    `sim` (its ring: start, matmul, skip, region; its machine `sim.mc`: dma, wait,
    compute). `active` says whether a tile of one of its segments loads."""

    def __init__(self, kind: Kind, sim):
        self.kind, self.sim = kind, sim
        self.layers = frozenset(kind.layers)

    def active(self, layer: int, segment: str, copy: int) -> bool:
        return layer in self.layers

    def start(self) -> None:
        """At the step's start."""

    def begin(self) -> None:
        """At the start of each of its layers (`Kind.begin`)."""

    def boundary(self) -> None:
        """At the start of each of its layers, in a kernel without cross-layer prefetch."""

    def run(self, phase: str) -> None:
        """Its part of `phase` in one of its layers."""

    def finish(self) -> None:
        """At the step's end."""
