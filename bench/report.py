"""Print each benchmark of a pyperf result file as absolute figures and as ratios to its
baseline, with the machine it ran on: ``python bench/report.py results.json``."""

from __future__ import annotations

import platform
import sys

import pyperf

PAIRS = [
    ("coalescing-ping", "checkpoint"),
    ("coalescing-ping", "naive-rearm"),
    ("open-window", "spawn-sleeper"),
    ("replay-reference", "parse-reference"),
    ("shared-ping-nats", "kv-get-put-nats"),
    ("shared-ping-memory", "local-ping"),
    ("shared-ping-nats", "local-ping"),
]


def main(path: str) -> None:
    suite = pyperf.BenchmarkSuite.load(path)
    means = {b.get_name(): (b.median(), b.stdev() if b.get_nvalue() > 1 else 0.0) for b in suite}
    meta = suite.get_metadata()
    machine = (
        f"{meta.get('cpu_count', '?')} cores, {meta.get('cpu_model_name', platform.machine())}"
    )
    print(f"machine: {machine}; python {meta.get('python_version', platform.python_version())}")
    for name, (median, stdev) in means.items():
        print(f"{name:>16}: median {median * 1e9:9.0f} ns  (stdev {stdev * 1e9:.0f} ns)")
    for name, base in PAIRS:
        if name in means and base in means:
            print(f"{name} / {base}: {means[name][0] / means[base][0]:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1])
