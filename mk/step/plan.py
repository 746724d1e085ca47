"""The decode plan: one device's decode step as data, read by the kernel, the simulator,
the performance model and every compile path.

`DecodePlan.make(config, tp=, batch=, rows=, context=, block=None, formats=None)` (the
one way to make a plan) holds, frozen: the model and its shard (`local`, `shard_config`),
B x T rows and the context, the quantised `formats` and their MXU `feeds`, the tiling
`block`, the `TileStream` and every VMEM buffer by name (`buffers`: the budget, the
kernel's scratch and the simulator's sizes all come from it); it answers `fits(chip)`
(the one capacity check, before any compile) and `weight_bytes(experts)`.

Here: `shard_config` (what one device holds), `kv_layout`, `padded_vocab`, `default_block`
(`ring_cover_s`, `kv_depth`), `model_stream`, `capacity`, `packed_formats`, `plan_chip`,
`DecodePlan`, `Fit`. Not here: Little's law's slots (`mk.kernels.stream.ring_slots`),
`check_tp` (`mk.step.shards`), bytes by family (`mk.step.step_bytes`), the kernel
(`mk.step.megakernel`), time (`mk.cost.sim`, `mk.cost.perf`). The fields, the sharding
model kind by kind, the default tiling and the ring's slots: docs/design/mk.step.plan.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant, unpack
from mk.model.layer_values import EXPERT_SLICE
from mk.model.cache import state_bytes_per_sequence
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import (DTYPE_BITS, LANES, PADDED_FIELDS, ModelConfig, check_config,
                             check_formats, check_rows, positive_int)
from mk.kernels.collectives import (PARTIAL_SUM_BYTES, allreduce_s, choose_algorithm,
                                    collective_buffers, collective_semaphores)
from mk.kernels.common import (KV_TILE, SLOTS, VMEM_HEADROOM, VMEM_ROOM, BlockSizes, Buffer,
                               VmemBudget, vmem_budget, vmem_limit_bytes)
from mk.kinds.linear.deltanet import check_conv_kernel
from mk.kernels.kv_stream import tile_counts
from mk.kinds.mlp.mlp import expert_slots
from mk.step.one_layer import layer_buffers, layer_scratch, model_block
from mk.kinds.layers import full_attention, layer_kinds, layer_matrices, segment_kinds
from mk.step.shards import check_quantised_splits, check_tp
from mk.kernels.ring import ring_buffers
from mk.kernels.stream import TileStream, ring_slots
from mk.step.step_bytes import bytes_per_element, shard_weight_bytes, shard_weight_elements
from mk.model.weights import param_shapes

# -- The sharding model -------------------------------------------------------------------
def shard_config(config: ModelConfig, tp: int, formats=None) -> ModelConfig:
    """The model one device holds (module docstring): N/tp heads, max(K/tp, 1) kv heads,
    V/tp, and each layer kind's split fields (`Kind.shard_fields`: Nk/tp and Nv/tp linear
    heads, F/tp, Fe/tp and Fs/tp padded to whole 128-lane tiles, the zeros in `padding`:
    `own_width` is a device's share), stored as `formats` (default config's: what its kinds
    lay out, `mk.kinds.mlp.kinds.MoE.joined`)."""
    tp = check_tp(config, tp)
    config = config if formats is None else dataclasses.replace(config, formats=formats)
    if tp == 1:
        return config
    fields, shares = {}, {}
    for kind in layer_kinds(config):
        fields |= kind.shard_fields(tp)
        shares |= {f: width // tp for f, width in kind.split_widths().items()}
    # a split width's lane padding is the shard's own (`shard_fields`: whole tiles, zeros
    # recorded); only unsplit widths keep the model's (D's, the norms': `norm_width`)
    padding = {f: zeros for f, zeros in config.padding if f not in fields}
    padding |= {f: fields[f] - share for f, share in shares.items()
                if f in PADDED_FIELDS and fields.get(f, share) > share}
    return dataclasses.replace(
        config, name=f"{config.name}/tp{tp}", heads=config.heads // tp,
        kv_heads=max(config.kv_heads // tp, 1), vocab=config.vocab // tp,
        tie_embeddings=False, padding=padding, **fields)


def kv_layout(local: ModelConfig) -> tuple[int, int, int]:
    """(heads, row width, caches) of one full layer's cache on a device holding `local`:
    (K, H, 2) for K and V, (1, R + Hr, 1) for MLA's latent cache (one row every head
    reads as keys and values): its full-attention kind's `kv_layout`."""
    return full_attention(local).kv_layout()


# -- The default tiling -------------------------------------------------------------------
def padded_vocab(local: ModelConfig, block: BlockSizes) -> int:
    """V (of the shard) rounded up to whole lm_head tiles."""
    return -(-local.vocab // block.tile_cols) * block.tile_cols


# The time a chip's ring keeps HBM streaming (Little's law): twice the simulator's 1 us DMA
# latency (notebook 13 measures it); at tp > 1 one all-reduce more (`ring_cover_s`)
RING_COVER_S = 2e-6


def ring_cover_s(local: ModelConfig, tp: int, M: int, spec: ChipSpec,
                 collective: str | None = None) -> float:
    """The time a chip's ring keeps HBM streaming: RING_COVER_S, and at tp > 1 one
    all-reduce of the [M, D] float32 partial sums (`allreduce_s` by the `collective`
    algorithm), so the weight DMAs stream on through the collective instead of draining
    the ring."""
    reduce = (allreduce_s(M * local.hidden * PARTIAL_SUM_BYTES, tp, spec, collective)
              if tp > 1 else 0.0)
    return RING_COVER_S + reduce


def default_block(local: ModelConfig, context: int, *, slots: int | None = None,
                  formats=None, chip: ChipSpec | str | None = None,
                  cover_s: float = RING_COVER_S, feeds=None) -> BlockSizes:
    """The default tiling of a shard with a cache of `context` positions and the
    quantised `formats` fed as `feeds`: `mk.step.one_layer.model_block`'s tiles (the
    largest cutting every matrix of the shard, plain or transposed, or the expert slots'
    own and the others' matched to their bytes); `slots` ring slots, default the
    `ring_slots` of `chip` (one core's bandwidth x `cover_s` in flight over the stream's
    tile sequence; at most a layer's period of tiles) or, without a chip, SLOTS; and as
    many KV slots as prefetch one sequence's whole cache or the ring's bytes of KV tiles,
    whichever is fewer (a layer's first KV tiles are issued behind the weight tiles in
    flight: `kv_depth`). Not the VMEM: `DecodePlan.make` shortens a chip's ring to fit."""
    block = model_block(local, context=positive_int("context", context), formats=formats,
                        feeds=feeds)
    stream = model_stream(local, block, 1, formats, feeds)
    itemsize = jnp.dtype(local.dtype).itemsize
    smallest = min(stream.segment_tile_bytes(s, itemsize)
                   for s in stream.segments + stream.tail)  # what a slot moves, at least
    if slots is None and chip is not None:
        spec = spec_of(chip)
        # at most a layer's period: deeper, the next layer's weight tiles queue ahead of this
        # layer's KV tiles on the one DMA queue
        slots = min(ring_slots(stream, itemsize, spec.device_hbm_bw * cover_s),
                    max(SLOTS, stream.period))
    block = dataclasses.replace(block, slots=SLOTS if slots is None else slots)
    return dataclasses.replace(block, kv_slots=kv_depth(local, block, context,
                                                        block.slots * smallest))


def kv_depth(local: ModelConfig, block: BlockSizes, context: int, ring_bytes: int) -> int:
    """KV slots of the default tiling: one more than the KV tiles of one sequence's whole
    cache (`context` positions) or than the KV tiles holding `ring_bytes` (what the weight
    ring has in flight), whichever is fewer; at least 2."""
    K, H, caches = kv_layout(local)
    kv_tile_bytes = caches * K * block.kv_tile * H * jnp.dtype(local.dtype).itemsize
    tiles = min(-(-context // block.kv_tile), -(-ring_bytes // kv_tile_bytes))
    return max(2, tiles + 1)


def model_stream(local: ModelConfig, block: BlockSizes, M: int, formats=None,
                 feeds=None) -> TileStream:
    """Every weight tile of one step of the shard `local` for M = B*T rows (`block`'s
    tiles; the quantised `formats`' segments packed, fed as `feeds` says, {group: feed},
    bf16 by default): each layer's `layer_matrices`, then the lm_head [D, V padded to
    whole tiles]."""
    kinds = layer_kinds(local)
    return TileStream.build(block, layer_matrices(kinds, M), layers=local.layers,
                            tail=[("lm_head", local.hidden, padded_vocab(local, block))],
                            schemes=quant.schemes_of(formats), feeds=quant.schemes_of(feeds),
                            kinds=segment_kinds(kinds))


def capacity(positions: int) -> int:
    """The smallest cache capacity S holding `positions` that the default KV tile divides:
    `positions` rounded up to 16 sublanes, and to whole KV_TILEs beyond one tile."""
    S = -(-positive_int("positions", positions) // 16) * 16
    return S if S <= KV_TILE else -(-S // KV_TILE) * KV_TILE


def packed_formats(config: ModelConfig, formats: dict[str, str]) -> dict[str, str]:
    """The `formats` whose packed tiles the megakernel's ring streams, at any tp (each
    device its shard's, `mk.step.shards.shard_params`): all when every weight of their groups
    is a ring weight (none `mk.model.quant.unstreamed`), else none, where `mk.cost.perf` and the
    simulator's plans charge their bytes on plain tiles."""
    return {} if quant.unstreamed(config, quant.schemes_of(formats)) else dict(formats)


# -- The plan -------------------------------------------------------------------------------
# What a run holds beyond the step, as multiples measured on v5e compiles (shapes only;
# `mk.step.preparation.peak`): laying out a stacked plain matrix a layer at a time holds
# one more copy of it (qwen3-4b's bf16 w_gate, 1.67 GiB: 8.22 prepared, 9.89 peak), a
# packed one 0.69 of it (gpt-oss-20b's MXFP4 experts, 3.29 GiB: 13.33, 15.59); the
# prefill's dequantised slice (a layer's row; of experts, `EXPERT_SLICE` of a layer's)
# 2.8x its bf16 bytes (gpt-oss-20b: 0.54 GiB for 4 of 32 experts, 0.19 in bf16). Tests:
# test_preparation.py, test_prefill_memory.py.
RELAYOUT_TEMPORARY = {"plain": 1.0, "packed": 0.7}
PREFILL_DEQUANTISED = 2.8


def _dequantised_row(shape) -> int:
    """Elements of a stacked [L, ...] weight the prefill dequantises at once: a layer's
    row; of experts [L, E, ...], `EXPERT_SLICE` of them (`mk.model.layer_values.experts_of`)."""
    row = math.prod(shape[1:])
    return row if len(shape) < 4 else row // shape[1] * math.gcd(shape[1], EXPERT_SLICE)


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether one device's step fits a chip: VMEM (the plan's buffers) and HBM (its
    weights and KV cache against one core's share; with a prompt, the peak of a whole
    `generate`: `DecodePlan.generate_parts`)."""

    chip: str
    vmem: VmemBudget | None  # None when the buffers do not fit (see error)
    hbm_bytes: int
    hbm_limit_bytes: int
    error: str = ""
    parts: tuple[tuple[str, int], ...] = ()  # the peak's parts by name, largest first

    @property
    def ok(self) -> bool:
        return not self.error


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One device's decode step (module docstring). Build it with `DecodePlan.make`."""

    config: ModelConfig
    tp: int
    local: ModelConfig
    batch: int
    rows: int
    context: int
    block: BlockSizes
    stream: TileStream
    formats: tuple[tuple[str, str], ...]  # the `formats` dict's items, hashable
    named_buffers: tuple[tuple[str, Buffer], ...]  # `buffers` as a hashable field
    chip: str | None = None  # the TPU it is for: sizes the ring, caps scoped VMEM
    feeds: tuple[tuple[str, str], ...] = ()  # {group: feed} of the packed groups, hashable
    collective: str = "recursive"  # `mk.kernels.collectives.ALGORITHMS`' all-reduce
    position: int | None = None  # every sequence's position (`make(position=)`: the step
    #                              `mk.cost.sim.simulate` replays); None for a cache of `context`

    @property
    def buffers(self) -> dict[str, Buffer]:
        """Every VMEM buffer of the step by name."""
        return dict(self.named_buffers)

    @classmethod
    def make(cls, config: ModelConfig, *, tp: int = 1, batch: int = 1, rows: int = 1,
             context: int | None = None, position: int | None = None,
             block: BlockSizes | None = None, formats=None,
             chip: ChipSpec | str | None = None, kernel: bool = True,
             feeds=None, collective: str | None = None) -> DecodePlan:
        """The one way to make a plan. The cache holds `context` positions (S), or, given
        `position` instead, every sequence is at `position` in a cache just large enough
        for its rows (`capacity`, or whole KV tiles of the given block: the step the
        simulator replays, kept as `plan.position`). Checks every limit of the step
        before anything is traced: tp splits the model, M = B*T is in [1, MAX_ROWS],
        the tiles divide every matrix of the shard, the KV tile divides the cache and
        holds the T rows, the quantised
        `formats` (default `config.formats`; {} for none) hold whole groups per tile
        (and, for a kernel, `packed_formats` packs them all, and each device's shard of
        them is whole packed bytes and scale blocks: `mk.step.shards.check_quantised_splits`).
        Without a block, the tiling is `default_block`'s (for `chip`: a ring sized by Little's
        law and fitted to the chip's VMEM, module docstring; a kernel's plan whose buffers
        exceed the VMEM even at 2 slots raises, naming them). The megakernel's ring needs
        >= 2 slots (a tile loads while another computes) and a linear layer's
        conv_kernel >= 2 (`check_conv_kernel`); `kernel=False` makes a plan only the
        simulator replays, which may have neither. `feeds` ({group: feed}) overrides the
        chip's choice of what each packed group reaches the MXU as
        (`mk.model.unpack.choose_feeds`: a feed the chip's MXU does not take, or one the group's
        scheme cannot reach exactly, is a ValueError here). `collective`: the algorithm
        of the in-kernel collectives (`mk.kernels.collectives.ALGORITHMS`), default the
        one of fewer message rounds at this tp (`choose_algorithm`)."""
        check_config(config)
        tp, M = check_tp(config, tp), check_rows(batch, rows)  # a bad tp named first
        context = _cache_positions(rows, context, position, block)
        spec = None if chip is None else spec_of(chip)
        if spec is not None and spec.kind != "tpu":
            raise ValueError(f"chip={spec.name!r} is a {spec.kind}: a plan is one TPU "
                             "core's step (its ring and buffers in the core's VMEM)")
        collective = choose_algorithm(tp, collective)
        formats, packed, feeds, local = _weight_formats(config, tp, formats, feeds, spec,
                                                        kernel)
        block = _step_block(config, local, tp, batch, rows, context, packed, feeds, spec,
                            kernel, collective, block)
        stream = _checked_stream(local, block, M, packed, feeds)
        buffers = _buffers(local, int(tp), int(batch), int(rows), block,
                           padded_vocab(local, block), stream, collective)
        return cls(config, int(tp), local, int(batch), int(rows), context, block, stream,
                   tuple(sorted(formats.items())), tuple(buffers.items()),
                   None if spec is None else spec.name, tuple(sorted(feeds.items())),
                   collective, position)

    @property
    def M(self) -> int:
        return self.batch * self.rows

    def vmem_limit(self) -> int:
        """The scoped VMEM the kernel asks Mosaic for (`vmem_limit_bytes` of its buffers),
        at most the VMEM of the chip the plan was made for."""
        cap = None if self.chip is None else spec_of(self.chip).vmem_bytes
        return vmem_limit_bytes(self.buffers.values(), cap)

    @property
    def vocab(self) -> int:
        """The shard's vocab padded to whole lm_head tiles (the logits' columns)."""
        return padded_vocab(self.local, self.block)

    @property
    def kinds(self) -> tuple:
        """The shard's layer kinds (`mk.kinds`), in stream order."""
        return layer_kinds(self.local)

    @property
    def vectors(self) -> tuple[str, ...]:
        """The per-layer vectors the kernel DMAs a layer ahead, in issue order: the norms,
        the q/k norms, then the kinds' (`Kind.vectors`)."""
        return ("norms", "qk_norms") + tuple(n for kind in self.kinds for n in kind.vectors())

    @property
    def expert_slots(self) -> int:
        return expert_slots(self.local.experts, self.local.experts_per_token, self.M)

    def group(self, group: str) -> dict[str, Buffer]:
        return {n: b for n, b in self.buffers.items() if b.group == group}

    def scratch(self) -> dict:
        """The kernel's Pallas scratch by group and name: every VMEM buffer that is not
        an operand, the ring's and each kind's semaphores and SMEM
        (`mk.step.one_layer.layer_scratch`), the norm vectors' and the collectives'
        semaphores."""
        groups = layer_scratch(self.kinds, self.buffers.values(), self.batch, self.rows,
                               self.block)
        groups["vectors"] |= {"sems": pltpu.SemaphoreType.DMA((2, len(self.vectors))),
                              "final_sem": pltpu.SemaphoreType.DMA((1,))}
        for group in groups.values():  # the collectives (tp > 1): `collective_buffers`'
            if "gathered" in group:
                group["sems"] = collective_semaphores(self.tp, self.collective)
        return groups

    def weight_bytes(self, experts: float | None = None) -> dict[str, float]:
        """`shard_weight_bytes` of this plan's shard, tiles and formats; `experts`
        defaults to every expert slot of the stream."""
        return shard_weight_bytes(self.local, self.vocab,
                                  self.expert_slots if experts is None else experts,
                                  dict(self.formats), self.block)

    def kv_tiles(self, positions, window: int = 0) -> tuple[int, int]:
        """(KV tiles read, tiles written back) of one layer (with a sliding window of
        `window` positions, or 0) for sequences at `positions` (a tile is K and V of the
        shard's kv heads)."""
        return tile_counts(positions, self.rows, self.block.kv_tile, window)

    def hbm_bytes(self) -> int:
        """HBM one device holds: its weights as `mk.step.megakernel.prepare` lays them out (every
        expert, the whole embedding table; its formats' packed as `mk.model.quant.tile_major`:
        FP4 half a byte a value, and scales), its KV cache and, with linear layers, their
        states and the states after each of the T rows (`state_bytes`)."""
        c, itemsize = self.local, DTYPE_BITS[self.local.dtype] // 8
        per = bytes_per_element(c, dict(self.formats), self.block)
        elements = shard_weight_elements(c, self.vocab, c.experts)  # every expert
        weights = sum(n * per[f] for f, n in elements.items())
        embed = self.config.vocab * c.hidden * itemsize
        return int(weights + embed + self._cache_bytes())

    def state_bytes(self) -> dict[str, int]:
        """The linear layers' state bytes one step moves on one device: "state_read" (the
        conv and recurrent states, once) and "state_write" (both after every one of the T
        rows, what a verifier's rollback picks from). Fixed: no context in them."""
        per_row = self.batch * state_bytes_per_sequence(self.local)
        return {"state_read": per_row, "state_write": self.rows * per_row}

    def stored_bytes(self) -> dict[str, int]:
        """Bytes of each of the model's params as stored (one device's, tp = 1): the
        plan's formats packed with their scales (`mk.model.quant.storage_bytes`), the rest in
        config.dtype (norms too: an upper bound)."""
        schemes = quant.schemes_of(dict(self.formats))
        return {name: sum(quant.storage_bytes(shape, schemes.get(name), dtype).values())
                for name, (shape, dtype) in param_shapes(self.config).items()}

    def generate_parts(self, prompt: int, *, donate: bool) -> dict[str, int]:
        """HBM a `generate` of a `prompt`-token prompt holds at its worst, by part: the
        prefill (the stored params, the KV cache and its transient: one layer's quantised
        weights dequantised, `PREFILL_DEQUANTISED` times their bytes, or the lm_head's,
        and the prompt's float32 logits), then preparing (the laid-out weights, the
        largest tensor in flight: `RELAYOUT_TEMPORARY` times one), then decoding. With
        donate=False the caller's params stay alive beside the prepared weights (then
        made alongside them: nothing else in flight)."""
        if self.tp != 1:
            raise NotImplementedError(f"generate_parts at tp={self.tp}: one device only")
        c, stored = self.local, self.stored_bytes()
        itemsize = DTYPE_BITS[c.dtype] // 8
        cache = self._cache_bytes()
        shapes, schemes = param_shapes(c), quant.schemes_of(dict(self.formats))
        layer = sum(_dequantised_row(shapes[n][0]) for n in schemes
                    if n in shapes and len(shapes[n][0]) > 2) * itemsize
        whole = max([math.prod(shapes[n][0]) * itemsize for n in schemes
                     if n in shapes and len(shapes[n][0]) == 2], default=0)
        prefill = int(PREFILL_DEQUANTISED * max(layer, whole)) + self.batch * prompt * (
            self.vocab * 4)
        parts = {"prepared weights": self._weight_bytes(), "KV cache": cache,
                 "stored params": sum(stored.values()),
                 "largest tensor in flight while preparing": int(max(
                     RELAYOUT_TEMPORARY["packed" if n in schemes else "plain"] * b
                     for n, b in stored.items())),
                 "prefill's transient": prefill}
        parts["stored params (kept: donate=False)"] = parts["stored params"]
        phases = {"prefill": ("stored params", "KV cache", "prefill's transient"),
                  "prepare": ("prepared weights", "KV cache",  # the params freed as it goes
                              "largest tensor in flight while preparing") if donate else (
                      "prepared weights", "KV cache", "stored params (kept: donate=False)")}
        worst = max(phases, key=lambda p: sum(parts[n] for n in phases[p]))
        return dict(sorted(((n, parts[n]) for n in phases[worst]), key=lambda kv: -kv[1]))

    def _weight_bytes(self) -> int:
        """`hbm_bytes`' weights (the prepared layout and the embedding), no cache."""
        return self.hbm_bytes() - self._cache_bytes()

    def _cache_bytes(self) -> int:
        """`hbm_bytes`' KV cache and linear states."""
        c, itemsize = self.local, DTYPE_BITS[self.local.dtype] // 8
        K, H, caches = kv_layout(c)
        return (caches * K * H * len(c.full_layers) * self.batch * self.context * itemsize
                + sum(self.state_bytes().values()))

    def fits(self, chip: ChipSpec | str, *, prompt: int | None = None,
             donate: bool = False) -> Fit:
        """The one capacity check: the VMEM buffers against one core's VMEM and the HBM
        one device holds against what the compiler lets one core hold
        (`ChipSpec.hbm_compile_bytes`, a little under the chip's share): the decode step's
        (weights and KV cache), or with `prompt` the peak of a whole `generate`
        (`generate_parts`: its prefill and its preparing too), before anything is made."""
        spec = spec_of(chip)
        hbm, limit = self.hbm_bytes(), spec.hbm_compile_bytes
        try:
            vmem = vmem_budget(f"megakernel {self.local.name}", self.buffers.values(), spec)
        except ValueError as err:
            return Fit(spec.name, None, hbm, limit, str(err))
        if prompt is not None:
            parts = self.generate_parts(prompt, donate=donate)
            need = sum(parts.values())
            error = "" if need <= limit else (
                f"{self.local.name}: generate needs {need / 2**30:.2f} GiB on {spec.name}, "
                f"has {limit / 2**30:.2f}: " + ", ".join(
                    f"{n} {b / 2**30:.2f}" for n, b in parts.items()))
            return Fit(spec.name, vmem, need, limit, error, tuple(parts.items()))
        if hbm > limit:
            return Fit(spec.name, vmem, hbm, limit,
                       f"{self.local.name}: weights and KV cache need {hbm / 2**30:.2f} GiB "
                       f"of HBM, over the {limit / 2**30:.2f} GiB the compiler gives one "
                       f"{spec.name} core")
        return Fit(spec.name, vmem, hbm, limit)


def plan_chip(plan, use: str) -> ChipSpec:
    """The TPU `plan` was made for; ValueError, saying `use`, if none or no plan."""
    if not isinstance(plan, DecodePlan):
        raise ValueError(f"plan is a {type(plan).__name__}; it must be a DecodePlan "
                         "(`DecodePlan.make(config, chip=, ...)`)")
    if plan.chip is None:
        raise ValueError(f"a plan made for no chip: {use} on the chip its ring and feeds "
                         "are for (`DecodePlan.make(chip=)`)")
    return spec_of(plan.chip)


# -- DecodePlan.make's phases, in the order it runs them -----------------------------------
def _cache_positions(rows: int, context, position, block) -> int:
    """The cache capacity S of a plan: `context`, or, given `position` instead, one just
    large enough for every sequence's rows at `position` (`capacity`, or whole KV tiles of
    the given block)."""
    if (context is None) == (position is None):
        raise ValueError(f"context={context!r}, position={position!r}: give one, the "
                         "cache capacity S or every sequence's position")
    if block is not None and not isinstance(block, BlockSizes):
        raise ValueError(f"block={block!r} must be a BlockSizes or None")
    if position is not None:
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position={position!r} must be an integer >= 0")
        end = position + rows
        context = capacity(end) if block is None else -(-end // block.kv_tile) \
            * block.kv_tile
    return positive_int("context", context)


def _weight_formats(config: ModelConfig, tp: int, formats, feeds, spec: ChipSpec | None,
                    kernel: bool) -> tuple[dict, dict, dict, ModelConfig]:
    """(formats, the packed ones the ring streams, their MXU feeds, the shard's config):
    the formats checked (default `config.formats`), and for a kernel, quantisable and
    split into whole packed bytes and scale blocks at this tp."""
    formats = check_formats(config, config.formats if formats is None else formats)
    packed = packed_formats(config, formats)
    feeds, local = unpack.choose_feeds(packed, feeds, spec), shard_config(config, tp, packed)
    if kernel and packed != formats:
        quant.check_quantisable(config, formats)  # NotImplementedError
    if kernel and tp > 1:
        check_quantised_splits(config, formats, tp)
    return formats, packed, feeds, local


def _step_block(config: ModelConfig, local: ModelConfig, tp: int, batch: int, rows: int,
                context: int, packed, feeds, spec: ChipSpec | None, kernel: bool,
                collective: str, block: BlockSizes | None) -> BlockSizes:
    """The plan's tiling: `block`, or the chip's default (`_chip_block`; its error names the
    model, the tp and the fields tp splits), checked against the ring, the conv kernel, the
    cache and the rows."""
    if block is None:
        try:
            block = _chip_block(local, int(tp), int(batch), int(rows), context, packed,
                                feeds, spec, kernel, collective)
        except ValueError as err:  # name the model, the tp and the fields tp splits
            if tp == 1:
                raise ValueError(f"{config.name}: {err}") from None
            split = [f"{f}={getattr(local, f)} of {getattr(config, f)}" for f in
                     ("heads", "kv_heads", "linear_key_heads", "linear_value_heads")
                     if getattr(local, f) != getattr(config, f)]
            raise ValueError(f"{config.name} at tp={tp} (per device: {', '.join(split)})"
                             f": {err}") from None
    if kernel and block.slots < 2:
        raise ValueError(f"BlockSizes.slots={block.slots}: the megakernel's ring needs "
                         ">= 2 slots so a tile loads while another computes")
    if kernel:
        check_conv_kernel(config)
    block.check_context(context)
    if rows > block.kv_tile:
        raise ValueError(f"rows={rows} new rows per sequence exceed "
                         f"kv_tile={block.kv_tile}")
    return block


def _checked_stream(local: ModelConfig, block: BlockSizes, M: int, packed,
                    feeds) -> TileStream:
    """The step's `model_stream`, after checking that `block.tiles` names only ring weights
    of a layer."""
    stream = model_stream(local, block, M, packed, feeds)
    layer_weights = {s.name for s in stream.segments}
    stray = sorted(set(dict(block.tiles)) - layer_weights)
    if stray:  # the lm_head's columns are padded to the block's tile (`padded_vocab`)
        raise ValueError(f"BlockSizes.tiles names {stray}: only a layer's ring weights "
                         f"take tiles of their own ({sorted(layer_weights)})")
    return stream


def _chip_block(local: ModelConfig, tp: int, batch: int, rows: int, context: int, formats,
                feeds, spec: ChipSpec | None, kernel: bool, collective: str) -> BlockSizes:
    """`default_block` for the chip: the ring `ring_slots` asks for over `ring_cover_s`,
    or the deepest shorter one whose step's buffers leave Mosaic `vmem_limit_bytes`' room
    in the chip's VMEM (every ring buffer, plain and each scheme's, is slots deep: they
    share the slot index), never below the ring covering RING_COVER_S unless that ring
    does not fit the chip's VMEM at all (many small packed tiles): then down to 2 slots.
    When even 2 do not fit, a `kernel` plan raises ValueError naming the biggest buffers;
    the simulator's (a step no core holds, replayed) keeps the RING_COVER_S ring, and
    `fits` says the same."""
    if spec is None:
        return default_block(local, context, formats=formats, feeds=feeds)

    def made(slots=None, cover_s=RING_COVER_S):  # the block and its buffers' bytes
        block = default_block(local, context, formats=formats, chip=spec, slots=slots,
                              cover_s=cover_s, feeds=feeds)
        stream = model_stream(local, block, batch * rows, formats, feeds)
        buffers = _buffers(local, tp, batch, rows, block, padded_vocab(local, block), stream,
                           collective)
        return block, buffers

    def total(buffers) -> int:
        return sum(b.bytes for b in buffers.values())

    block, buffers = made(cover_s=ring_cover_s(local, tp, batch * rows, spec, collective))
    room = (spec.vmem_bytes - VMEM_ROOM) / VMEM_HEADROOM  # the buffers Mosaic's room allows
    if total(buffers) <= room:
        return block
    floor, floor_buffers = made()
    low = floor.slots if total(floor_buffers) <= spec.vmem_bytes else 2
    high = block.slots  # the deepest in [low, high] that leaves the room, else low
    while low < high:  # the buffers grow with the slots (the ring's and the KV's)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total(made(mid)[1]) <= room else (low, mid - 1)
    block, buffers = made(low)
    if total(buffers) <= spec.vmem_bytes:
        return block
    if kernel:
        try:
            vmem_budget(f"megakernel {local.name} ({block.slots}-slot ring)",
                        buffers.values(), spec)
        except ValueError as err:  # with what a kind's own buffers need (`Kind.fit_note`)
            notes = "".join(kind.fit_note(batch, rows) for kind in layer_kinds(local))
            raise ValueError(f"{err}{notes}") from None
    return floor


def _buffers(local: ModelConfig, tp: int, batch: int, rows: int, block: BlockSizes,
             vocab: int, stream: TileStream, collective: str) -> dict[str, Buffer]:
    """Every VMEM buffer of the megakernel by name (module docstring)."""
    M, D, H, dt, f32 = batch * rows, local.hidden, local.head_dim, local.dtype, "float32"
    buffers = [
        *layer_buffers(local, layer_kinds(local), batch, rows, block,
                       ring=ring_buffers(stream, dt)),
        Buffer("norms", (2, 2, D), f32, "vectors"),  # a layer's norms, two layers' slots
        Buffer("qk_norms", (2, 2, H), f32, "vectors"),
        *(Buffer(n, (2, 2, width), f32, "vectors") for kind in layer_kinds(local)
          for n, width in kind.vectors().items()),  # e.g. attention residuals' queries
        Buffer("final_norm", (1, D), f32, "vectors"),
        Buffer("x", (M, D), f32, "operand"),  # the embedded tokens
        Buffer("logits", (M, vocab), f32, "operand"),
        Buffer("next_tokens", (M, 1), "int32", "operand"),
    ]
    if tp > 1:  # one all-reduce of [M, D] (two slots) and the argmax's gather
        buffers += collective_buffers("all_reduce", M, D, tp, reduce=True,
                                      algorithm=collective)
        buffers += collective_buffers("argmax", M, LANES, tp, reduce=False,
                                      algorithm=collective)
    out = {b.name: b for b in buffers}
    if len(out) != len(buffers):
        raise ValueError(f"duplicate buffer names in {[b.name for b in buffers]}")
    return out

