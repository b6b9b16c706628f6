"""Benchmarks behind ``lgc-bench`` (ratios measured side by side in one run, never timed tests)."""
