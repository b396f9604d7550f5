"""On the PYTHONPATH of the e2e tests' vLLM instances only (``conftest.BASE_ENV``).

With ``EC_NIXL_E2E_NO_NUMA_MIGRATE=1`` and a host of one NUMA node, vLLM's CPU worker skips
``torch.ops._C.init_cpu_memory_env``: on such a host it binds memory to the only node there is
and migrates the process's pages to where they already are, and that ``migrate_pages`` call waits
for an LRU drain on every CPU. On the 2-core CI box, a restarted encoder's worker sat there in
uninterruptible sleep for minutes while the PD worker kept the other core busy
(docs/RELIABILITY.md), and the restart tests had to skip. With several NUMA nodes the real op runs.
"""

import os


def _numa_nodes() -> int:
    try:
        return sum(1 for n in os.listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit())
    except OSError:
        return 1


if os.environ.get("EC_NIXL_E2E_NO_NUMA_MIGRATE") == "1" and _numa_nodes() <= 1:
    import sys

    import torch

    def _init_cpu_memory_env(nodes):
        print(f"ec-nixl e2e: one NUMA node: vLLM's init_cpu_memory_env({nodes}) skipped (no migrate_pages)",
              file=sys.stderr, flush=True)

    torch.ops._C.init_cpu_memory_env = _init_cpu_memory_env  # found before the op vLLM registers later
