"""The attention family: its kinds (kinds: GQA, SinkGQA, MLA, GatedMLA) beside their
kernel code: decode attention (decode_attention), the prologue that projects q, k and v
(attention_prologue) and Kimi's MLA latent attention (mla).

Not here: the KV tile stream all kernels share (mk.kernels.kv_stream).
"""
