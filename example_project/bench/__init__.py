"""Benchmark harness: django-leases against a hand-written limit and its peers.

Run ``python example_project/bench/run.py --help``; see docs/benchmarks.md.
"""
