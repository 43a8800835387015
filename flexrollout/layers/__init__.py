"""Shared building blocks an architecture file composes: projections, norms, RoPE, attention, MLP, MoE."""
