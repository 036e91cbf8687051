"""TCMalloc under every tfdp process, when the system has it (`TFDP_ALLOCATOR=system` keeps glibc's malloc).

TensorFlow allocates and frees the buffers of every step, and oneDNN's
kernels write into them. glibc's malloc returns freed buffers to the kernel
and maps fresh pages for the next step, so a CPU run spends much of its time
in page faults; TCMalloc keeps and reuses them. Intel's TensorFlow and
PyTorch CPU guides recommend it, and Intel's `ipexrun` launcher preloads it
by default, as tfdp does. docs/benchmarks.md ("Start-up and allocator")
has the measurements; a run's weights are bit-identical either way.

An allocator must be in place before the process starts, so `python -m tfdp`
and the `tfdp` command re-execute themselves once (same process id, same
command line) with the library in `LD_PRELOAD`; their children (the workers
of `tfdp launch`, its tf.data service) inherit it. Nothing happens when
`LD_PRELOAD` already names an allocator, when TCMalloc is not installed
(Debian and Ubuntu: `apt install libtcmalloc-minimal4`; the Docker images
have it), or off Linux.
"""

from __future__ import annotations

import os
import sys

SWITCH = "TFDP_ALLOCATOR"  # "system": glibc's malloc
CHOICES = ("tcmalloc", "system")
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
# gperftools prints a line for every allocation above 1 GiB; tfdp's console is its own (tfdp.startup.console).
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)}


def tcmalloc_library() -> str | None:
    """The path of an installed TCMalloc, or None."""
    for folder in LIBRARY_DIRS:
        for name in LIBRARIES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def with_tcmalloc(environ) -> dict | None:
    """`environ` with TCMalloc preloaded, or None where nothing is to change: TCMalloc missing (or not Linux),
    `TFDP_ALLOCATOR=system`, or an allocator already in `LD_PRELOAD`."""
    if environ.get(SWITCH, "tcmalloc") == "system" or "malloc" in environ.get("LD_PRELOAD", ""):
        return None
    library = tcmalloc_library() if sys.platform.startswith("linux") else None
    if library is None:
        return None
    return {**QUIET, **environ, "LD_PRELOAD": " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)}


def preload_tcmalloc() -> None:
    """Re-executes this process with TCMalloc preloaded (`with_tcmalloc`), if that changes anything.

    Call it first thing in a program's entry point: the process is replaced (`os.execve` keeps its id and
    its command line), so nothing done before survives.
    """
    choice = os.environ.get(SWITCH, "tcmalloc")
    if choice not in CHOICES:   # a value meant as "system" (glibc, malloc) would otherwise leave TCMalloc in place
        sys.stderr.write(f"tfdp: error: {SWITCH} must be {' or '.join(CHOICES)}, got {choice!r}\n")
        sys.exit(2)
    env = with_tcmalloc(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # not replaced (the interpreter cannot be executed again): this process goes on as it is
