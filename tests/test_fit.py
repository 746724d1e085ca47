"""`DecodePlan.fits(chip, prompt=, donate=)`: the HBM peak of a whole `generate` (prefill,
preparing, decoding), checked before anything is allocated, and `mk.step.megakernel.check_fits`,
which `generate` runs on a TPU. Numbers only: the peaks they stand for are compiled for
v5e in tests/test_preparation.py and tests/test_prefill_memory.py.
"""

from types import SimpleNamespace

import pytest

import mk
from mk.step import megakernel
from mk.step.plan import DecodePlan


def _plan(name: str, **formats) -> DecodePlan:
    return DecodePlan.make(mk.preset(name), batch=1, context=1024, chip="v5e",
                           formats=formats)


def test_qwen3_4b_bf16_b1_fits_v5e_through_generate_when_its_params_are_given_up():
    plan = _plan("qwen3-4b")
    fit = plan.fits("v5e", prompt=16, donate=True)
    assert fit.ok, fit.error
    parts = dict(fit.parts)
    assert parts["prepared weights"] == pytest.approx(8.22 * 2**30, rel=0.01)
    kept = plan.fits("v5e", prompt=16, donate=False)  # the OOM seen on the chip
    assert not kept.ok
    assert kept.error == ("qwen3-4b: generate needs 15.85 GiB on v5e, has 15.75: prepared "
                          "weights 8.22, stored params (kept: donate=False) 7.49, KV cache "
                          "0.14")


def test_gpt_oss_20b_fits_v5e_through_generate_when_its_params_are_given_up():
    """Its prefill dequantises a slice of a layer's experts at a time (0.54 GiB of
    temporaries compiled for v5e; a whole layer's held 4.2 and refused it at 17.56 GiB), so
    laying the weights out is the peak: 15.67 of 15.75 GiB, a margin for a chip to judge."""
    plan = _plan("gpt-oss-20b", experts="fp4")
    assert plan.fits("v5e").ok  # the decode step: weights and KV cache, 13.36 GiB
    fit = plan.fits("v5e", prompt=16, donate=True)
    assert fit.ok, fit.error
    assert [(n, round(b / 2**30, 2)) for n, b in fit.parts] == [
        ("prepared weights", 13.32), ("largest tensor in flight while preparing", 2.31),
        ("KV cache", 0.05)]
    kept = plan.fits("v5e", prompt=16, donate=False)
    assert kept.error.startswith("gpt-oss-20b: generate needs 26.68 GiB on v5e, has 15.75: "
                                 "prepared weights 13.32, stored params (kept: donate=False)")


def test_generate_checks_the_fit_on_a_tpu_only_and_names_donate_when_it_helps():
    plan = _plan("qwen3-4b")
    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    with pytest.raises(ValueError, match="needs 15.85 GiB on v5e.*donate=True .* would fit"):
        megakernel.check_fits(plan, 16, donate=False, device=tpu)
    megakernel.check_fits(plan, 16, donate=True, device=tpu)
    megakernel.check_fits(plan, 16, donate=False, device=SimpleNamespace(platform="cpu"))
