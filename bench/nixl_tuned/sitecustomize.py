"""What ``bench.bench_pd``'s "nixl-tuned" servers change in stock vLLM NIXL (put on PYTHONPATH).

On a small CPU host stock NIXL was erratic (stalls of ~30 s, 1-2 s outliers) for two reasons, each
neutralised here in every process of the server:

1. vLLM's NIXL worker (``nixl/base_worker.py``) calls ``os.sched_setaffinity`` to move the thread
   that runs the model onto the last core of each NUMA node: on a 2-core machine, the core the
   other server's OpenMP threads are bound to. Here the call does nothing (vLLM makes no other
   ``os.sched_setaffinity`` call; its OpenMP binding is done in C++ and is unaffected).
2. nixl's Python API starts the agent's progress thread with no delay between polls
   (``pthrDelay = 0``): one core spinning per server. Here it waits 100 µs between polls.
"""

import os


def _keep_affinity(pid, mask):
    return None


os.sched_setaffinity = _keep_affinity

try:
    from nixl_cu12 import _bindings
except ImportError:  # a process that never uses NIXL, or NIXL missing: nothing to change
    pass
else:
    _agent = _bindings.nixlAgent

    def _agent_with_delay(name, config):
        config.pthrDelay = 100  # microseconds between the progress thread's polls
        return _agent(name, config)

    _bindings.nixlAgent = _agent_with_delay
