"""The one tolerance table of the kernel tests: stage -> dtype -> assert_allclose kwargs.

float32 runs differ from mk.model.reference only by summation order; bfloat16 runs by where
activations are rounded (the reference rounds at the same points, so single matmuls stay
close) plus the online softmax of attention, whose unnormalised probabilities are rounded
before P @ V. The fused layer compounds all of these; a wrong tile, head or expert is off
by O(1), far outside every entry.
"""

TOLERANCE = {
    "matmul": {"float32": dict(rtol=1e-5, atol=1e-4), "bfloat16": dict(rtol=1e-5, atol=1e-3)},
    "prologue": {"float32": dict(rtol=1e-5, atol=1e-4),
                 "bfloat16": dict(rtol=1e-5, atol=1e-4)},
    "attention": {"float32": dict(rtol=1e-5, atol=1e-5),
                  "bfloat16": dict(rtol=1e-2, atol=1e-2)},
    "mlp": {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-5, atol=1e-3)},
    "layer": {"float32": dict(rtol=1e-4, atol=2e-4), "bfloat16": dict(rtol=2e-2, atol=3e-2)},
}

# A fused layer's MoE router near-ties: one bound, mk.measure.exactness's.
from mk.measure.exactness import ROUTER_TIE  # noqa: E402,F401
