"""Layer kinds: each kind of token mixer and MLP is one object that owns everything about
itself, and the rooms that run a model loop over the kinds it has.

    mk.kinds.base       `Kind`, `Step` (what its kernel code acts on), `Twin`,
                        `LAYER_PHASES` (a layer's program order)
    mk.kinds.attention  `GQA` (Qwen3, Qwen3.5), `SinkGQA` (gpt-oss), `MLA` (Kimi),
                        `GatedMLA` (Kimi K3)
    mk.kinds.linear     `DeltaNet` (Qwen3.5), `KDA` (Kimi Linear), `BoundedKDA` (Kimi K3)
    mk.kinds.mlp        `Dense`, `SituDense` (Kimi K3), `MoE`, `ClampedMoE` (gpt-oss),
                        `router_after_mixer`; mk.kinds.latent: `LatentMoE` (Kimi K3)
    mk.kinds.residual   `ResLayer` (Kimi K3's attention residuals: the stream's kind)
    mk.kinds.layers     `KINDS` (the registry, in stream order), `layer_kinds(config)`,
                        a layer's kinds and rows, the kernel's per-layer tables

On the config's floor beside it (`mk.config` imports them): each kind's config checks
(`mk.kind_checks`) and Hugging Face config.json reader (`mk.hf_config`). Who asks the
kinds: the megakernel, `mk.kernels.one_layer.layer_body`, the stage-05 kernel, the plan
and the simulator (each kind's twin); they loop over the kinds, so nothing else changes
when one is added. How, step by step: docs/design/mk.kinds.md.
"""
