"""Benchmarks that print the numbers StitchCUDA's optimizations are meant to move.

Each module has ``run(...) -> dict`` (one JSON-ready object) and is reachable as
``stitchcuda bench <name>``: ``jit`` measures compile, cache and launch costs.
"""
