"""Benchmarks: they measure and print; they never assert."""
