"""The cost floor: what a step costs, modelled and recorded. The roofline (perf, +
routing_trace, feed_costs), the tile schedule replayed on a chip model (sim, on machine:
the DMA engine, compute lane and its `Assumptions`), the simulator held to a chip
(calibration), libtpu's bundle counts (bundles, probes), the published numbers (published)
and the words for every step time (ledger).

Not here: the step itself (mk.step), the TPU runs that feed it (mk.measure.measure).
"""
