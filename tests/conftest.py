"""Shared fixtures: the tiny models every test runs on CPU."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Captures the tests make (mk.profiling, notebook 08) go to a folder of this run, never
# into the checkout's profiles/ (set before mk is imported; workers and notebook kernels
# inherit it).
os.environ.setdefault("MK_PROFILES", tempfile.mkdtemp(prefix="mk-test-profiles-"))

import dataclasses  # noqa: E402

import pytest  # noqa: E402

import mk  # noqa: E402


@pytest.fixture(scope="session", params=["tiny", "tiny-moe"])
def tiny_model(request):
    """(config, params) of a tiny preset with deterministic random weights (bf16)."""
    config = mk.preset(request.param)
    return config, mk.init_params(config, seed=0)


@pytest.fixture(scope="session", params=["tiny", "tiny-moe"])
def tiny_model_f32(request):
    """A tiny preset in float32: self-consistency checks then test logic, not rounding
    (in bf16 a different batch shape can flip one activation's rounding)."""
    config = dataclasses.replace(mk.preset(request.param), dtype="float32")
    return config, mk.init_params(config, seed=0)
