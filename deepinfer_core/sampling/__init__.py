"""Sampling parameters, counter-based noise and the reference sampler semantics."""
