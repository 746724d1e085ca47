"""The full-attention layer kinds: grouped-query attention (`GQA`: Qwen3, and Qwen3.5's
variant with a gated output and partial RoPE), gpt-oss's variant with sinks, biases,
sliding-window layers and YaRN RoPE (`SinkGQA`) and multi-head latent attention (`MLA`:
Kimi Linear; `GatedMLA`: Kimi K3's, with an output gate), each with its simulator twin.

Both read a KV cache through `mk.kinds.attention.decode_attention.attend` (`KvStream`: a full
layer primes the next full layer's first KV tiles right after its own attention, across
the layer edge; the first full layer's at the step's start) and leave their new rows'
write-backs in flight until the step's end. GQA's prologue is
`mk.kinds.attention.attention_prologue` (wq, wk, wv, a gated model's wq_gate through the ring;
QK-norm, RoPE); MLA's is `mk.kinds.attention.mla` (its ring matrices and its DMA'd weights, the
absorbed queries), over the latent cache (one "kv head" of R + Hr values every query head reads as
its keys and values). Not here: the kernels' bodies (those modules), the loop over kinds
(`mk.step.one_layer.layer_body`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import DTYPE_BITS
from mk.kinds.attention.attention_prologue import prologue, prologue_matrices
from mk.kernels.collectives import AXIS
from mk.kernels.common import Buffer, start_dma
from mk.kinds.attention.decode_attention import (attend, attention_semaphores, block_rows,
                                         decode_attention_buffers, write_back_rows,
                                         write_back_slots)
from mk.kernels.kv_stream import (AttentionScratch, KvStream, drain_write_backs,
                                  first_kv_tile, kv_tiles, start_write_backs, tile_counts)
from mk.kinds.attention.mla import (latent_columns, low_rank_q, mla_buffers, mla_epilogue,
                            mla_matrices, mla_prologue, start_mla_loads)
from mk.kinds.base import Kind, Step, Twin

FULL_PHASES = ("prologue", "attend", "kv_prime", "wo")


class GQA(Kind):
    """Grouped-query attention over a K/V cache [L, B, K, S, H]."""

    name = "gqa"
    title = "full-attention"
    role = "mixer"
    phases = FULL_PHASES
    stream_phase = "prologue"
    skip_tag = "skipped mixer"

    def kv_layout(self) -> tuple[int, int, int]:
        """(heads, row width, caches) of one layer's cache on a device."""
        return self.config.kv_heads, self.config.head_dim, 2

    def matrices(self, M: int) -> list:
        c = self.config
        return prologue_matrices(c, self.name) + [("wo", c.q_width, c.hidden)]

    def attention_buffers(self, batch: int, rows: int, block) -> list:
        K, H, caches = self.kv_layout()
        return decode_attention_buffers(batch, rows, self.config.heads, K, H,
                                        self.config.dtype, block, latent=caches == 1)

    def buffers(self, batch: int, rows: int, block) -> list:
        c, M, f32 = self.config, batch * rows, "float32"
        own = [Buffer("q", (M, c.q_width), f32), Buffer("k", (M, c.kv_width), f32),
               Buffer("v", (M, c.kv_width), f32), Buffer("o", (M, c.q_width), f32)]
        if "wq_gate" in self.weights():  # Qwen3.5's output gate
            own.append(Buffer("q_gate", (M, c.q_width), f32))
        return own + self.attention_buffers(batch, rows, block)

    def scratch(self, batch: int, rows: int, block) -> dict:
        return {"attention": attention_semaphores(block, batch, caches=self.kv_layout()[2])}

    def caches(self, k: Step):
        """The HBM caches its `attend` reads and writes (keys, values)."""
        return k.outputs["k_cache"], k.outputs["v_cache"]

    def cache_operands(self, cache) -> dict:
        return dict(k_cache=cache.k, v_cache=cache.v)

    def cache_fields(self, out) -> dict:
        return dict(k=out["k_cache"], v=out["v_cache"])

    @staticmethod
    def attention(k: Step) -> AttentionScratch:
        """`attend`'s scratch (the "attention" group)."""
        return AttentionScratch(**k.groups["attention"])

    def _kv_stream(self, k: Step, layer) -> KvStream:
        return KvStream(k.positions, *self.caches(k), self.attention(k), rows=k.rows,
                        layer=layer, block=k.block)

    def start(self, k: Step) -> None:
        start_write_backs(self.attention(k))
        self._kv_stream(k, k.first_row).prime()  # each full layer primes the next one's

    def run(self, k: Step, phase: str) -> None:
        row = k.row(self)(k.step)
        if phase == "prologue":
            self.prologue(k, row)
        elif phase == "attend":  # its first KV tiles were primed
            self.attend(k, row)
        elif phase == "kv_prime" and k.prime_next:  # the next full layer's first KV
            @pl.when(row + 1 < self.caches(k)[0].shape[0])  # tiles need only the
            def prime():  # positions: they load across the layer edge, behind this
                self._kv_stream(k, row + 1).prime()  # layer's weight tiles
        elif phase == "wo":
            self.output(k)
            k.ring.matmul("wo", k.s.o, k.s.attn_out, layer=k.step)

    def prologue(self, k: Step, row) -> None:
        s, (attn_norm, _, q_norm, k_norm) = k.s, k.norms
        weights = self.weights()
        if "q_norm" not in weights:  # the tables hold ones; RMSNorm by ones is not identity
            q_norm = k_norm = None
        prologue(k.ring, self.config, layer=k.step, x=k.x, attn_norm=attn_norm, q_norm=q_norm,
                 k_norm=k_norm, positions_smem=k.positions, batch=k.batch, rows=k.rows,
                 h_vmem=s.h, q_vmem=s.q, k_vmem=s.k, v_vmem=s.v,
                 gate_vmem=s.q_gate if "wq_gate" in weights else None)

    def attend(self, k: Step, row) -> None:
        s = k.s
        attend(s.q, s.k, s.v, k.positions, *self.caches(k), s.o, self.attention(k), layer=row,
               block=k.block, primed=True)

    def output(self, k: Step) -> None:
        """s.o as wo reads it: Qwen3.5's gate, o * sigmoid(h @ wq_gate)."""
        if "wq_gate" in self.weights():
            k.s.o[...] = k.s.o[...] * jax.nn.sigmoid(k.s.q_gate[...])

    def finish(self, k: Step) -> None:
        drain_write_backs(self.attention(k), *self.caches(k))

    def twin(self, sim) -> AttentionTwin:
        return AttentionTwin(self, sim)

    # -- Its cost (`mk.cost.perf`)
    def mixing_flops(self, batch: int, rows: int, context: int) -> float:
        """Row t of T attends to the S cached positions plus new rows 0..t: T*S + T(T+1)/2
        pairs per sequence, each 2 FLOPs per cache row value for q.k and 2 for p.v."""
        pairs = batch * (rows * context + rows * (rows + 1) / 2)
        return 4.0 * self.config.heads * self.kv_layout()[1] * pairs

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: none; `SinkGQA`'s sliding layers have one)."""
        return 0

    def kv_dma_bytes(self, positions: int) -> int:
        """Bytes of one DMA of `positions` rows of one of its caches (K or V, or MLA's
        latent rows) on a device: a KV tile (`kv_tile` rows) or a write-back window
        (`write_back_rows`). The twin issues these; `cache_bytes` sums them."""
        K, H, _ = self.kv_layout()
        return K * positions * H * (self.config.weight_bits // 8)

    def cache_bytes(self, batch: int, rows: int, context: int, kv_tile: int) -> dict:
        """What its layers' KV DMAs move in a step on one device, every sequence at
        `context` (`Kind.cache_bytes`), as the kernel moves them: "kv_read", each
        sequence's whole KV tiles of each layer (`tile_counts`: tiles 0, or a sliding
        layer's first in its window, to the one holding the last new row; a tile's
        positions past the last row are read too, and masked), "kv_write", each tile
        holding new rows sending its tile-aligned window of `write_back_rows` rows back
        (a window's rows besides the T new ones are written too, unchanged)."""
        _, _, caches = self.kv_layout()
        read = written = 0
        for layer in self.layers:
            r, w = tile_counts([context], rows, kv_tile, self.window(layer))
            read, written = read + r, written + w
        W = write_back_rows(rows, kv_tile, self.config.dtype)
        return {"kv_read": batch * caches * read * self.kv_dma_bytes(kv_tile),
                "kv_write": batch * caches * written * self.kv_dma_bytes(W)}

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """Its projections, then attention: per sequence and kv head, G*T query rows (in
        whole 8-row sublanes) against the S + T positions, twice (q.k and p.v). MLA: every
        head against one latent row of R + Hr."""
        K, H, _ = self.kv_layout()
        attention_rows = -(-self.config.heads // K * rows // 8) * 8  # G*T rows in sublanes
        return super().mxu_passes(batch, rows, context, touched) + [
            (attention_rows, 2 * batch * K * H * (context + rows), 1)]

    def conventional(self, e) -> list:
        """QKV, QK-norm+RoPE, attention over its share of the KV bytes, the output
        projection (MLA: costed by the same widths)."""
        c, m, layers = self.config, e.batch * e.rows, len(self.layers)
        D, q, kv = c.hidden, c.q_width, c.kv_width
        q_cols = q * (2 if "wq_gate" in self.weights() else 1)  # with the gate
        qkv_share = (D * (q_cols + 2 * kv)) / (D * (q_cols + q + 2 * kv))
        weights = e.attention_bytes / layers
        return [("qkv", weights * qkv_share, 2 * m * D * (q_cols + 2 * kv),
                 [D, q_cols + 2 * kv]),
                ("qk_norm_rope", 0, 0, [2 * (q + kv)]),
                ("attention", e.kv_bytes / layers,
                 self.mixing_flops(e.batch, e.rows, e.context), [q + 2 * kv, q]),
                ("wo", weights * (1 - qkv_share), 2 * m * q * D, [q, D])]


class SinkGQA(GQA):
    """gpt-oss's attention: GQA without QK-norm, with biases on q, k, v and o, a learned
    sink logit per head (`attend(..., sinks=)`), a sliding window on its sliding layers
    (`attend(..., window=)`: only the window's KV tiles come in) and YaRN RoPE (the
    prologue's `rope_rows`). Its vectors (the biases and the sinks, its DMA'd weights) are
    DMA'd at each of its layers' start and waited for at first use; its layers' windows
    are an SMEM table (by its row) written at the step's start. At tp > 1 the device
    holding the first shard adds o's bias (the others' partial sums have none)."""

    name = "sink_gqa"
    title = "sink-attention"

    def buffers(self, batch: int, rows: int, block) -> list:
        return super().buffers(batch, rows, block) + self.dma_buffers()

    def scratch(self, batch: int, rows: int, block) -> dict:
        return super().scratch(batch, rows, block) | {"layer": {
            "sink_sems": pltpu.SemaphoreType.DMA((len(self.weights("dma")),)),
            "windows_smem": pltpu.SMEM((len(self.layers),), jnp.int32)}}

    def setup(self, k: Step) -> None:
        for row, layer in enumerate(self.layers):  # static: a few scalar stores
            k.s.windows_smem[row] = self.config.window(layer)

    def _kv_stream(self, k: Step, layer) -> KvStream:
        return KvStream(k.positions, *self.caches(k), self.attention(k), rows=k.rows,
                        layer=layer, block=k.block, window=k.s.windows_smem[layer])

    def load(self, k: Step, name: str):
        """The copy of this layer's vector `name` (to start, or to wait for)."""
        return pltpu.make_async_copy(k.inputs[name].at[k.row(self)(k.step)],
                                     getattr(k.s, name),
                                     k.s.sink_sems.at[self.weights("dma").index(name)])

    def vector(self, k: Step, name: str):
        """Vector `name` of this layer, after waiting for its copy."""
        self.load(k, name).wait()
        return getattr(k.s, name)[...]

    def begin(self, k: Step) -> None:
        for name in self.weights("dma"):
            ref = getattr(k.s, name)
            start_dma(self.load(k, name), name, ref.size * ref.dtype.itemsize)

    def prologue(self, k: Step, row) -> None:
        s = k.s
        biases = ((lambda name: self.vector(k, f"b{name}")) if self.config.attention_bias
                  else None)
        prologue(k.ring, self.config, layer=k.step, x=k.x, attn_norm=k.norms[0], q_norm=None,
                 k_norm=None, positions_smem=k.positions, batch=k.batch, rows=k.rows,
                 h_vmem=s.h, q_vmem=s.q, k_vmem=s.k, v_vmem=s.v, biases=biases)

    def attend(self, k: Step, row) -> None:
        s = k.s
        attend(s.q, s.k, s.v, k.positions, *self.caches(k), s.o, self.attention(k), layer=row,
               block=k.block, primed=True, sinks=self.vector(k, "sinks"),
               window=s.windows_smem[row])

    def run(self, k: Step, phase: str) -> None:
        super().run(k, phase)
        if phase == "wo" and self.config.attention_bias:  # once over the devices' sums
            bias = self.vector(k, "bo").astype(jnp.float32)
            if k.tp > 1:
                bias = jnp.where(lax.axis_index(AXIS) == 0, bias, 0.0)
            k.s.attn_out[...] = k.s.attn_out[...] + bias

    def twin(self, sim) -> SinkTwin:
        return SinkTwin(self, sim)

    def window(self, layer: int) -> int:
        return self.config.window(layer)

    # -- Its cost (`mk.cost.perf`): a sliding layer attends to at most its window
    def mixing_flops(self, batch: int, rows: int, context: int) -> float:
        """GQA's, a sliding layer's over min(context, window) cached positions; the mean
        over its layers (`mk.cost.perf` counts it once per layer)."""
        c = self.config
        return sum(super(SinkGQA, self).mixing_flops(
            batch, rows, min(context, c.window(layer) or context))
            for layer in self.layers) / len(self.layers)


class MLA(GQA):
    """Multi-head latent attention over the latent cache [La, B, S, R + Hr] (passed to
    `attend` as one shared kv head [La, B, 1, S, W]); the narrow weights (its DMA'd ones)
    are DMA'd whole at the layer's start, wkv_a's columns padded to whole tiles."""

    name = "mla"
    title = "MLA"

    def kv_layout(self) -> tuple[int, int, int]:
        return 1, self.config.latent_width, 1

    def matrices(self, M: int) -> list:
        return mla_matrices(self.config, self.name)

    def buffers(self, batch: int, rows: int, block) -> list:
        return (mla_buffers(self.config, batch * rows) + self.dma_buffers()
                + self.attention_buffers(batch, rows, block))

    def scratch(self, batch: int, rows: int, block) -> dict:
        return super().scratch(batch, rows, block) | {
            "layer": {"mla_sems": pltpu.SemaphoreType.DMA((len(self.weights("dma")),))}}

    def caches(self, k: Step):
        return k.outputs["latent_cache"], None

    def cache_operands(self, cache) -> dict:  # [La, B, S, W] as one shared "kv head"
        return dict(latent_cache=cache.latent[:, :, None])

    def cache_fields(self, out) -> dict:
        return dict(latent=out["latent_cache"][:, :, 0])

    def prepare(self, params) -> dict:
        """wkv_a's columns padded to whole tiles (the low-rank norms are the base's float32
        rows: no norm_offset, MLA's norms have none)."""
        weights = super().prepare(params)
        pad = latent_columns(self.config) - self.config.latent_width
        weights["wkv_a"] = jnp.pad(weights["wkv_a"], ((0, 0), (0, 0), (0, pad)))
        return weights

    def prologue(self, k: Step, row) -> None:
        loads = start_mla_loads(k.s, {n: k.inputs[n] for n in self.weights("dma")}, row)
        mla_prologue(k.ring, self.config, k.s, loads, layer=k.step, x=k.x,
                     attn_norm=k.norms[0])

    def attend(self, k: Step, row) -> None:  # the latent rows are the keys and the values
        s = k.s
        attend(s.queries, s.latent_new, None, k.positions, self.caches(k)[0], None,
               s.o_latent, self.attention(k), layer=row, block=k.block, primed=True,
               scale=1 / math.sqrt(self.config.head_dim))  # the unabsorbed head's

    def output(self, k: Step) -> None:
        mla_epilogue(self.config, k.s)

    def twin(self, sim) -> MLATwin:
        return MLATwin(self, sim)


class GatedMLA(MLA):
    """Kimi K3's MLA: each head's output times sigmoid(h @ wg) before wo (h: the layer's
    normed rows; `mk.model.reference.output_gate`). wg [D, N*Ho] streams through the ring after
    wkv_a; its product is taken at the prologue's end, the gate applied after the value
    up-projection."""

    name = "gated_mla"
    title = "gated-MLA"

    def buffers(self, batch: int, rows: int, block) -> list:
        c = self.config
        return super().buffers(batch, rows, block) + [
            Buffer("o_gate", (batch * rows, c.heads * c.value_dim), "float32")]

    def prologue(self, k: Step, row) -> None:
        super().prologue(k, row)
        k.ring.matmul("wg", k.s.h, k.s.o_gate, layer=k.step)

    def output(self, k: Step) -> None:
        super().output(k)
        k.s.o[...] = k.s.o[...] * jax.nn.sigmoid(k.s.o_gate[...])

    def twin(self, sim) -> GatedMLATwin:
        return GatedMLATwin(self, sim)


class AttentionTwin(Twin):
    """A full layer on the simulator: its KV stream (`KvStream`: every sequence at
    `sim.context`), the prologue's matrices and vector work, attention's per-tile MXU and
    vector cost, the write-backs (waited for when their staging slot comes round and at
    the step's end), wo."""

    def __init__(self, kind: GQA, sim):
        super().__init__(kind, sim)
        self.landed: dict[int, float] = {}  # KV tile j of the attending layer -> landed
        self.sent: list[float] = []  # when each KV write-back of the step lands

    def start(self) -> None:
        self.prime(self.kind.layers[0], "step start")

    def boundary(self) -> None:
        self.prime(self.sim.layer, "layer boundary")

    def finish(self) -> None:  # `drain_write_backs`
        if self.sent:
            self.sim.mc.wait(max(self.sent[-write_back_slots(self.sim.batch):]))

    def run(self, phase: str) -> None:
        sim, c = self.sim, self.kind.config
        M = sim.m
        if phase == "prologue":
            sim.vector(4 * M * c.hidden, "norm")
            self.prologue()
        elif phase == "attend":
            self.attend()
        elif phase == "kv_prime":  # without cross-layer prefetch, at the layer's start
            later = [layer for layer in self.kind.layers if layer > sim.layer]
            if later and sim.prefetch:
                self.prime(later[0])
        elif phase == "wo":
            self.output()
            sim.matmul("wo")

    def prologue(self):
        """`prologue`: wq, wk, wv (and wq_gate) through the ring (each followed by
        `projected`), QK-norm and RoPE."""
        sim, c = self.sim, self.kind.config
        for matrix, *_ in self.kind.matrices(sim.m)[:-1]:
            sim.matmul(matrix)
            self.projected(matrix)
        sim.vector(10 * sim.m * (c.q_width + c.kv_width), "qk_norm_rope")

    def projected(self, matrix: str) -> None:
        """After the prologue's matmul of `matrix`."""

    def output(self):
        """Qwen3.5's output gate before wo."""
        if "wq_gate" in self.kind.weights():
            self.sim.vector(4 * self.sim.m * self.kind.config.q_width, "output_gate")

    def window(self, layer) -> int:
        """Layer `layer`'s sliding window (0: none): its kind's."""
        return self.kind.window(layer)

    def tiles(self, layer=None) -> list[tuple[int, int]]:
        """(sequence, tile) of every KV tile layer `layer`'s attention reads (default the
        current one's), in order."""
        sim = self.sim
        layer = sim.layer if layer is None else layer
        tile, window = sim.s.block.kv_tile, self.window(layer)
        first = first_kv_tile(sim.context, tile, window)
        return [(b, i) for b in range(sim.batch)
                for i in range(first, first + kv_tiles(sim.context, sim.rows, tile, window))]

    def issue(self, j, tag="", layer=None):
        """KV tile j of the attending layer (`layer`, default the current one)."""
        sim, tile = self.sim, self.sim.s.block.kv_tile
        layer = sim.layer if layer is None else layer
        if j < len(self.tiles(layer)):
            caches, kv_bytes = self.kind.kv_layout()[2], self.kind.kv_dma_bytes(tile)
            self.landed[j] = max(sim.mc.dma(kv_bytes, layer, what, tag, False)
                                 for what in ("k_tile", "v_tile")[:caches])

    def prime(self, layer, tag=""):
        """Full layer `layer`'s first kv_slots - 1 KV tiles (`KvStream.prime`)."""
        self.landed = {}
        for j in range(self.sim.s.block.kv_slots - 1):
            self.issue(j, tag, layer)

    def attend(self):
        sim, c = self.sim, self.kind.config
        B, T, block = sim.batch, sim.rows, sim.s.block
        (K, H, caches), tile = self.kind.kv_layout(), block.kv_tile
        G = c.heads // K
        R = block_rows(G, T)
        W = write_back_rows(T, tile, c.dtype)
        sim.vector(3 * B * T * (c.heads + caches * K) * H, "attention")  # regrouping
        mxu = 2 * sim.mxu_s(R, tile * H * K)  # q.k and p.v
        vec = 8 * K * R * tile / sim.vpu
        a = sim.a  # a measured loop (`mk.cost.calibration`): no faster than its KV rate
        per_tile = max(mxu + vec, caches * self.kind.kv_dma_bytes(tile) / a.kv_bytes_per_s
                       if a.kv_bytes_per_s else 0.0)
        tiles = self.tiles()
        for j, (b, i) in enumerate(tiles):
            self.issue(j + block.kv_slots - 1)
            if a.sequence_s and (j == 0 or tiles[j - 1][0] != b):
                sim.mc.compute(a.sequence_s, sim.layer, "attention")
            sim.mc.wait(self.landed.pop(j))
            sim.mc.compute(per_tile, sim.layer, "attention")
            if i >= sim.context // tile:  # written: its staging slot is free once
                n, backs = len(self.sent), write_back_slots(B)  # write-back n - 2B landed
                if n >= backs:
                    sim.mc.wait(self.sent[n - backs])
                self.sent.append(max(sim.mc.dma(self.kind.kv_dma_bytes(W), sim.layer,
                                                f"{kv}_write_back", weight=False)
                                     for kv in "kv"[:caches]))
        sim.vector(3 * B * T * c.heads * H, "attention")



class SinkTwin(AttentionTwin):
    """A gpt-oss attention layer on the simulator: its vectors DMA'd at the layer's start
    and waited for at first use, its sliding layers' KV tiles only their window's."""

    def begin(self) -> None:
        sim = self.sim
        self.loads = {b.name: sim.mc.dma(math.prod(b.shape) * DTYPE_BITS[b.dtype] / 8,
                                         sim.layer, b.name) for b in self.kind.dma_buffers()}

    def projected(self, matrix: str) -> None:  # q, k, v: their bias waited for, added
        if self.kind.config.attention_bias:
            self.sim.mc.wait(self.loads["b" + matrix[1:]])

    def attend(self):
        self.sim.mc.wait(self.loads["sinks"])
        super().attend()

    def run(self, phase: str) -> None:
        super().run(phase)
        if phase == "wo" and self.kind.config.attention_bias:  # after wo, o's bias
            self.sim.mc.wait(self.loads["bo"])


class MLATwin(AttentionTwin):
    """An MLA layer on the simulator: its prologue and its value up-projection."""

    def output(self):  # each head's P @ latent rows times its W_uv
        sim, c = self.sim, self.kind.config
        sim.mc.compute(sim.mxu_s(sim.m, c.latent_rank * c.value_dim * c.heads), sim.layer,
                       "mla_up")

    def prologue(self):
        """`mk.kinds.attention.mla.mla_prologue`: the layer's DMA'd weights issued at its start,
        wq_a, its norm and the DMA'd wq (or wq through the ring), wkv_a and the latent's norm,
        each load waited for at first use; the absorption of each head's query (float32,
        at the MXU rule, as wq's product in VMEM)."""
        sim, c = self.sim, self.kind.config
        M = sim.m
        # issued at the layer's start, waited for in the order the kernel uses them
        landed = iter([sim.mc.dma(math.prod(b.shape) * DTYPE_BITS[b.dtype] / 8, sim.layer,
                                  b.name) for b in self.kind.dma_buffers()])
        if low_rank_q(c):
            sim.matmul("wq_a")
            sim.mc.wait(next(landed))  # q_a's norm
            sim.vector(4 * M * c.q_rank, "norm")
            sim.mc.wait(next(landed))  # wq
            sim.mc.compute(sim.mxu_s(M, c.q_rank * c.q_width), sim.layer, "wq")
        else:
            sim.matmul("wq")
        sim.matmul("wkv_a")
        sim.mc.wait(next(landed))  # the latent's norm
        sim.vector(4 * M * c.latent_rank, "norm")
        sim.mc.wait(next(landed))  # the up-projection W_uk | W_uv
        sim.mc.compute(sim.mxu_s(M, (c.head_dim - c.rope_dim) * c.latent_rank * c.heads),
                       sim.layer, "mla_absorb")


class GatedMLATwin(MLATwin):
    """A gated MLA layer on the simulator: MLA's, wg through the ring at the prologue's end,
    the gate's sigmoid and product after the value up-projection."""

    def prologue(self):
        super().prologue()
        self.sim.matmul("wg")

    def output(self):
        super().output()
        c = self.kind.config
        self.sim.vector(4 * self.sim.m * c.heads * c.value_dim, "output_gate")
