"""What a tfdp process counts as the memory it may still take (tfdp.startup.memory): inside a real memory cgroup,
as in a container with a memory limit, the cgroup's headroom, not the host's MemAvailable."""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from support.cgroups import memory_limited, why_no_memory_cgroup

LIMIT = 768 << 20
# What `python -c` holding the module's reads may charge to its cgroup: the interpreter and its pages
MOST_A_PYTHON_HOLDS = 128 << 20

READ = ("import json; from tfdp.startup import memory as m; "
        "print(json.dumps([m.cgroup_headroom(), m.meminfo_available(), m.available_memory()]))")


def figures_inside(depth: int) -> tuple[int, int, int]:
    """(cgroup headroom, MemAvailable, available memory) as a process in a cgroup `depth` levels deep reads them."""
    with memory_limited(LIMIT, depth) as inside:
        result = subprocess.run(inside([sys.executable, "-c", READ]), capture_output=True, text=True, timeout=60,
                                cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return tuple(json.loads(result.stdout))


@pytest.mark.skipif(why_no_memory_cgroup() is not None, reason=str(why_no_memory_cgroup()))
@pytest.mark.parametrize("depth", [1, 3], ids=["its own cgroup", "an ancestor"])
def test_a_process_in_a_limited_cgroup_counts_the_limit_not_the_host(depth):
    """The limit is on the process's own cgroup, or two levels above it (a pod's limit over its container's
    unlimited cgroup): either way the headroom is the limit less what the process holds, and it, not the host's
    MemAvailable, is what the process may take."""
    headroom, host, available = figures_inside(depth)
    assert host > LIMIT  # this host has more free than the cgroup allows; the test means nothing otherwise
    # each figure read on its own: the process's usage may move by a page between the reads
    assert LIMIT - MOST_A_PYTHON_HOLDS < headroom < LIMIT
    assert LIMIT - MOST_A_PYTHON_HOLDS < available < LIMIT
