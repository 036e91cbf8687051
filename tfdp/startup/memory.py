"""How much more memory this process may take: the host's MemAvailable, bounded by its memory cgroups.

In a container (Docker's `--memory`, a Kubernetes pod's `resources.limits.memory`, a Slurm job under
`task/cgroup`) /proc/meminfo still describes the whole host, and the kernel's OOM killer stops the process
at the cgroup's limit instead, without a word. So a check before a large allocation (`tfdp export`'s ONNX
conversion) compares against the tightest of the two, as the JVM's and Go's container support do. A cgroup's
headroom is its limit less its usage, where the usage leaves out the inactive file cache the kernel reclaims
before it kills (`docker stats` counts it the same way); every cgroup from the process's own to its
hierarchy's root bounds it, so each one with a limit is read.
"""

from __future__ import annotations

import os

# Per cgroup version: (limit file, usage file, the memory.stat key of the reclaimable file cache)
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_V2 = ("memory.max", "memory.current", "inactive_file")


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping or meeting a cgroup's limit; None where unknown."""
    known = [b for b in (meminfo_available(), cgroup_headroom()) if b is not None]
    return min(known) if known else None


def meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what the host can allocate without swapping), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(pid: str = "self") -> int | None:
    """The least headroom over the memory cgroups holding the process, None where none sets a limit."""
    rooms = [room for folder, files in memory_cgroup_folders(pid) if (room := _headroom(folder, files)) is not None]
    return min(rooms) if rooms else None


def memory_cgroup_folders(pid: str = "self") -> list[tuple[str, tuple[str, str, str]]]:
    """(folder, its version's files) of the process's memory cgroup and each ancestor up to the mount's root.

    The cgroup's path (/proc/PID/cgroup) is relative to its hierarchy; the folder is found through the
    hierarchy's mount (/proc/PID/mountinfo), whose root is the part of the hierarchy a container sees. A path
    outside that root (a container without its own cgroup namespace) is the mount's root itself.
    """
    paths = _cgroup_paths(pid)
    folders = []
    for root, mount, version in memory_mounts(pid):
        path = paths.get(version)
        if path is None:
            continue
        below = os.path.relpath(path, root)
        folder = mount if below.startswith("..") else os.path.normpath(os.path.join(mount, below))
        while True:
            folders.append((folder, _V1 if version == "v1" else _V2))
            if folder == mount:
                break
            folder = os.path.dirname(folder)
    return folders


def _cgroup_paths(pid: str) -> dict[str, str]:
    """{"v1": the path in the memory controller's hierarchy, "v2": the path in the unified one}, as listed."""
    paths = {}
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            for line in f:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and not controllers:
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    return paths


def memory_mounts(pid: str) -> list[tuple[str, str, str]]:
    """(root within the hierarchy, mount point, "v1" | "v2") of each mounted hierarchy that can limit memory."""
    mounts = []
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                tail = fields[fields.index("-") + 1:]
                root, mount, fstype = fields[3], fields[4], tail[0]
                if fstype == "cgroup2" and os.path.exists(os.path.join(mount, "cgroup.controllers")):
                    mounts.append((root, mount, "v2"))
                elif fstype == "cgroup" and "memory" in tail[2].split(","):
                    mounts.append((root, mount, "v1"))
    except (OSError, ValueError, IndexError):
        pass
    return mounts


def _headroom(folder: str, files: tuple[str, str, str]) -> int | None:
    """The folder's limit less its usage without the reclaimable file cache; None without a limit or files."""
    limit_file, usage_file, inactive_key = files
    try:
        with open(os.path.join(folder, limit_file), encoding="ascii") as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_file), encoding="ascii") as f:
            usage = int(f.read())
        inactive = 0
        with open(os.path.join(folder, "memory.stat"), encoding="ascii") as f:
            for line in f:
                key, value = line.split()
                if key == inactive_key:
                    inactive = int(value)
    except (OSError, ValueError):
        return None
    # "max" (v2), or v1's page-rounded LONG_MAX: no limit here
    if limit == "max" or int(limit) >= 1 << 62:
        return None
    return max(int(limit) - max(usage - inactive, 0), 0)
