"""Speculative decoding: proposers, lossless acceptance, metrics."""
