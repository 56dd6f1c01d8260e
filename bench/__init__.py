"""Benchmarks: the seeded workload, the HTTP load generator."""
