"""How a tfdp process starts: on TCMalloc when the system has it (tfdp.startup.allocator), and TensorFlow imported without
scikit-learn, with what it made frozen out of the garbage collector's walks, and with tfdp's own functions left to trace
as written (tfdp.startup.tf_setup)."""

import gc
import os
import signal
import subprocess
import sys

import pytest
import tensorflow as tf

from conftest import REPO
from tfdp.startup import allocator, tf_setup


def mapped_libraries(env: dict, tmp_path) -> tuple[int, str]:
    """Starts a real long-running tfdp process (a tf.data service dispatcher) with `env`; once it serves, returns
    its id and its memory map, then stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", "data-service", "dispatcher", "--port=0",
                             f"--work_dir={tmp_path}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tfdp: data-service: dispatcher at "), (line, proc.stderr.read()[-2000:])
        with open(f"/proc/{proc.pid}/maps") as f:
            return proc.pid, f.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_a_tfdp_process_runs_on_tcmalloc_unless_told_otherwise(tmp_path):
    library = allocator.tcmalloc_library()
    if library is None:
        pytest.skip("TCMalloc is not installed here (Debian/Ubuntu: apt install libtcmalloc-minimal4)")
    bare = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.SWITCH)}
    _, maps = mapped_libraries(bare, tmp_path / "tcmalloc")
    assert library in maps  # re-executed in place, with it preloaded
    _, maps = mapped_libraries({**bare, allocator.SWITCH: "system"}, tmp_path / "system")
    assert "tcmalloc" not in maps


def test_an_allocator_switch_of_another_value_is_one_line():
    """`TFDP_ALLOCATOR=glibc` meant as `system` would leave TCMalloc in place; it is refused before anything runs."""
    result = subprocess.run([sys.executable, "-m", "tfdp", "report", "/nonexistent"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, allocator.SWITCH: "glibc"})
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", "tfdp: error: TFDP_ALLOCATOR must be tcmalloc or system, got 'glibc'\n")


def test_an_allocator_the_user_preloads_is_kept():
    assert allocator.with_tcmalloc({"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"}) is None
    assert allocator.with_tcmalloc({allocator.SWITCH: "system"}) is None
    env = allocator.with_tcmalloc({"LD_PRELOAD": "/opt/lib/libprofiler.so", "PATH": "/bin"})
    if allocator.tcmalloc_library() is not None:
        assert env["LD_PRELOAD"] == f"{allocator.tcmalloc_library()} /opt/lib/libprofiler.so"
        assert env["PATH"] == "/bin"


def test_tensorflow_as_tfdp_imports_it_brings_no_scikit_learn_and_no_matplotlib():
    code = ("from tfdp.startup.console import import_tensorflow; import_tensorflow(); import sys; "
            "print('sklearn' in sys.modules, 'matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "False"]
    # ... which stay importable for whoever needs them afterwards (the digits demo's data, `tfdp report`).
    code += ("; import sklearn.datasets; print(sklearn.datasets.load_digits().images.shape); "
             "import matplotlib.pyplot; print(matplotlib.pyplot.figure is not None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.stdout.split() == ["False", "False", "(1797,", "8,", "8)", "True"], result.stderr[-2000:]


def test_what_the_tensorflow_import_made_is_frozen_and_the_collector_runs_again():
    code = ("import gc; from tfdp.startup.console import import_tensorflow; import_tensorflow(); "
            "print(gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    enabled, frozen, collected = result.stdout.split()
    assert enabled == "True"
    # Later collections (and the last ones, at exit) walk only what was made after the import.
    assert int(frozen) > 100_000 and int(frozen) > 20 * int(collected), result.stdout


def test_a_collector_the_caller_paused_stays_paused():
    gc.disable()
    try:
        with tf_setup.without_garbage_collection():
            assert not gc.isenabled()
            made_inside = [[] for _ in range(3)]
        assert not gc.isenabled()
        walked = {id(x) for x in gc.get_objects()}  # every generation the collector walks; not the frozen one
        assert gc.is_tracked(made_inside) and not {id(made_inside), *map(id, made_inside)} & walked
    finally:
        gc.enable()
    with tf_setup.without_garbage_collection():
        assert not gc.isenabled()
    assert gc.isenabled()


def python_if_on_a_tensor(x):
    if x > 0:  # AutoGraph turns this into tf.cond; traced as written it cannot run
        return x
    return -x


def same_in_tfdp(x):
    if x > 0:
        return x
    return -x


same_in_tfdp.__module__ = "tfdp.startup.tf_setup"  # a module of tfdp's that this process has imported


def test_autograph_converts_other_code_but_leaves_tfdp_functions_as_written():
    """conftest imports TensorFlow as tfdp does. A function of this test module is converted, so its Python `if`
    on a tensor works; the same function as a member of tfdp is traced as written, and the `if` fails."""
    assert list(tf.data.Dataset.range(-1, 2).map(python_if_on_a_tensor).as_numpy_iterator()) == [1, 0, 1]
    with pytest.raises(TypeError, match="tf.Tensor` as a Python `bool`"):
        tf.data.Dataset.range(-1, 2).map(same_in_tfdp)
