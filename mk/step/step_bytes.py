"""The bytes one device's decode step moves, by byte family.

A byte family is a `mk.model.weights.FAMILIES` row's `family` (attention, experts, lm_head, the
norms, ...) for a weight, and one of `STEP_FAMILIES` for the step's other DMAs (KV rows,
the linear layers' states); `family_of` names the family of a DMA by its name, the way
`mk.step.plan`, `mk.cost.sim`, `mk.cost.machine.Simulation` and the tests sum bytes.
`shard_weight_elements` counts the weight elements of a shard (`mk.step.plan.shard_config`)
by family from its layer kinds (`Kind.streamed`), `bytes_per_element` prices them
(`local.dtype`, float32 norms, a quantised group's `mk.model.quant.tile_bytes` per element of
its tile) and `shard_weight_bytes` multiplies the two: the bytes `DecodePlan`, `mk.cost.sim`
(through the plan) and `mk.cost.perf` count. `kv_step_bytes` counts the KV DMAs of a shard by
its layer kinds (`Kind.cache_bytes`: whole KV tiles read, tile-aligned windows written
back), the bytes `mk.cost.perf` counts and the kinds' twins issue in `mk.cost.sim`. `QUANT_FAMILY`
maps a byte family to its format group. Not here: the plan and its tiling
(`mk.step.plan`), time (`mk.cost.sim`, `mk.cost.perf`).
"""

from __future__ import annotations

from mk.model import quant
from mk.model.config import DTYPE_BITS, ModelConfig, check_formats
from mk.kernels.common import BlockSizes
from mk.kinds.layers import layer_kinds
from mk.model.weights import FAMILIES, FAMILY, FORMAT_GROUP

# The byte families of one step's weights (`mk.model.weights.FAMILIES` but the embedding, whose
# rows are gathered outside the kernel); a weight's is its row's `family`.
WEIGHT_FAMILIES = tuple(f for f in FAMILIES if f != "embed")
# The step's DMAs that are not weights of the table, by byte family: a layer's norm rows
# (attn and mlp norm, q and k norm), KV rows, and the linear layers' conv and recurrent
# states (read once, written after every row).
STEP_FAMILIES = {"norms": ("norms", "qk_norms", "res_queries", "output_query"),
                 "kv_read": ("k_tile", "v_tile"), "kv_write": ("k_write_back", "v_write_back"),
                 "state_read": ("state_load", "conv_load"),
                 "state_write": ("state_rows", "conv_rows")}
# The format group (`mk.model.weights.FORMAT_GROUP`) of each byte family that holds quantisable
# weights; the router and the norms stay in their dtypes.
QUANT_FAMILY = {FAMILY[name]: group for name, group in FORMAT_GROUP.items()}


def family_of(what: str) -> str:
    """The byte family of a DMA named `what` ("wq", "we_gate[3]", "k_tile", ...)."""
    name = what.split("[")[0]
    if name in FAMILY:
        return FAMILY[name]
    for family, names in STEP_FAMILIES.items():
        if name in names:
            return family
    raise KeyError(f"no byte family holds {what!r}")


def shard_weight_bytes(local: ModelConfig, vocab: int, experts: float, formats=None,
                       block: BlockSizes | None = None) -> dict[str, float]:
    """Bytes each weight family moves in one step on one device holding `local` (a
    `shard_config`), as the kernel streams them: every matrix of the shard (widths padded
    to tiles), the lm_head's `vocab` columns (padded to tiles), the norm vectors in
    float32, `experts` active experts per MoE layer; in `local.dtype` but the families of
    `formats` ({group: mk.model.quant scheme}; default `local.formats`), whose tiles of `block`
    carry their scales (`mk.model.quant.tile_bytes`: FP4 half a byte a value and a byte of
    scale per 32). What `DecodePlan`, `mk.cost.sim` (through the plan) and `mk.cost.perf` count."""
    per = bytes_per_element(local, formats, block)
    return {f: n * per[f] for f, n in shard_weight_elements(local, vocab, experts).items()}


def bytes_per_element(local: ModelConfig, formats=None,
                       block: BlockSizes | None = None) -> dict[str, float]:
    """Bytes per weight element of each weight family (`shard_weight_bytes`)."""
    formats = check_formats(local, local.formats if formats is None else formats)
    per = {f: 4 if f == "norms" else DTYPE_BITS[local.dtype] / 8 for f in WEIGHT_FAMILIES}
    for group, scheme in formats.items():
        if block is None:
            raise ValueError(f"formats={formats}: quantised bytes need the tiling (block)")
        own = dict(block.tiles)  # an expert slot's matrices: a tile each (`model_block`)
        names = [n for k in layer_kinds(local) for n in k.segment_names()]
        tile = (block.tile_rows, block.tile_cols)

        def per_element(family: str) -> float:  # an expert's equal-sized matrices: the mean
            tiles = [own.get(n, tile) for n in names  # its own tile, else the block's
                     if FORMAT_GROUP.get(n) == group and FAMILY[n] == family] or [tile]
            return sum(quant.tile_bytes(scheme, r, c) / (r * c) for r, c in tiles) / len(tiles)

        per |= {f: per_element(f) for f, q in QUANT_FAMILY.items() if q == group}
    return per


def shard_weight_elements(local: ModelConfig, vocab: int, experts: float) -> dict[str, float]:
    """Elements of each weight family one device streams in a step (`shard_weight_bytes`):
    each layer kind's (`Kind.streamed` per layer, `Kind.once` per step: attention
    residuals' queries), the norm vectors as `mk.step.megakernel.prepare` lays them out (two of
    D and the q/k norms' two of H per layer, the final norm) and the lm_head's `vocab`
    columns."""
    D, H = local.hidden, local.head_dim
    out = dict.fromkeys(WEIGHT_FAMILIES, 0)
    out["norms"] = local.layers * 2 * (D + H) + D
    out["lm_head"] = D * vocab
    for kind in layer_kinds(local):
        for family, n in kind.streamed(experts).items():
            out[family] += len(kind.layers) * n
        for family, n in kind.once().items():
            out[family] += n
    return out


def kv_step_bytes(local: ModelConfig, batch: int, rows: int, context: int,
                  kv_tile: int) -> dict[str, float]:
    """"kv_read" and "kv_write" bytes one device holding `local` moves in a step, every
    one of `batch` sequences at `context` cached positions with `rows` new rows, over KV
    tiles of `kv_tile` positions: each layer kind's `Kind.cache_bytes` (whole tiles read,
    each tile holding new rows sending its aligned window back: more than the context's
    and the T rows' positions), what the kernel's DMAs and `mk.cost.sim`'s twins move."""
    out = {"kv_read": 0.0, "kv_write": 0.0}
    for kind in layer_kinds(local):
        for family, n in kind.cache_bytes(batch, rows, context, kv_tile).items():
            out[family] += n
    return out
