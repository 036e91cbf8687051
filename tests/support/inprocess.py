"""`tfdp train` / `tfdp export` / `tfdp evaluate` run inside the test process, for tests about what a run does
(its lines, its files, its accuracy), not about the process boundary (exit codes, one-line errors, signals,
memory): the same flags resolved to the same config (`tfdp.config.FLAG_FIELDS`, `--set` parsed as the CLI does),
then the command's own function, its stdout captured as the process's would be (`say` writes to `sys.stdout`)."""

from __future__ import annotations

import contextlib
import io
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_config(*args: str):
    """The validated config `tfdp COMMAND *args` runs with (dedicated flags and `--set` as `tfdp.cli` maps them;
    tfdp.cli itself is not imported: its absl flags would clash with a pipeline's, pipelines.convert_imagenet's
    --workers, in a test process that imported that one too)."""
    from tfdp import config as config_lib
    path, overrides = None, {}
    for arg in args:
        name, _, value = arg.removeprefix("--").partition("=")
        if name == "config":
            path = value if os.path.isabs(value) else os.path.join(REPO, value)
        elif name == "set":
            key, parsed = config_lib.parse_assignment(value)
            overrides[key] = parsed
        else:
            key, parsed = config_lib.parse_assignment(f"{config_lib.FLAG_FIELDS[name]}={value}")
            overrides[key] = parsed
    return config_lib.load_config(path, overrides)


class Tee(io.StringIO):
    """Captures what is written, and passes it on (pytest shows it with a failure)."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text):
        self.stream.write(text)
        return super().write(text)


@contextlib.contextmanager
def captured_stdout():
    tee = Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee


@contextlib.contextmanager
def op_determinism_as_it_was():
    """`train.deterministic` switches TensorFlow's op determinism on for the rest of a process's life (a `tfdp`
    process ends with its run); in a test process the tests after it (tf.data's unseeded random crops among them)
    need it off again. TensorFlow exports no switch back: its framework config has one."""
    from tensorflow.python.framework import config as tf_framework_config
    was_on = tf_framework_config.is_op_determinism_enabled()
    try:
        yield
    finally:
        if not was_on:
            tf_framework_config.disable_op_determinism()


def train_in_process(*args: str) -> tuple[dict, str]:
    """`tfdp train *args` in this process: the run's summary and its stdout (op determinism as it was before)."""
    from tfdp.distribute.strategy import make_runtime
    from tfdp.train.trainer import train
    with captured_stdout() as out, op_determinism_as_it_was():
        cfg = cli_config(*args)
        summary = train(cfg, make_runtime(cfg.distribute))
    return summary, out.getvalue()


def export_in_process(*args: str, checkpoint: str | None = None, export_dir: str | None = None,
                      formats: tuple[str, ...] = ("saved_model", "keras"), verify_images: int | None = 1000
                      ) -> tuple[dict, str]:
    """`tfdp export *args` in this process (its defaults: saved_model and keras, 1000 images checked): the
    paths written and its stdout."""
    from tfdp.commands.export import export_checkpoint
    from tfdp.distribute.strategy import make_runtime
    with captured_stdout() as out:
        cfg = cli_config(*args)
        paths = export_checkpoint(cfg, make_runtime(cfg.distribute), checkpoint, export_dir, formats, verify_images)
    return paths, out.getvalue()


def evaluate_in_process(*args: str, checkpoint: str | None = None) -> tuple[dict, str]:
    """`tfdp evaluate *args` in this process: its result and its stdout."""
    from tfdp.commands.evaluate import evaluate
    from tfdp.distribute.strategy import make_runtime
    with captured_stdout() as out:
        cfg = cli_config(*args)
        result = evaluate(cfg, make_runtime(cfg.distribute), checkpoint=checkpoint)
    return result, out.getvalue()
