"""The MLP family: its kinds (kinds: Dense, SituDense, MoE, ClampedMoE; latent:
LatentMoE) beside their kernel code: the MLP and expert kernels (mlp, joined_experts),
the router inside a kernel (routing) and Kimi K3's experts on a latent (latent_moe).

Not here: the collectives the experts' partial sums use (mk.kernels.collectives).
"""
