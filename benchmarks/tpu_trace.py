"""Profile one decode step three ways on a TPU and record what the traces show (issue 59).

`mk.measure.profiling.variants` of qwen3-0.6b (random weights, B 1, T 1, a cache of 1024
positions, the step at position 5): XLA's step, the stage kernels one pallas_call per op,
and the megakernel. Each is captured by `mk.measure.profiling.capture` (5 steps after a warm-up,
under MK_PROFILES) with libtpu's custom-call region traces on (`mk.cost.bundles.PHASE_FLAG`,
so the megakernel's `jax.named_scope`s are events of the trace). `mk.measure.profiling.trace_record`
keeps each capture's median step: its device-plane op and scope events and its summary,
small enough for data/, so notebook 08 draws a real chip's bubbles and phases without a
TPU. The record goes to data/measured/<chip>-trace.json (or $MK_MEASURED). The
megakernel's step is called without donating its cache, as notebook 08 calls it: the
trace shows the cache copies XLA then makes around the kernel.

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_trace.py

On a CPU it refuses: a CPU trace times CPU work (notebook 08 shows one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mk  # noqa: E402
from mk.kernels import backend  # noqa: E402
from mk.cost import bundles  # noqa: E402
from mk.measure import measure, profiling  # noqa: E402
from mk.model import reference  # noqa: E402

PRESET, BATCH, CONTEXT, PROMPT, STEPS = "qwen3-0.6b", 1, 1024, 5, 5


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="where the record goes")
    args = p.parse_args(argv)
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    if bundles.PHASE_FLAG not in flags:  # before jax starts libtpu (provenance, next)
        os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {bundles.PHASE_FLAG}".strip()
    made = measure.provenance()
    if made["chip"] is None:
        p.error(f"no TPU here ({made['device_kind']}): a CPU trace is not a TPU's")
    config = mk.preset(PRESET)
    params = mk.init_params(config, 0)
    prompt = jax.random.randint(jax.random.key(0), (BATCH, PROMPT), 0, config.vocab)
    _, cache = reference.prefill(config, params, prompt, max_context=CONTEXT)
    positions = jnp.full((BATCH,), PROMPT, jnp.int32)
    fns = profiling.variants(config, params, cache, prompt[:, -1:], positions)
    with backend.use("hardware"):
        captures = {name: profiling.capture(fn, steps=STEPS, name=f"{PRESET}-{name}")
                    for name, fn in fns.items()}
    timelines = {name: profiling.timeline(c.path) for name, c in captures.items()}
    record = made | dict(label=f"measured on {made['device_kind']}", model=PRESET,
                         batch=BATCH, rows=1, context=CONTEXT, position=PROMPT,
                         libtpu_flags=os.environ["LIBTPU_INIT_ARGS"])
    record |= profiling.trace_record(timelines)
    path = args.json or measure.MEASURED / f"{made['chip']}-trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n", encoding="utf-8")
    for name, v in record["variants"].items():
        print(name, json.dumps(v["summary"]), f"{len(v['ops'])} events", flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
