"""The speculative floor: speculative decoding on the megakernel. A drafter proposes
gamma tokens (drafters), the megakernel verifies them in one step (spec), on the models
a speculative step runs (runners).

Not here: the step it verifies with (mk.step), its cost model (mk.cost).
"""
