"""How far a rounding-sized change moves a random model's prefill logits, on the CPU: why
`mk.model.checkpoint.pin_routes` exists (issue 60).

The reference's prefill of an 8-token prompt (random weights of seed 0 in the model's real
shapes, `--formats` as `mk.init_params` takes them) runs twice: as it is, and with the
config's rms_eps times `--eps-factor` (1.1: about a 1e-6 relative change of every normed
row). It prints each position's greedy token both ways, the largest logit change and the
last position's top-2 gap. With a biased router's routes drawn, gpt-oss-20b's first token
changes (its logits by up to 100, at a std of 54): an expert choice flips and every later
layer parts. `--pinned` pins the routes first (`pin_routes`). A CPU's numbers, not a chip's.

    python benchmarks/route_chaos.py --preset gpt-oss-20b --formats experts=fp4 [--pinned]

About 4 minutes a prefill at gpt-oss-20b on two cores, 13.3 GiB of host memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import mk  # noqa: E402
from mk.model import checkpoint, reference  # noqa: E402
from mk.model.config import finite_number  # noqa: E402

PROMPT, CONTEXT = 8, 1024  # benchmarks/tpu_models.py's prompt and cache capacity


def prefill_logits(config, formats: dict, pinned: bool) -> np.ndarray:
    """The reference's prefill logits [P, V] of the prompt (batch 1) on random weights."""
    params = mk.init_params(config, 0, formats)
    if pinned:
        params = checkpoint.pin_routes(config, params)
    prompt = np.random.default_rng(0).integers(0, config.vocab, (1, PROMPT))
    logits, _ = jax.jit(lambda p, t: reference.prefill(
        config, p, t, max_context=CONTEXT, quantised=True))(params, prompt)
    return np.asarray(logits[0])


def sensitivity(preset: str, formats: dict, pinned: bool, eps_factor: float) -> dict:
    """Both prefills' tokens, the largest logit change, the logits' std and each run's
    last top-2 gap."""
    config = mk.preset(preset)
    eps_factor = finite_number("eps_factor", eps_factor, 0.0, open_low=True)
    plain = prefill_logits(config, formats, pinned)
    moved = prefill_logits(dataclasses.replace(config, rms_eps=config.rms_eps * eps_factor),
                           formats, pinned)

    def gap(x):
        top = np.sort(x[-1])
        return float(top[-1] - top[-2])

    return dict(tokens=plain.argmax(-1).tolist(), moved_tokens=moved.argmax(-1).tolist(),
                max_change=float(np.abs(plain - moved).max()), std=float(plain.std()),
                gap=gap(plain), moved_gap=gap(moved))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--formats", nargs="*", default=["experts=fp4"],
                   help="group=scheme pairs, as mk.init_params takes them")
    p.add_argument("--pinned", action="store_true", help="pin a biased router's routes")
    p.add_argument("--eps-factor", type=float, default=1.1)
    args = p.parse_args(argv)
    pairs = [f.split("=", 1) for f in args.formats]
    if any(len(pair) != 2 for pair in pairs):
        p.error(f"--formats {args.formats}: each must be group=scheme")
    out = sensitivity(args.preset, dict(pairs), args.pinned, args.eps_factor)
    print(f"{args.preset}, routes {'pinned' if args.pinned else 'drawn'}, rms_eps x "
          f"{args.eps_factor:g} (CPU): tokens {out['tokens']} -> {out['moved_tokens']}; "
          f"largest logit change {out['max_change']:.2f} (std {out['std']:.1f}); last top-2 "
          f"gap {out['gap']:.2f} -> {out['moved_gap']:.2f}")


if __name__ == "__main__":
    main()
