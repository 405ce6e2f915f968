"""Benchmarks: elastrun side by side with torchrun (see docs/benchmarks.md)."""
