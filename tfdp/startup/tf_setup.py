"""A faster start (and end) of TensorFlow in every tfdp process (docs/benchmarks.md, "Start-up and allocator").

Every tfdp process that trains, evaluates, exports or serves data imports
TensorFlow, and a test suite or a cluster job starts many of them. Three
costs buy tfdp nothing:

* `import keras` imports scikit-learn, and with it SciPy, for Keras'
  scikit-learn wrappers (`keras.wrappers`), and matplotlib's pyplot for its
  image-gallery plots (`keras.visualization`), neither of which tfdp uses.
  The import is made to find neither; a later `import sklearn` (the digits
  demo's data) or `import matplotlib` (`tfdp report`) works as usual.
* AutoGraph rewrites every Python function handed to `tf.data` (and each
  one a `tf.function` calls) into graph code, parsing its source, before
  tracing it.
  tfdp's own functions need no rewriting: they branch on tensors with
  `tf.cond` / `tf.where` and loop with `tf.data`, never with a Python `if`
  or `for` over a tensor, so they are traced as written, as TensorFlow's and
  Keras' own functions are. A Python `if` on a tensor in tfdp code therefore
  fails at tracing ("using a `tf.Tensor` as a Python `bool`"), in every test
  that reaches it, rather than being converted.
* Python's cyclic garbage collector walks every object it tracks in each
  full collection, and again in its last collections when the interpreter
  exits; the import leaves several hundred thousand (modules, classes,
  registered ops), none of them garbage. The collector is paused during the
  import, and what the import made is then frozen (`gc.freeze`), so the
  collections during tracing and training, and those at exit, skip it.

The AutoGraph rule uses a private TensorFlow name, listed in
`tfdp.keras_patches.RELIED_ON` and checked by tests/keras_patches/test_compat.py.
"""

from __future__ import annotations

import contextlib
import gc
import sys

# The package whose functions AutoGraph leaves as they are (its own rule matches submodules too).
OWN_PACKAGE = "tfdp"


# What `import keras` pulls in for features tfdp does not use: its scikit-learn wrappers, its pyplot galleries.
KERAS_EXTRAS_TFDP_NEVER_USES = ("sklearn", "matplotlib")


@contextlib.contextmanager
def without_unused_imports(names=KERAS_EXTRAS_TFDP_NEVER_USES):
    """Inside the block importing any of `names` fails as if it were not installed (unless already imported)."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # the import system's own "not importable" marker
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


@contextlib.contextmanager
def without_garbage_collection():
    """Pauses the cyclic collector inside the block, then moves every object alive at its end to the permanent
    generation, which later collections do not walk (a collector the caller had paused stays paused)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def trace_own_functions_as_written() -> None:
    """AutoGraph leaves tfdp's functions unconverted (idempotent)."""
    from tensorflow.python.autograph.core import config
    rule = config.DoNotConvert(OWN_PACKAGE)
    if not any(isinstance(r, config.DoNotConvert) and r.matches(OWN_PACKAGE) for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule, *config.CONVERSION_RULES)
