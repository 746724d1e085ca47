"""The measure floor: a step and its kernels measured and checked. DMA probes and steps
timed on a TPU (measure), profiles (profiling), ahead-of-time TPU compiles (tpu,
compile_time, xla_step), greedy tokens against the reference (exactness) and every ref
index bounded on the jaxpr (bounds + intervals).

Not here: the models the measurements are held against (mk.cost).
"""
