"""What the compiled kernel costs per weight tile, read from libtpu's own bundle dump.

libtpu writes each compiled kernel's final VLIW program when `LIBTPU_INIT_ARGS` holds
`--xla_jf_dump_to=DIR` (internal, may change; `../shared/PLATFORM.md`): one bundle per
line, `LB:` where a loop body starts, `>` once per loop level. One bundle issues per clock
cycle, and the megakernel's per-tile loop (`mk.kernels.ring.Ring.matmul`: one trip = one
weight tile) has a static trip count, so bundles per trip / the chip's clock is the time
one tile keeps the TensorCore busy, before any stall: a lower bound on the compute lane's
time per tile, which must stay below the tile's DMA time for HBM never to idle.

Here: `Loop` (one loop body: bundles, MXU and scalar-only bundles, the DMAs it issues and
waits for), `loops(text)` (every loop of a dump), `tile_loops(loops, tile_bytes)` (the ring's
per-tile loops: each issues weight tiles of `tile_bytes` and runs the MXU, and none runs the
EUP, which attention's softmax does), and `measure(config, chip, ...)` -> `TileCost`, which
compiles the megakernel in a subprocess with the dump on (libtpu reads its flags once per
process) and reads it back.

Not here: the compile itself (`mk.tpu.compile_megakernel`), what a tile's DMA time is
(`mk.chips`: bandwidth; `mk.sim`: latency), cycle-accurate timing (branches skip predicated
regions, so bundles per trip bound one trip's issue time from above when the body branches,
and stalls on DMA waits or the MXU's result FIFO are not in the count).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import re
import subprocess
import sys
import tempfile

import jax.numpy as jnp

from mk.chips import ChipSpec, chip as chip_spec
from mk.config import ModelConfig
from mk.kernels.common import BlockSizes
from mk.kernels.plan import DecodePlan
from mk.sim import Assumptions
from mk.tpu import CompileReport

GRANULE_BYTES = 32  # a DMA's size_in_granules unit (a 512 x 512 bf16 tile is 16384)
_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s+(LB:|LH:|LE:|CT:|PB:|PF:)?\s*:?\s*(>*)\s*"
                     r"\{(.*)\}")
_OP = re.compile(r"=\s*([a-z][a-z0-9_.]*)")
_GRANULES = re.compile(r"size_in_granules=\*/\s*(\d+)")


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop body of a bundle dump (its own level; nested loops are counted apart)."""

    first: int  # index of its first bundle in the dump
    depth: int  # 1 = outermost loop
    bundles: int  # bundles at this level: one trip's issue cycles, nested loops excluded
    mxu: int  # bundles that drive the MXU (push weights, multiply, pop results)
    scalar_only: int  # bundles with only scalar-unit work (address arithmetic, branches)
    dma_granules: tuple[int, ...]  # the size of each DMA the body issues
    waits: int  # DMA waits in the body
    eup: int  # bundles using the EUP (exp, rsqrt: softmax and norms, never a weight tile)
    nested: int  # loops inside it


def loops(text: str) -> list[Loop]:
    """Every loop of one kernel's `final_bundles.txt` text, in program order."""
    rows = []  # (marker, depth, ops, granules); an empty bundle `{}` carries no depth
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if m:
            mark, depth, body = m.groups()
            rows.append((mark, len(depth) if body.strip() else None, _OP.findall(body),
                         [int(g) for g in _GRANULES.findall(body)]))
    found = []
    for i, (mark, d, _, _) in enumerate(rows):
        if mark != "LB:" or not d:
            continue
        end = i + 1  # one past the last bundle of the body
        for j in range(i + 1, len(rows)):
            mark_j, d_j, _, _ = rows[j]
            if d_j is None:
                continue
            if d_j < d or (mark_j == "LB:" and d_j == d):
                break
            end = j + 1
        body = rows[i:end]
        own = [r for r in body if r[1] in (d, None)]
        found.append(Loop(
            first=i, depth=d, bundles=len(own),
            mxu=sum(any(o.startswith("vmat") or "mxu" in o or o.endswith(".mrb")
                        for o in r[2]) for r in own),
            scalar_only=sum(bool(r[2]) and not any(o.startswith(("v", "dma")) for o in r[2])
                            for r in own),
            dma_granules=tuple(g for r in own for g in r[3]),
            waits=sum(o == "dma.done.wait" for r in own for o in r[2]),
            eup=sum(any("eup" in o for o in r[2]) for r in own),
            nested=sum(r[0] == "LB:" and r[1] == d + 1 for r in body)))
    return found


def tile_loops(found: list[Loop], tile_bytes: int) -> list[Loop]:
    """The ring's per-tile loops among `found`: they issue weight tiles of `tile_bytes`
    and only those, drive the MXU, and never the EUP."""
    granules = tile_bytes // GRANULE_BYTES
    return [lp for lp in found if lp.dma_granules and set(lp.dma_granules) == {granules}
            and lp.mxu and not lp.eup and not lp.nested]


@dataclasses.dataclass(frozen=True)
class TileCost:
    """The per-tile loops of one compiled megakernel and what they cost on its chip.

    `Ring.matmul` runs two loops per matrix: the steady one issues the matrix's own next
    tile, the edge one (a matrix's last `slots` tiles) looks up which of the segments that
    can follow holds the next tile. The costliest loop bounds every tile.
    """

    report: CompileReport  # the compile's (the dump costs it a little time)
    tile_bytes: int  # one weight tile (tile_rows x tile_cols x the weight's itemsize)
    loops: tuple[Loop, ...]  # the per-tile loops, in program order; () if not compiled
    clock_hz: float
    dma_bw: float  # one core's HBM bandwidth, bytes/s

    @property
    def worst(self) -> Loop:
        """The costliest per-tile loop."""
        if not self.loops:
            raise ValueError(f"{self.report.name} on {self.report.chip} did not compile: "
                             f"{self.report.error.splitlines()[0] if self.report.error else ''}")
        return max(self.loops, key=lambda lp: lp.bundles)

    @property
    def tile_s(self) -> float:
        """Seconds one tile keeps the TensorCore issuing (the costliest loop): bundles /
        clock."""
        return self.worst.bundles / self.clock_hz

    @property
    def dma_s(self) -> float:
        """Seconds one tile's DMA takes at the core's HBM bandwidth (latency not counted)."""
        return self.tile_bytes / self.dma_bw

    def assumptions(self, **kw) -> Assumptions:
        """`mk.sim.Assumptions` with this per-tile cost (and any other field in kw)."""
        return Assumptions(tile_issue_s=self.tile_s, **kw)

    def row(self) -> dict:
        """One row of a table: bundles per trip (the range over the per-tile loops; the
        costliest one's MXU and scalar-only bundles and DMA sites), issue against DMA time
        per tile."""
        worst = self.worst
        return dict(kernel=self.report.name, chip=self.report.chip,
                    tile_KiB=self.tile_bytes / 1024,
                    tile_loops=len(self.loops),
                    bundles_per_tile=f"{min(lp.bundles for lp in self.loops)}-{worst.bundles}",
                    mxu_bundles=worst.mxu, scalar_only_bundles=worst.scalar_only,
                    dma_sites=len(worst.dma_granules), tile_ns=self.tile_s * 1e9,
                    dma_ns=self.dma_s * 1e9, tile_over_dma=self.tile_s / self.dma_s,
                    compile_s=self.report.compile_seconds)


def _kernel_dump(folder: str) -> str:
    """The megakernel's final bundles among a dump folder's files."""
    paths = [p for p in glob.glob(os.path.join(folder, "*final_bundles.txt"))
             if "mk_megakernel" in os.path.basename(p)
             and "schedule-analysis" not in os.path.basename(p)]
    if not paths:
        raise RuntimeError(f"libtpu wrote no megakernel bundles under {folder} (the dump "
                           "flag --xla_jf_dump_to is internal and may have changed)")
    return max(paths, key=os.path.getsize)


def measure(config: ModelConfig, chip: str | ChipSpec, *, tp: int = 1,
            topology: str | None = None, batch: int = 1, rows: int = 1,
            context: int = 4096, block: BlockSizes | None = None,
            timeout: float = 600.0) -> TileCost:
    """Compile `config`'s megakernel for `chip` (`mk.tpu.compile_megakernel`, same
    arguments) in a subprocess with libtpu's bundle dump on; return its report and per-tile
    loops (none if it did not compile: `TileCost.report` says why). Raises RuntimeError if
    the subprocess dies or a compiled kernel shows no per-tile loop."""
    spec = chip_spec(chip) if isinstance(chip, str) else chip
    if spec.clock_hz is None:
        raise ValueError(f"chip={spec.name!r} has no clock_hz (not a TPU)")
    kw = dict(tp=tp, topology=topology, batch=batch, rows=rows, context=context,
              block=block)
    plan = DecodePlan.make(config, tp=tp, batch=batch, rows=rows, context=context,
                           block=block, chip=spec)
    tile_bytes = plan.stream.tile_bytes * jnp.dtype(config.dtype).itemsize
    found = ()
    with tempfile.TemporaryDirectory(prefix="mk-bundles-") as folder:
        job, out = os.path.join(folder, "job.pkl"), os.path.join(folder, "report.pkl")
        with open(job, "wb") as f:
            pickle.dump((config, spec.name, kw, out), f)
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
                   LIBTPU_INIT_ARGS=(os.environ.get("LIBTPU_INIT_ARGS", "") +
                                     f" --xla_jf_dump_to={folder}/dump").strip())
        done = subprocess.run([sys.executable, "-m", "mk.bundles", job], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the compile subprocess failed:\n{done.stderr[-2000:]}")
        with open(out, "rb") as f:
            report = pickle.load(f)
        if report.ok:
            with open(_kernel_dump(f"{folder}/dump"), encoding="utf-8") as f:
                found = tuple(tile_loops(loops(f.read()), tile_bytes))
            if not found:
                raise RuntimeError(f"{report.name}: no per-tile loop of {tile_bytes} B "
                                   "tiles found in the bundle dump")
    return TileCost(report, tile_bytes, found, spec.clock_hz,
                    spec.hbm_bw / spec.cores_per_chip)


def _compile_job(job: str) -> None:
    """The subprocess's side of `measure`: compile, pickle the report."""
    from mk import tpu

    with open(job, "rb") as f:
        config, chip, kw, out = pickle.load(f)
    report = tpu.compile_megakernel(config, chip, **kw)
    with open(out, "wb") as f:
        pickle.dump(report, f)


if __name__ == "__main__":
    _compile_job(sys.argv[1])
