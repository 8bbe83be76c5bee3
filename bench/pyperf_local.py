"""pyperf worker script for issue 6's timed in-memory figures (item 1).

``bench/suite.py`` runs it as pyperf worker processes (``--worker --worker-task=K
--loops=N --values=1``), alternating the benchmarks round by round; run by hand it is an
ordinary pyperf script (``python bench/pyperf_local.py --fast``), which calibrates its
loop counts and so is NOT how the report's figures are taken.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyperf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ping_local

#: name -> time function ``(loops) -> seconds``, in registration order (the worker
#: task index is the position in this dict).
BENCHES = {
    "ping-nowait": ping_local.ping_nowait,
    "ping-async": ping_local.ping_async,
    "checkpoint": ping_local.checkpoint,
    "naive-trio": ping_local.naive_trio,
    "asyncio-call-later": ping_local.asyncio_call_later,
    "throttlebounce": ping_local.throttlebounce_debounce,
    "ping-keyed": ping_local.ping_keyed,
    "asyncio-call-later-keyed": ping_local.asyncio_call_later_keyed,
    "floor-keyed": ping_local.floor_keyed,
}

TASK = {name: index for index, name in enumerate(BENCHES)}

if __name__ == "__main__":
    runner = pyperf.Runner()
    runner.metadata["description"] = "trio_debounce issue 6: in-memory costs"
    for name, func in BENCHES.items():
        runner.bench_time_func(name, func)
