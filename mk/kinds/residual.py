"""Kimi K3's attention residuals in the kernel: the `ResLayer` kind (kind "res_layer", the
`STREAM` role: every layer of a model with `residual_block` > 0) and its twin `ResTwin`.

The kernel carries the current block's partial sum as its residual x and keeps the
completed blocks (the embedding, then each finished block's sum: `mk.model.reference.
residual_layers`) in VMEM scratch, [ceil(L / residual_block), M, D] float32, counted in
the plan's fit. `mix`: a mixer's, an MLP's or the lm_head's input, the softmax mix of the
stored blocks it reads and x (each source scored by its RMS-normed dot with the part's
query res_norm * res_proj, folded at `prepare`, as `mk.model.ops.attention_residual`); `add`:
at a block's first layer x is stored and the mixer's output begins the next sum. The
per-layer queries travel as a vector ("res_queries" [L, 2, D], `Kind.vectors`), the
lm_head's ("output_query" [1, D]) is DMA'd at the step's start. `layer_body` and
`mk.step.megakernel` call `mix` and `add` (`mk.kinds.layers.stream_kind`). Not here: the
stage-05 kernel (`one_layer` refuses these models); tensor parallelism is not tested.
More: docs/design/mk.step.megakernel.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernels.common import Buffer, start_dma
from mk.kinds.base import STREAM, Kind, Step, Twin

F32 = jnp.float32
PARTS = ("attn", "mlp")  # the rows of a layer's "res_queries"
MIX_OPS = 8  # vector ops per source element of a mix: square, sum, dot, sum, scale, add ...


@dataclasses.dataclass(frozen=True)
class ResLayer(Kind):
    """Kimi K3's attention residuals (module docstring)."""

    name = "res_layer"
    role = STREAM
    phases = ("mlp_norm",)  # the MLP's mix (the mixer's: at the layer's start)
    stream_phase = "mlp_norm"  # it streams nothing: no region to skip
    title = "attention-residual"

    @property
    def blocks(self) -> int:
        """The completed blocks a mix can read: one per block start, ceil(L / block)."""
        c = self.config
        return -(-c.layers // c.residual_block)

    def counted(self, step, part: str):
        """How many stored blocks the `part` mix of layer `step` reads ("output": the
        lm_head's): those begun before its mixer, or by its MLP."""
        block = self.config.residual_block
        if part == "attn":
            return (step + block - 1) // block
        if part == "mlp":
            return step // block + 1
        return self.blocks

    def vectors(self) -> dict[str, int]:
        return {"res_queries": self.config.hidden}

    def operands(self) -> tuple[str, ...]:
        return ("res_queries", "output_query")

    def prepare(self, params) -> dict:
        def query(part):  # [..., D]: res_norm * res_proj, as attention_residual folds them
            return (params[f"{part}_res_norm"].astype(F32)
                    * params[f"{part}_res_proj"].astype(F32)[..., 0])
        return {"res_queries": jnp.stack([query(p) for p in PARTS], 1),
                "output_query": query("output")[None]}

    def fetch(self, k: Step) -> dict:
        return {}

    def buffers(self, batch: int, rows: int, block) -> list:
        D = self.config.hidden
        return [Buffer("residual.res_blocks", (self.blocks, batch * rows, D), "float32",
                       "residual"),
                Buffer("residual.output_query", (1, D), "float32", "residual")]

    def fit_note(self, batch: int, rows: int) -> str:
        c, M = self.config, batch * rows
        need = self.blocks * M * c.hidden * 4
        return (f" Attention residuals keep {self.blocks} completed blocks (layers="
                f"{c.layers} / residual_block={c.residual_block}, rounded up) of B*T={M} "
                f"rows x D={c.hidden} float32 in VMEM, {need / 2**20:.1f} MiB: fewer rows "
                "or a larger residual_block shrink them.")

    def scratch(self, batch: int, rows: int, block) -> dict[str, dict]:
        return {"residual": {"sem": pltpu.SemaphoreType.DMA((1,))}}

    def streamed(self, experts: float) -> dict[str, float]:
        return {"norms": 2 * self.config.hidden}  # a layer's two queries

    def once(self) -> dict[str, float]:
        return {"norms": self.config.hidden}  # the lm_head's query

    # -- In the kernel
    def _output_copy(self, k: Step):
        g = k.groups["residual"]
        return pltpu.make_async_copy(k.inputs["output_query"], g["output_query"],
                                     g["sem"].at[0])

    def setup(self, k: Step) -> None:
        k.groups["residual"]["res_blocks"][...] = jnp.zeros(
            k.groups["residual"]["res_blocks"].shape, F32)  # never-read slots stay finite

    def start(self, k: Step) -> None:
        start_dma(self._output_copy(k), "output_query", 4 * self.config.hidden)

    def mix(self, k: Step, x, part: str):
        """The `part` block's input ("output": the lm_head's) before its RMSNorm: the
        softmax mix of the stored blocks it reads and x [M, D] f32 (the partial sum)."""
        if part == "output":
            self._output_copy(k).wait()
            query = k.groups["residual"]["output_query"][...]
        else:
            row = PARTS.index(part)
            query = k.vectors["res_queries"][row:row + 1]
        stored, n = k.groups["residual"]["res_blocks"], self.counted(k.step, part)
        eps = self.config.rms_eps

        def score(v):  # [M, 1]: (RMSNorm(v) * res_norm) @ res_proj
            return jnp.sum(v * query, axis=-1, keepdims=True) * lax.rsqrt(
                jnp.mean(v * v, axis=-1, keepdims=True) + eps)

        sources = [stored[i] for i in range(self.blocks)] + [x]
        valid = [i < n for i in range(self.blocks)] + [True]
        scores = [jnp.where(ok, score(v), -jnp.inf) for v, ok in zip(sources, valid)]
        top = scores[0]
        for s in scores[1:]:
            top = jnp.maximum(top, s)
        weights = [jnp.exp(s - top) for s in scores]
        total = sum(weights[1:], weights[0])
        out = jnp.zeros_like(x)
        for v, w, ok in zip(sources, weights, valid):
            out = out + jnp.where(ok, (w / total) * v, 0.0)
        return out

    def add(self, k: Step, x, out):
        """The stream after the mixer's output `out`: at a block's first layer x (the
        partial sum) is stored as a completed block and `out` begins the next; else x +
        out."""
        block, stored = self.config.residual_block, k.groups["residual"]["res_blocks"]
        starts = k.step % block == 0

        @pl.when(starts)
        def store_completed_block():
            stored[k.step // block] = x

        return jnp.where(starts, out, x + out)

    def twin(self, sim) -> ResTwin:
        return ResTwin(self, sim)


class ResTwin(Twin):
    """Attention residuals on the simulator: the lm_head query's DMA at the step's start
    (the per-layer queries travel with the norms: `mk.cost.sim.Replay.vectors`), each mix's
    vector work over the sources it reads (the mixer's at the layer's start, the MLP's in
    its norm phase, the lm_head's at the step's end)."""

    def start(self) -> None:
        sim = self.sim
        self.output = sim.mc.dma(4 * sim.c.hidden, sim.c.layers, "output_query", "step start")

    def _mix(self, part: str, layer: int) -> None:
        sources = self.kind.counted(layer, part) + 1
        self.sim.vector(MIX_OPS * sources * self.sim.m * self.sim.c.hidden, "res_mix")

    def begin(self) -> None:
        self._mix("attn", self.sim.layer)

    def run(self, phase: str) -> None:
        self._mix("mlp", self.sim.layer)

    def finish(self) -> None:
        self.sim.mc.wait(self.output)
        self._mix("output", self.sim.c.layers)
