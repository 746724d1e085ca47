"""Every private JAX name mk uses, in one place, and the jax version they were written
against (`WRITTEN_FOR`, the pin of pyproject.toml's [tool.mk].pins; a test keeps the two
equal, so moving the pin means reading these again).

    config                  the flag that says a Pallas TPU interpret-mode context is
                            active (`mk.kernels.backend.check_active`)
    interpret_pallas_call   the TPU interpreter's module: its race detector, shared memory
                            and DMA records (`mk.kernels.backend`, which wraps its `_validate`)
    core, source_info_util  jaxprs, their variables and literals, where an equation came
                            from (`mk.measure.bounds`, `mk.measure.exactness`)
    NDIndexer, Slice,       a ref index and the ref it indexes (`mk.measure.bounds`)
    TransformedRef
    MosaicError             a Mosaic compile error (`mk.measure.tpu.COMPILER_ERRORS`)
    callback                the callbacks' module: its logger prints a failing callback's
                            traceback before the error is raised (`mk.course.grading`)

Not here: anything public (`jax.experimental.pallas` and the rest are imported where they
are used).
"""

from jax._src import callback, config, core, source_info_util
from jax._src.pallas.mosaic.error_handling import MosaicError
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax._src.state.indexing import NDIndexer, Slice
from jax._src.state.types import TransformedRef

WRITTEN_FOR = "0.10.2"  # jax, as pinned in pyproject.toml

__all__ = ["MosaicError", "NDIndexer", "Slice", "TransformedRef", "WRITTEN_FOR", "callback",
           "config", "core", "interpret_pallas_call", "source_info_util"]
