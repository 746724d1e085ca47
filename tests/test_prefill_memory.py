"""The megakernel's prefill (`mk.model.reference.prefill(..., quantised=True)`) on abstract
shapes, compiled for a v5e core (nothing runs): the quantised weights enter as stored and
are dequantised where they are read (a layer's row; of experts, a slice of a layer's), and
every stacked weight is sliced when its layer is reached, so the prefill's temporaries do
not grow with the layers. The exact tokens are tests/test_megakernel.py's, tests/test_quant.py's and
tests/test_gpt_oss.py's; the runtime's peak is measured on a chip (issue 60).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

import mk
from mk.model import quant, reference
from mk.measure import tpu
from mk.model.weights import FORMAT_GROUPS, abstract_params


def _cut(layers: int):
    """gpt-oss-20b cut to `layers` layers, its experts MXFP4 as stored, as abstract params."""
    config = dataclasses.replace(mk.preset("gpt-oss-20b"), layers=layers,
                                 moe_layers=tuple(range(layers)),
                                 sliding_layers=tuple(range(0, layers, 2)))
    params = abstract_params(config)
    return config, params | {n: quant.abstract_weight(params[n].shape, "fp4")
                             for n in FORMAT_GROUPS["experts"]}


def _prefill_memory(config, params, prompt: int = 16):
    cache = jax.eval_shape(lambda: reference.init_cache(config, 1, prompt))
    args = (params, cache, jax.ShapeDtypeStruct((1, prompt), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    return tpu.step_compiler("v5e")(
        jax.jit(lambda p, c, t, s: reference.forward(config, p, c, t, s)),
        args).memory_analysis()


def _cpu_prefill_memory(config, params, prompt: int = 8):
    """The same prefill compiled by XLA:CPU: the host's, where the hardware tier and
    benchmarks/tpu_models.py run the reference that judges the chip."""
    cache = jax.eval_shape(lambda: reference.init_cache(config, 1, prompt))
    fn = jax.jit(lambda p, c, t, s: reference.forward(config, p, c, t, s))
    return fn.lower(params, cache, jax.ShapeDtypeStruct((1, prompt), jnp.int32),
                    jax.ShapeDtypeStruct((1,), jnp.int32)).compile().memory_analysis()


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_gpt_oss_prefill_dequantises_a_slice_of_mxfp4_experts_at_a_time():
    """Measured on v5e (P=16): temporaries 0.54, 0.63, 0.68 GiB at 2, 4, 8 layers, for one
    layer's experts of 1.55 GiB in bf16 (`mk.model.layer_values.EXPERT_SLICE` of its 32 experts at
    a time, each slice's float32 products' operands). A whole layer at a time held 4.19,
    4.25, 4.37 GiB; before the layers were tied (slices taken early) 4.77, 5.54, 6.80;
    through `mk.model.quant.dequantize` the arguments alone held every layer's bf16 experts
    (40.6 GiB at 24 layers against 13.3 stored)."""
    (c2, p2), (c6, p6) = _cut(2), _cut(6)
    m2, m6 = _prefill_memory(c2, p2), _prefill_memory(c6, p6)
    assert m6.argument_size_in_bytes <= _nbytes(p6) * 1.01  # packed, as stored
    layer = sum(math.prod(p2[n].shape) * 2 for n in FORMAT_GROUPS["experts"]) / 2  # bf16
    assert m6.temp_size_in_bytes - m2.temp_size_in_bytes < layer / 8  # flat in layers
    assert m2.temp_size_in_bytes < layer / 2  # a slice of the layer's experts, not all


def test_a_plain_models_prefill_slices_each_layers_weights_when_it_reaches_it():
    """qwen3-4b cut to 4 and 8 layers, bf16 (P=64), on v5e: 0.004 and 0.007 GiB of
    temporaries (12 layers: 0.006; a layer's weights are 0.19). Untied, XLA sliced every
    layer's weights up front: 0.28 GiB at 12 layers, growing with them."""
    cuts = [mk.preset("qwen3-4b").first_layers(n) for n in (4, 8)]
    m4, m8 = (_prefill_memory(c, abstract_params(c), prompt=64) for c in cuts)
    layer = sum(math.prod(a.shape[1:]) * a.dtype.itemsize
                for a in abstract_params(cuts[0]).values() if a.ndim > 2)
    assert m8.temp_size_in_bytes - m4.temp_size_in_bytes < layer / 8


@pytest.mark.parametrize("formats", [{}, {"dense": "int8"}], ids=["bf16", "int8"])
def test_the_host_prefill_widens_one_layers_weights_at_a_time(formats):
    """qwen3-0.6b cut to 1 and 3 layers, on XLA:CPU (P=8): temporaries flat in the layers
    (qwen3-8b cut to 2 and 6: 3.04 GiB at either, its float32 lm_head and one layer's
    float32 weights). With the layers tied by an optimization barrier, XLA:CPU's bf16
    normalisation widened every layer's weights to float32 before the first: qwen3-8b's
    3.76 and 6.63 GiB, 0.72 GiB a layer more; the whole model's reference (36 layers)
    then ran the v5e machine's 40 GiB of host RAM out (issue 60)."""
    cuts = [mk.preset("qwen3-0.6b").first_layers(n) for n in (1, 3)]
    m1, m3 = (_cpu_prefill_memory(c, quant.abstract_params(c, formats)) for c in cuts)
    layer = sum(math.prod(a.shape[1:]) * 4 for a in abstract_params(cuts[0]).values()
                if a.ndim > 2)  # float32
    assert m3.temp_size_in_bytes - m1.temp_size_in_bytes < layer / 8
