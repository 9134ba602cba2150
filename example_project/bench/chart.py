"""The PNG in docs/benchmarks.md: drain rates, enqueue rates, latency and heartbeat cost."""

from __future__ import annotations

import statistics
from pathlib import Path


def _m(values):
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return None, None, None
    return statistics.median(vals), min(vals), max(vals)


def chart(results: dict, path: Path, labels: dict, worker_counts: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    drains = results["drain"]
    keys = []
    for k in drains:
        key = k.split("|")[0]
        if key not in keys:
            keys.append(key)
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(worker_counts):
            m = _m([r["jobs_per_s"] for r in drains.get(f"{key}|{w}", [])])
            if m[0] is None:
                continue
            xs.append(j + (i - len(keys) / 2 + 0.5) * width)
            ys.append(m[0])
            lo.append(m[0] - m[1])
            hi.append(m[2] - m[0])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=labels.get(key, key))
    ax.set_xticks(
        range(len(worker_counts)), [f"{w} worker{'s' if w > 1 else ''}" for w in worker_counts]
    )
    ax.set_ylabel("jobs/s (median, min-max)")
    ax.set_yscale("log")
    ax.set_title("Drain of pre-enqueued no-op jobs")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    enq = results["enqueue"]
    names = list(enq)
    for n_i, field in enumerate(("single_per_s", "bulk_per_s")):
        vals = [_m([r[field] for r in enq[n]]) for n in names]
        ax.bar(
            [i + (n_i - 0.5) * 0.4 for i in range(len(names))],
            [v[0] or 0 for v in vals],
            0.4,
            label="one per transaction" if field == "single_per_s" else "bulk, one transaction",
        )
    ax.set_xticks(
        range(len(names)),
        ["raw SQL" if n == "limit" else labels.get(n, n) for n in names],
        rotation=15,
        fontsize=8,
    )
    ax.set_yscale("log")
    ax.set_ylabel("jobs/s")
    ax.set_title("Enqueue from one process")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    lat = results["latency"]
    names = list(lat)
    p50 = [_m([r["p50_ms"] for r in lat[n]])[0] or 0 for n in names]
    p99 = [_m([r["p99_ms"] for r in lat[n]])[0] or 0 for n in names]
    ax.bar([i - 0.2 for i in range(len(names))], p50, 0.4, label="p50")
    ax.bar([i + 0.2 for i in range(len(names))], p99, 0.4, label="p99")
    ax.axhline(5, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(names)), [labels.get(n, n) for n in names], rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("Enqueue-to-start latency, idle workers (dashed: 5 ms)")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    hb = results["heartbeat"]
    names = list(hb)
    vals = [_m([r["jobs_per_s"] for r in hb[n]]) for n in names]
    ax.bar(
        range(len(names)),
        [v[0] or 0 for v in vals],
        yerr=[[(v[0] or 0) - (v[1] or 0) for v in vals], [(v[2] or 0) - (v[0] or 0) for v in vals]],
        capsize=3,
        color="tab:green",
    )
    ax.set_xticks(range(len(names)), [f"{int(n):,} held" for n in names])
    ax.set_ylabel("django-leases drain, 2 workers, jobs/s")
    ax.set_title("Drain while one holder renews N claims")
    fig.suptitle(
        f"django-leases benchmarks — {results['meta']['date']}, {results['meta']['nproc']} cores, "
        f"PostgreSQL {results['meta']['postgres']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
