"""How many CPUs this process may use (the checkpoint tools size their thread pools with it).

Its affinity mask where the OS has one (a container or ``taskset`` may allow fewer CPUs than the machine has), else
the machine's count. Standard library only: the converter CLI imports it before anything heavy.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this OS
        return max(1, os.cpu_count() or 1)
