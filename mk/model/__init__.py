"""The model floor: what a model is and how its numbers are computed, with no Pallas
kernel: config (+ presets, kind_checks, hf_config), the weight table (weights), the cache
fields (cache), checkpoints (checkpoint, hf_layout, hf_quant, random_codes), storage
formats (quant, unpack: its decoders, `pltpu.bitcast` the one Pallas name, no kernel),
the pure-JAX oracle (reference + ops, linear_attention, layer_values), the chips table
(chips), the checks every driver runs (decode_checks) and untrusted files (untrusted,
errors).

Not here: any kernel (mk.kernels, mk.kinds), the step (mk.step).
"""
