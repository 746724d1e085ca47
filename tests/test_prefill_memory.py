"""The megakernel's prefill (`mk.reference.prefill(..., quantised=True)`) on abstract
shapes: no dequantised copy of a quantised model is an argument of, or alive in, the
compiled prefill. Compiled for the CPU (shapes only, nothing runs); the exact tokens are
tests/test_megakernel.py's, tests/test_quant.py's and tests/test_gpt_oss.py's.
"""

import jax
import jax.numpy as jnp

import mk
from mk import quant, reference
from mk.weights import FORMAT_GROUPS, abstract_params


def _memory(config, params, prompt: int):
    cache = jax.eval_shape(lambda: reference.init_cache(config, 1, prompt))
    args = (params, cache, jax.ShapeDtypeStruct((1, prompt), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    return jax.jit(lambda p, c, t, q: reference.forward(config, p, c, t, q)).lower(
        *args).compile().memory_analysis()


def test_gpt_oss_20b_prefill_holds_its_mxfp4_experts_not_a_dequantised_copy():
    """Measured: arguments 13.32 GiB (stored params) against 40.63 through
    `mk.quant.dequantize`; the temporaries (79 GiB on the CPU at P=16: the reference's
    per-token expert gather, not the weights) the same within a layer's experts."""
    config = mk.preset("gpt-oss-20b")
    params = abstract_params(config)
    params |= {n: quant.abstract_weight(params[n].shape, "fp4")
               for n in FORMAT_GROUPS["experts"] if n in params}
    values = jax.eval_shape(quant.dequantize, params)
    experts = sum(a.size * 2 for n in FORMAT_GROUPS["experts"] if n in values
                  for a in jax.tree.leaves(values[n]))
    packed, whole = _memory(config, params, 16), _memory(config, values, 16)
    assert whole.argument_size_in_bytes - packed.argument_size_in_bytes > 0.6 * experts
    layer = experts / config.layers
    assert packed.temp_size_in_bytes <= whole.temp_size_in_bytes + layer
