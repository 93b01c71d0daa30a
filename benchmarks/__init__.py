"""Benchmarks: never run in CI; each prints ratios against a baseline from the same run."""
