"""Benchmarks: run arms of monarch-sky and its baselines, then compare their records."""
