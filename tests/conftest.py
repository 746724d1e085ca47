"""Shared fixtures: the tiny models every test runs on CPU (with MK_TPU=1, the hardware tier
runs on the chip); and, under `--dist loadgroup`, the xdist_group suffix that keeps a
group on one worker under pytest 9 and the order that hands the workers the longest tests
first."""

import os
import tempfile

CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                     "--xla_llvm_disable_expensive_passes=true",
                     "--xla_cpu_use_fusion_emitters=false")
# The CPU suite runs on the CPU even on a TPU machine; MK_TPU=1 (`make test-tpu`) leaves the
# chip to the hardware tier (tests/test_tpu.py).
if os.environ.get("MK_TPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Interpret-mode tests spend most of their time in XLA:CPU's compiler (a tiny model's
    # greedy-token test: 28 of 47 s in backend_compile, 48 programs), little running. LLVM
    # at -O0 without its expensive passes cuts the suite's CPU time by about a fifth; it
    # changes no arithmetic (fast math stays off), so every compared number is the same.
    # XLA:CPU's older fusion emitters compile an interpret-mode kernel's program (hundreds
    # of host callbacks) in ~60 % of the time of its MLIR ones (tests/test_k3_megakernel.py
    # and the other K3 checks: 289 CPU s -> 230); of the float32 ops the models use
    # (exp, log, rsqrt, sigmoid, softplus, sin/cos, erf, pow, casts to bf16/fp8/fp4/e8m0,
    # dots, sums, softmax, argmax, top_k) they give the same bits but for tanh (SiTU's
    # caps) and log1p, 1 ulp apart on some inputs: kernel and reference both compile here,
    # and the K3 checks that use SiTU pass under it.
    # Workers and notebook kernels inherit it.
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in CPU_COMPILE_FLAGS if f not in _flags])
# Captures the tests make (mk.measure.profiling, notebook 08) go to a folder of this run, never
# into the checkout's profiles/ (set before mk is imported; workers and notebook kernels
# inherit it).
os.environ.setdefault("MK_PROFILES", tempfile.mkdtemp(prefix="mk-test-profiles-"))

import dataclasses  # noqa: E402

import pytest  # noqa: E402

import mk  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist 3.8 groups the tests marked `xdist_group` by suffixing "@group" to
    `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`), so its
    groups were spread over both workers and their module fixtures built twice. Put the
    same suffix where pytest 9 reads it (a worker's collection; `make test`); and take the
    longest tests first (`LONGEST_FIRST`)."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id  # pytest 9's; a TPU VM's older one lacks it

    for item in items:
        groups = sorted({m.args[0] if m.args else m.kwargs.get("name", "default")
                         for m in item.iter_markers("xdist_group")})
        if groups and not item.nodeid.endswith("@" + "_".join(groups)):
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
    # The notebook runs (the longest tests, ~20-90 s each) first: the workers take tests in
    # this order, so the short ones fill both workers' ends instead of one long run.
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))


LONGEST_FIRST = "tests/test_notebooks.py::test_notebook_runs"


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
