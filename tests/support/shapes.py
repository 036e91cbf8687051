"""Models built for their variables' shapes only, without allocating or initialising their values."""

import contextlib

import keras


@contextlib.contextmanager
def shapes_only():
    """Variables made in the block have their shapes and no values: Keras defers initialising the variables of a
    StatelessScope, and those it leaves uninitialised are dropped from its list after, so nothing allocates them."""
    from keras.src.backend.common import global_state
    before = list(global_state.get_global_attribute("uninitialized_variables", []) or [])
    with keras.StatelessScope(initialize_variables=False):
        yield
    global_state.set_global_attribute("uninitialized_variables", before)
