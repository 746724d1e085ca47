"""The Pallas machinery that knows no layer kind: the weight stream and ring (`stream`,
`ring`, `fold`, `weight_streaming`), the KV tile stream (`kv_stream`), the collectives,
what every kernel shares (`common`, `dma_probe`), where a kernel runs (`backend`) and
the private JAX names mk uses (`jax_private`).

Not here: each family's kernels, beside its kinds (`mk.kinds.attention`, `.linear`,
`.mlp`); the plan and the whole step (`mk.step`). Every module in a line: docs/layout.md.
"""
