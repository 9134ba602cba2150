"""The chaos suite: real run_lease_worker processes under kills, pauses, partitions, a
PostgreSQL restart, skewed clocks and a full connection table, then every invariant checked.

    python -m tests.chaos --profile short      # what tests/test_chaos.py runs (< 5 min)
    python -m tests.chaos --profile soak       # 20,000 jobs, a fault every few seconds

It never touches the shared PostgreSQL: it starts a throwaway cluster of its own
(cluster.py), routes every worker through a TCP proxy it can cut (proxy.py), drives the
workload and the faults (harness.py) and checks the outcome (checks.py). See
docs/reliability.md.
"""
