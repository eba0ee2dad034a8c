"""Benchmarks of the engine against its peers (outside the library package)."""
