"""Layer kinds: each kind of token mixer and MLP is one object that owns everything about
itself, and the rooms that run a model loop over the kinds it has. Each family is a
folder holding its kinds beside its kernel code.

    mk.kinds.base       `Kind`, `Step` (what its kernel code acts on), `Twin`,
                        `LAYER_PHASES` (a layer's program order)
    mk.kinds.attention  kinds: `GQA`, `SinkGQA`, `MLA`, `GatedMLA`; decode_attention,
                        attention_prologue, mla
    mk.kinds.linear     kinds: `DeltaNet`, `KDA`, `BoundedKDA`; deltanet, delta_rule
    mk.kinds.mlp        kinds: `Dense`, `SituDense`, `MoE`, `ClampedMoE`; latent:
                        `LatentMoE`; mlp, joined_experts, routing, latent_moe
    mk.kinds.residual   `ResLayer` (Kimi K3's attention residuals: the stream's kind)
    mk.kinds.layers     `KINDS` (the registry, in stream order), `layer_kinds(config)`

On the model floor (`mk.model.config` imports them): each kind's config checks
(`mk.model.kind_checks`) and Hugging Face reader (`mk.model.hf_config`). Who asks the
kinds: mk.step (the plan, one_layer, the megakernel) and the simulator. How, step by
step: docs/design/mk.kinds.md.
"""
