"""The draft model beside the verify step: what a published speculative step holds besides
the verification mk simulates. The release's Kimi K3 step is its verify megakernel (T = 8
rows) and then its fused DSpark draft kernel, which reads the verify's logits and tapped
hidden states and drafts the next 8 tokens in one forward pass of 8 rows; the published
step time is both kernels' (docs/design/mk.cost.draft.md: the release's code, cited).

Here: `DSpark` (the release's `DraftConfig` and its kernel's per-rank layout, field by
field with its source; `DSPARK`, Kimi K3's draft), `check_draft` (its fields against the
target it drafts for), `draft_stream` (one rank's weights in the kernel's order),
`simulate_draft` and `draft_ends` (one draft step on `mk.cost.sim`'s machine: the same
ring, tile cost table, bundle rate and collective model as the verify step) and
`with_draft` (a ledger row's verify step, the draft step, their sum, the published step).
A dataclass, not a preset: a `ModelConfig` has no taps, fc or Markov head, and the
draft's TP32 shard (3 query heads of 64, one kv head) is no whole number of mk's 128-lane
tiles, so no `DecodePlan` cuts it (the design page says more).

Not here: the verify step (`mk.cost.sim`, `mk.cost.ledger`), a draft kernel (mk runs
none), acceptance (the published runs force it), Qwen's DFlash draft.
"""

from __future__ import annotations

import dataclasses

from mk.cost import perf
from mk.kernels.collectives import allgather_s, choose_algorithm
from mk.kernels.common import VMEM_HEADROOM, VMEM_ROOM, BlockSizes
from mk.kernels.stream import TileStream, ring_slots
from mk.model.chips import RATE_ENDS, ChipSpec, spec_of
from mk.model.config import ModelConfig, padded_width, positive_int
from mk.model.errors import shown
from mk.model.presets import preset as named_preset
from mk.cost.machine import Assumptions, Machine, Simulation
from mk.cost.sim import Replay
from mk.step.plan import RING_COVER_S

BF16 = 2  # bytes: the release stores every draft weight and its cache bf16 (below)
INT32 = 4
TILE_SIDES = (512, 640, 896, 384, 256, 128)  # a draft tile's sides, first that divides


@dataclasses.dataclass(frozen=True)
class DSpark:
    """A DSpark draft as the release builds it: a small Qwen3-style transformer over an fc
    of the target's tapped hidden states, an lm_head and a low-rank Markov bias, run by one
    fused kernel on every rank of the verify's TP group. Sources (Inferact/tpu-megakernels
    at aa0094e): `DraftConfig` and the kernel's layout in kimi/dspark.py (`weight_shapes`,
    `kernel_weight_shapes`, `_make_body`, `make_fused_draft`) and demo_kimi_dspark.py."""

    name: str
    target: str  # the preset it drafts for (its Config: kimi/__init__.py)
    hidden: int  # DraftConfig.hidden; fc.weight [hidden, len(taps) * hidden]
    layers: int  # DraftConfig.layers
    heads: int  # DraftConfig.heads (q_proj [heads * head_dim, hidden])
    kv_heads: int  # DraftConfig.kv_heads (k_proj, v_proj [kv_heads * head_dim, hidden])
    head_dim: int  # DraftConfig.head_dim
    ffn: int  # DraftConfig.intermediate (gate, up [ffn, hidden]; down [hidden, ffn])
    vocab: int  # DraftConfig.vocab: embed_tokens and lm_head [vocab, hidden]
    taps: tuple[int, ...]  # DraftConfig.aux_layers: target layers whose outputs fc reads
    window: int  # DraftConfig.window: the context cache ring, [layers, window, 2 * head_dim]
    markov_rank: int  # DraftConfig.markov_rank: markov_w1, markov_w2 [vocab, rank]
    rows: int  # ROWS (kimi/dspark.py) = the demo's rows: anchor + 7 drafts, one pass
    tp: int  # RANKS: make_fused_draft refuses any mesh but the 32 ranks of the verify's
    hosts: int  # fc's split: rank r holds host r // 8's quarter of the taps (FC_IN) ...
    #             for output chunk r % 8 (CHUNK = hidden / 8): kernel_weight_shards' fc

    def __post_init__(self):
        for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                      "window", "markov_rank", "rows", "tp", "hosts"):
            positive_int(f"{self.name}: {field}", getattr(self, field))
        if not isinstance(self.taps, tuple) or not self.taps:
            raise ValueError(f"{self.name}: taps={shown(self.taps)} must be a non-empty "
                             "tuple of target layers")

    @property
    def fc_in(self) -> int:
        """The fc's input: the tapped hidden states concatenated (DraftConfig.context_width)."""
        return len(self.taps) * self.hidden

    @property
    def q_width(self) -> int:
        """One rank's query columns (its heads / tp heads)."""
        return self.heads // self.tp * self.head_dim

    @property
    def mlp_width(self) -> int:
        """One rank's MLP channels padded to whole lane tiles (the release's MLP_PADDED: 448
        -> 512, zero columns)."""
        return padded_width(self.ffn // self.tp)

    def cache_bytes(self) -> int:
        """One rank's context cache: every layer's [window, K | V] ring, the one kv head it
        holds (`empty_kernel_cache`)."""
        return self.layers * self.window * 2 * self.head_dim * BF16

    def matrices(self) -> dict[str, tuple[int, int]]:
        """{name: (rows, cols)} of one rank's weights the kernel streams from HBM, in its
        order (`kernel_weight_shapes`); per layer "kv" (k | v of its kv head), "q_o" (q
        [hidden, q_width] and o [q_width, hidden] as one [2 q_width, hidden] matrix: 192
        columns are no whole lane tile, and cost and bytes are the elements'), "gate",
        "up", "down"; then the lm_head's vocabulary shard and the Markov head's w2^T."""
        vocab, out = self.vocab // self.tp, {"fc": (self.fc_in // self.hosts,
                                                    self.hidden * self.hosts // self.tp)}
        for i in range(self.layers):
            out |= {f"kv.{i}": (self.hidden, 2 * self.head_dim),
                    f"q_o.{i}": (2 * self.q_width, self.hidden),
                    f"gate.{i}": (self.hidden, self.mlp_width),
                    f"up.{i}": (self.hidden, self.mlp_width),
                    f"down.{i}": (self.mlp_width, self.hidden)}
        return out | {"lm_head": (self.hidden, vocab), "w2t": (self.markov_rank, vocab)}


# Kimi K3's draft, RedHatAI/Kimi-K3-speculator.dspark, as kimi/dspark.py's defaults and
# kernel constants give it (DraftConfig(): hidden 7168, layers 5, heads 96, kv_heads 16,
# head_dim 64, intermediate 14336, vocab 163840, aux_layers (24, 48, 72, 88, 92), window
# 2048, markov_rank 256; ROWS = 8, RANKS = 32, FC_IN = 35840 // 4). Every weight bf16
# (load_checkpoint_weights, kernel_weight_shards).
DSPARK = DSpark(name="kimi-k3-dspark", target="kimi-k3", hidden=7168, layers=5, heads=96,
                kv_heads=16, head_dim=64, ffn=14_336, vocab=163_840,
                taps=(24, 48, 72, 88, 92), window=2048, markov_rank=256, rows=8, tp=32,
                hosts=4)


def check_draft(draft: DSpark, target: ModelConfig, *, verify_rows: int | None = None) -> DSpark:
    """`draft`, after checking its fields against the `target` model it drafts for and the
    split of its kernel: it proposes the target's tokens (vocab), reads the target's hidden
    states at target layers (hidden, taps), and its rows are the verify's (`verify_rows`,
    if given); the ranks split its heads, MLP, fc and vocabulary (`_shard_weights`).
    ValueError names the field, its value and the limit."""
    if not isinstance(draft, DSpark):
        raise ValueError(f"draft is a {type(draft).__name__}; it must be a DSpark")
    name = draft.name
    if draft.vocab != target.vocab:
        raise ValueError(f"{name}: vocab={draft.vocab} must be {target.name}'s "
                         f"vocab={target.vocab} (its lm_head proposes the target's tokens)")
    if draft.hidden != target.hidden:
        raise ValueError(f"{name}: hidden={draft.hidden} must be {target.name}'s "
                         f"hidden={target.hidden} (fc reads its hidden states)")
    if list(draft.taps) != sorted(set(draft.taps)) or not all(
            isinstance(t, int) and 0 <= t < target.layers for t in draft.taps):
        raise ValueError(f"{name}: taps={draft.taps} must be increasing layers of "
                         f"{target.name}, in [0, {target.layers})")
    if verify_rows is not None and draft.rows != verify_rows:
        raise ValueError(f"{name}: rows={draft.rows} must be the verify's T={verify_rows}")
    if draft.tp % draft.kv_heads or draft.tp % draft.hosts:
        raise ValueError(f"{name}: tp={draft.tp} must be a multiple of kv_heads="
                         f"{draft.kv_heads} and hosts={draft.hosts}")
    for field, width, parts in (("heads", draft.heads, draft.tp), ("ffn", draft.ffn, draft.tp),
                                ("vocab", draft.vocab, draft.tp),
                                ("fc_in", draft.fc_in, draft.hosts),
                                ("hidden", draft.hidden, draft.tp // draft.hosts)):
        if width % parts:
            raise ValueError(f"{name}: {field}={width} must split into {parts} parts")
    return draft


def draft_stream(draft: DSpark, slots: int = 2) -> TileStream:
    """One rank's weight matrices (`DSpark.matrices`) as one ring stream of `slots`: the
    whole step as one period (its layers differ only in name), each side of a tile the
    first of TILE_SIDES that divides the matrix's (512 x 512 where they do)."""
    def side(n):
        return next(s for s in TILE_SIDES if n % s == 0)

    def tile(rows, cols):
        return side(rows), side(cols)

    mats = draft.matrices()
    shapes = {name: tile(*shape) for name, shape in mats.items()}
    block = BlockSizes(slots=slots, tile_rows=512, tile_cols=512, tiles=tuple(
        (name, t) for name, t in shapes.items() if t != (512, 512)))
    step = [(name, r, c) for name, (r, c) in mats.items() if name not in ("lm_head", "w2t")]
    tail = [(name, *mats[name]) for name in ("lm_head", "w2t")]
    return TileStream.build(block, step, tail=tail)


def draft_slots(draft: DSpark, spec: ChipSpec, a: Assumptions) -> int:
    """The ring the verify's plan would take (`mk.step.plan.ring_cover_s`): Little's law
    over RING_COVER_S and one all-reduce of the [rows, hidden] float32 partial sums, but
    no deeper than the chip's VMEM holds beside the context cache (at Mosaic's headroom,
    `mk.kernels.common.VMEM_HEADROOM`; each tile shape a ring buffer of its own, as
    `mk.kernels.ring`'s): a deeper FIFO ring only queues the cache and the Markov rows
    behind more tiles."""
    cover = RING_COVER_S + perf.allreduce_s(draft.rows * draft.hidden * perf.PARTIAL_SUM_BYTES,
                                            draft.tp, spec, choose_algorithm(draft.tp),
                                            a.ici_latency_s)
    bw = spec.device_hbm_bw * a.hbm_share
    stream = draft_stream(draft)
    slot = sum(rows * cols * BF16 for _, (rows, cols) in stream.storages)
    room = (spec.vmem_bytes - VMEM_ROOM) / VMEM_HEADROOM - draft.cache_bytes()
    return max(2, min(ring_slots(stream, BF16, bw * cover), int(room // slot)))


def simulate_draft(draft: DSpark, chip: ChipSpec | str, *,
                   assumptions: Assumptions | None = None) -> Simulation:
    """One draft step of the release's fused kernel (`_make_body`) on one rank, replayed on
    `mk.cost.sim`'s machine: its weights stream through a ring (`draft_slots`) at the tile
    cost table's cost at `assumptions.rate_end`, its other products at the MXU rule, its
    all-reduces as the verify's (`mk.cost.perf.allreduce_s`), its exchanges as all-gathers
    (`mk.kernels.collectives.allgather_s`), in the kernel's order: the verify's argmax
    (one all-gather), the anchor's embedding row (one DMA, one broadcast), fc and its
    reduction, each layer (the context rows' K/V, the block's q, K/V, attention over the
    window, o and its all-reduce, the MLP and its all-reduce), the lm_head, the Markov
    sampling (per drafted token an all-gather of the shards' best, and for each next one
    a w1 row fetched then), the cache written back."""
    spec, a = spec_of(chip), assumptions or Assumptions()
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}: the draft runs on the "
                         "verify's TPU cores")
    d, algorithm = check_draft(draft, named_preset(draft.target)), choose_algorithm(draft.tp)
    stream = draft_stream(d, draft_slots(d, spec, a))
    bw = spec.device_hbm_bw * a.hbm_share
    mc = Machine(bw, a.dma_latency_s)
    r = Replay(None, stream, mc, m=d.rows, batch=1, rows=d.rows, context=d.window,
               spec=spec, tp=d.tp, formats={}, experts_on=0, prefetch=True, a=a, vocab=0,
               collective=algorithm)
    M, D, V = d.rows, d.hidden, d.vocab // d.tp

    def gather(nbytes):  # an exchange of one item from every rank
        mc.compute(allgather_s(nbytes, d.tp, spec, algorithm, a.ici_latency_s), 0,
                   "collective")

    inputs = mc.dma(M * V * 4 + len(d.taps) * M * D * BF16, 0, "draft inputs", "step start",
                    weight=False)  # the verify's fp32 logits shard and its taps
    r.prime_layer(0, "step start")
    cache = mc.dma(d.cache_bytes(), 0, "k_tile", weight=False)
    mc.wait(inputs)
    r.vector(4 * M * V, "argmax")
    gather(M * 128 * INT32)  # each row's best of the verify's logits
    mc.wait(mc.dma(16 * D * BF16, 0, "embedding row", weight=False))
    gather(D * BF16)  # the anchor's row from its owner
    r.matmul("fc")
    r.collective(M * D * perf.PARTIAL_SUM_BYTES)
    r.vector(5 * M * D, "norm")
    for i in range(d.layers):
        r.vector(5 * M * D, "norm")
        r.matmul(f"kv.{i}")
        mc.compute(r.mxu_s(M, D * 2 * d.head_dim), 0, "context kv")  # the new context rows
        r.matmul(f"q_o.{i}")
        mc.wait(cache)
        heads = d.heads // d.tp
        mc.compute(heads * 2 * r.mxu_s(M, d.window * 2 * d.head_dim)
                   + 8 * heads * M * d.window / r.vpu, 0, "attention")
        r.collective(M * D * perf.PARTIAL_SUM_BYTES)
        r.vector(M * D, "residual")
        r.vector(5 * M * D, "norm")
        for name in ("gate", "up", "down"):
            r.matmul(f"{name}.{i}")
        r.vector(4 * M * d.mlp_width, "swiglu")
        r.collective(M * D * perf.PARTIAL_SUM_BYTES)
        r.vector(M * D, "residual")
    r.vector(4 * M * D, "final_norm")
    r.matmul("lm_head")
    r.matmul("w2t")  # the first token's Markov bias; the others' below, one row each
    for slot in range(M):
        if slot:
            mc.wait(mc.dma(16 * d.markov_rank * BF16, 0, "w1 row", weight=False))
            mc.compute(r.mxu_s(1, d.markov_rank * V), 0, "markov bias")
        r.vector(4 * V, "argmax")
        gather(128 * INT32)  # the shards' best token
    mc.wait(mc.dma(d.cache_bytes() + M * D * BF16, 0, "k_write_back", weight=False))
    step_s = mc.finish()
    return Simulation(
        config_name=d.name, chip_name=spec.name, batch=1, rows=M, context=d.window,
        tp=d.tp, block=stream.block, cross_layer_prefetch=True, experts_active=0,
        hbm_bandwidth=bw, step_s=step_s, dma_bytes=mc.dma_bytes,
        weight_bytes=mc.weight_bytes, events=mc.event_records(1),
        bubbles=mc.bubble_records(1), assumptions=a)


def draft_ends(draft: DSpark, chip: ChipSpec | str, *,
               assumptions: Assumptions | None = None) -> dict[str, Simulation]:
    """{rate end: `simulate_draft` at that end of the chip's bundle rate}."""
    a = assumptions or Assumptions()
    return {end: simulate_draft(draft, chip, assumptions=dataclasses.replace(a, rate_end=end))
            for end in RATE_ENDS}


def with_draft(row: dict, drafts: dict[str, Simulation]) -> list[dict]:
    """The verify step of a ledger row (`mk.cost.ledger.entries(simulate_tpu=True, ...)`,
    one speculative TPU run), the draft step (`draft_ends`) and their sum, against the
    published step: one table row per verify step the ledger has (the plan's ring at the
    slow end; the compiled kernel at each end of the bundle rate), each with the draft at
    the same end. The sum is the step: the release runs the two kernels one after the
    other, each waiting on the other's output."""
    for key in ("run", "tau", "published_step_ms", "simulated_ms"):
        if not isinstance(row, dict) or key not in row:
            raise ValueError(f"row {shown(row)} lacks {key!r}: a row of "
                             "mk.cost.ledger.entries(simulate_tpu=True)")
    if not isinstance(drafts, dict) or set(drafts) != set(RATE_ENDS):
        raise ValueError(f"drafts={shown(drafts)} must be draft_ends' {{end: Simulation}} "
                         f"for the ends {list(RATE_ENDS)}")
    for end, sim in drafts.items():
        if sim.rows != row.get("rows", sim.rows):
            raise ValueError(f"the draft at the {end} end runs rows={sim.rows}; the verify "
                             f"of {row['run']} runs T={row['rows']}: drafts for another step")
    steps = [("simulated step, plan's ring", "slow", row["simulated_ms"])]
    steps += [("compiled-kernel step", end, row[f"compiled_{end}_ms"])
              for end in RATE_ENDS if f"compiled_{end}_ms" in row]
    published = row["published_step_ms"]
    out = []
    for verify_is, end, verify in steps:
        draft = drafts[end].step_ms
        out.append({"run": row["run"], "verify step (simulated)": verify_is,
                    "bundle rate": end, "verify ms": verify, "draft ms": draft,
                    "verify + draft ms": verify + draft, "published ms": published,
                    "(verify + draft) / published": (verify + draft) / published,
                    "tokens/s per user (simulated)": row["tau"] / (verify + draft) * 1e3})
    return out
