"""The linear family: its kinds (kinds: DeltaNet, KDA, BoundedKDA) beside their kernel
code: the gated DeltaNet layer (deltanet) and its recurrence and state stream
(delta_rule).

Not here: the pure-JAX math (mk.model.linear_attention).
"""
