"""The stage kernels and their machinery: the weight stream and ring (`stream`, `ring`,
`fold`, `weight_streaming`), decode attention and its KV stream (`decode_attention`,
`kv_stream`, `attention_prologue`, `mla`), the MLP and experts (`mlp`, `routing`,
`joined_experts`), the linear layers (`deltanet`, `delta_rule`), the collectives, one
fused layer (`one_layer`), the plan of one device's step (`plan`), and what they share
(`common`, `dma_probe`).

Not here: the layer kinds that own these pieces (`mk.kinds`), the whole decode step
(`mk.megakernel`). Every module in a line: docs/layout.md.
"""
