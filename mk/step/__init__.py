"""The step floor: one device's decode step. The plan (plan: the step as data, which the
kernel, the simulator and every compile path read; step_bytes, its bytes by family),
one fused layer (one_layer), the whole step in one kernel (megakernel, + preparation),
and tensor parallelism (tensor_parallel; shards, the split rule; distributed, a host's
shards read from a checkpoint).

Not here: the kinds the step loops over (mk.kinds), what it costs (mk.cost).
"""
