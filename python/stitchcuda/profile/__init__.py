"""Profiling (placeholder until the profile package lands)."""
