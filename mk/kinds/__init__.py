"""Layer kinds: each kind of token mixer and MLP is one object that owns everything about
itself, and the rooms that run a model loop over the kinds it has.

    module                  what is there
    mk.kinds.base           `Kind` (what a kind owns: weights, ring segments, buffers,
                            semaphores, preparation, fetches, in-kernel hooks, simulator
                            twin), `Step` (what its kernel code acts on), `Twin`,
                            `LAYER_PHASES` (a layer's program order)
    mk.kinds.attention      `GQA` (Qwen3; Qwen3.5's gated output, partial RoPE),
                            `SinkGQA` (gpt-oss: sinks, biases, sliding windows), `MLA`
    mk.kinds.linear         `DeltaNet` (Qwen3.5), `KDA` (Kimi Linear)
    mk.kinds.mlp            `Dense` (SwiGLU), `MoE` (softmax or sigmoid router, shared
                            expert), `ClampedMoE` (gpt-oss), `router_after_mixer`
    mk.kinds.layers         `KINDS` (the registry, in stream order), `layer_kinds(config)`,
                            a layer's kinds and rows, the kernel's per-layer tables;
                            `REFERENCE_ONLY`: the weight table's kinds no kernel runs yet
                            (Kimi K3's: `layer_kinds` refuses them by name and feature)
    mk.kinds.checks         each kind's checks of a `mk.config.ModelConfig` (run by the
                            config on construction; this module imports no kernel)
    mk.kinds.hf             each kind's reader of its fields from a Hugging Face
                            config.json, a model type's list of readers (`FAMILIES`, read
                            by `ModelConfig.from_hf`; this module imports no kernel)

Who asks the kinds: the whole-model kernel (`mk.megakernel`: operands, preparation,
fetches, start and finish), `mk.kernels.one_layer.layer_body` (each layer's phases and
skips), the stage-05 kernel (`one_layer`), the plan (`mk.kernels.plan`: the stream, the
buffers, the scratch, the KV layout) and the simulator (`mk.sim`: each kind's twin).

How to add a layer kind (gpt-oss's `SinkGQA` and `ClampedMoE` were added so):
1. Its weights: rows in `mk.weights.WEIGHTS` with the kind's name (shape rule, byte
   family, ring/dma path, split, format group, Hugging Face names), its layers' field in
   `mk.weights.KIND_LAYERS`, and the rule that selects it in `mk.weights.kinds_of`.
2. Its config fields on `mk.config.ModelConfig` and their check in `mk.kinds.checks`
   (`KIND_CHECKS`); its Hugging Face fields: a reader in `mk.kinds.hf` (a function of the
   file and the fields read before it, returning the kind's fields), listed in
   `mk.kinds.hf.FAMILIES` under each model type that has the kind (a new model type is a
   new entry there: `HF_MODEL_TYPES` follows).
3. Its reference math in `mk.reference` (the oracle every kernel is compared with), an
   oracle function registered by the kind's name (`MIXER_LAYERS` or `MLPS` there); what
   it caches: its fields' rows in `mk.cache.FIELDS` (dims, dtype, layers, split) and the
   cache type that serves it (`mk.cache.CACHE_TYPES`).
4. Its kernel body in `mk.kernels` (a module of its own, as `mk.kernels.mla`), and its
   class here: a `Kind` subclass (a variant of an existing kind subclasses it and
   overrides what differs, as `MLA` does `GQA`) with `matrices`, `buffers`, `scratch`,
   `prepare` (the base's: ring weights as stored, DMA'd vectors as rows), `fetch`, the
   hooks it needs, `run` for each of its `phases`, its `title`; and its
   `Twin`, the same hooks costed on the simulator's machine. Register it in
   `mk.kinds.layers.KINDS` at its place in the stream.
5. Its cost, the cost section of its class (`mk.perf` loops over the kinds): `params`
   (its table rows' matmul elements but its `elementwise` weights), and where it has
   them `mixing_flops`, `mxu_passes`, `routes` and `conventional` (its ops in the
   one-kernel-per-op execution). The bytes come from the weight table (`streamed`).
6. Tests: the reference against transformers on a tiny random checkpoint, the megakernel
   against the reference (exact greedy tokens), the race detector, the byte counts
   (kernel = plan = simulator = `mk.perf`, tests/test_counts.py) and the DMA order
   (kernel = simulator), an AOT compile for a TPU generation.
Nothing else changes: the kernel, the plan and the simulator loop over the kinds.
"""
