"""`tfdp export`: the trained network in the formats other runtimes load, each checked in its own runtime.

Every format carries the preprocessing: uint8 pixels go in, the
normalisation (`data.mean`/`data.std`) is the graph's first layer. The two
TensorFlow formats take encoded JPEG/PNG bytes and do the evaluation's
decode, central crop and resize themselves (`DecodeImages`), then return
class probabilities: `saved_model/` (TensorFlow Serving; signature `serve`,
input `image_bytes`) and `model.keras`. ONNX and LiteRT have no JPEG decoder
op, so `model.onnx` and `model.tflite` take the uint8 NHWC batch of
evaluation-size crops and return logits, as timm's and torchvision's ONNX
exports do. All four are written by Keras' own exporters
(`keras.Model.export`), from the network rebuilt for inference: without its
training-only random flip and in float32 whatever `train.precision` trained
it in. docs/export.md is the user's guide.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import warnings
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdp.config import Config
from tfdp.data.preprocess import center_crop
from tfdp.errors import UserError, first_line
from tfdp.resolution import eval_image_size


@keras.saving.register_keras_serializable(package="tfdp")
class DecodeImages(keras.layers.Layer):
    """Encoded bytes → uint8 images, exactly as the evaluation pipeline prepares them."""

    def __init__(self, image_size: int, crop_fraction: float, **kwargs):
        super().__init__(**kwargs)
        self.image_size, self.crop_fraction = int(image_size), float(crop_fraction)

    def call(self, data):
        spec = tf.TensorSpec([self.image_size, self.image_size, 3], tf.uint8)
        return tf.map_fn(lambda d: center_crop(d, self.image_size, self.crop_fraction), data, fn_output_signature=spec)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.image_size, self.image_size, 3)

    def get_config(self):
        return {**super().get_config(), "image_size": self.image_size, "crop_fraction": self.crop_fraction}


@dataclasses.dataclass(frozen=True)
class Format:
    """One export format: where it is written, what it needs, and how it is written and run back."""
    filename: str
    # modules it imports, each with the pip extra that installs it
    packages: tuple[tuple[str, str], ...]
    # "bytes": a batch of encoded images in, probabilities out; "pixels": uint8 NHWC crops in, logits out
    takes: str
    # (inference network, bytes serving model, config, path) → None
    write: Callable
    # path → function(batch) → numpy outputs, run in the format's own runtime
    load: Callable


def inference_network(model: keras.Model) -> keras.Model:
    """`build_model`'s chain (uint8 image → standardize → backbone → float32 logits) without its random flip.

    Keras' exporters call the model with `training` unset, and a Keras
    preprocessing layer's default is `training=True`: left in, the flip
    would mirror half of every served batch at random. The layers (and so
    the weights) are the model's own.
    """
    inputs = keras.Input(model.input_shape[1:], dtype="uint8", name="image")
    x = inputs
    for layer in model.layers[1:]:
        if not isinstance(layer, keras.layers.RandomFlip):
            x = layer(x)
    return keras.Model(inputs, x, name=model.name)


def bytes_model(network: keras.Model, cfg: Config) -> keras.Model:
    """Encoded JPEG/PNG bytes → the evaluation crop → the network → class probabilities."""
    inputs = keras.Input((), dtype="string", name="image_bytes")
    images = DecodeImages(eval_image_size(cfg.data), cfg.data.eval_crop_fraction, name="decode")(inputs)
    probabilities = keras.layers.Softmax(name="probabilities", dtype="float32")(network(images))
    return keras.Model(inputs, probabilities, name=f"{network.name}_serving")


def pixel_signature(cfg: Config) -> list[tf.TensorSpec]:
    size = eval_image_size(cfg.data)
    return [tf.TensorSpec([None, size, size, 3], tf.uint8, name="image")]


# --- writers ------------------------------------------------------------------

def _write_saved_model(network, served, cfg, path):
    served.export(path, format="tf_saved_model", verbose=False)


def _write_keras(network, served, cfg, path):
    served.save(path)


def _write_onnx(network, served, cfg, path):
    quiet = logging.getLogger("tf2onnx")
    level, quiet.level = quiet.level, logging.CRITICAL  # it logs every op it folds; what it cannot convert is
    # found in the written graph (`_check_onnx_ops`) and reported as one line
    try:
        with warnings.catch_warnings():  # Keras' numpy-2 patch of tf2onnx probes np.object
            warnings.simplefilter("ignore", FutureWarning)
            network.export(path, format="onnx", input_signature=pixel_signature(cfg), verbose=False)
    finally:
        quiet.setLevel(level)
    _check_onnx_ops(path)
    _name_onnx_output(path, "logits")


# TensorFlow ops tf2onnx leaves in a graph unconverted → what they usually are in a tfdp model.
UNCONVERTED_HINTS = {
    "StatefulPartitionedCall": "a TensorFlow function it cannot inline, such as the XLA-compiled function "
                               "Keras' TensorFlow backend runs a grouped convolution in",
}


def _check_onnx_ops(path: str) -> None:
    """tf2onnx writes a graph even when it cannot convert some TensorFlow ops: it keeps them as they are, and
    onnxruntime then refuses the file. Such a file is deleted and the ops named."""
    import onnx
    graph = onnx.load(path).graph
    left = [n for n in graph.node if not n.domain and not onnx.defs.has(n.op_type)]
    if left:
        os.remove(path)
        kinds = sorted({n.op_type for n in left})
        hints = "; ".join(f"{k}: {UNCONVERTED_HINTS[k]}" for k in kinds if k in UNCONVERTED_HINTS)
        raise ValueError(f"tf2onnx cannot convert {len(left)} TensorFlow op(s) ({', '.join(kinds)}), the first in "
                         f"{left[0].name.rsplit('/', 1)[0]}" + (f" ({hints})" if hints else ""))


def _name_onnx_output(path: str, name: str) -> None:
    """tf2onnx names the output after the traced function's (`Identity:0`); a client reads `logits`."""
    import onnx
    model = onnx.load(path)
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [name if o == old else o for o in node.output]
        node.input[:] = [name if i == old else i for i in node.input]
    model.graph.output[0].name = name
    onnx.save(model, path)


def _write_litert(network, served, cfg, path):
    # Builtin ops only: the plain LiteRT interpreter (phones, ai_edge_litert) has no TensorFlow (Flex) ops.
    network.export(path, format="litert", input_signature=pixel_signature(cfg), verbose=False,
                   target_spec={"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]})


# --- runtimes -----------------------------------------------------------------

def _run_saved_model(path):
    loaded = tf.saved_model.load(path)  # the closure keeps it alive: it owns the variables
    return lambda data: loaded.serve(tf.constant(data)).numpy()


def _run_keras(path):
    model = keras.saving.load_model(path)
    return lambda data: model.predict_on_batch(tf.constant(data))


def _run_onnx(path):
    import onnxruntime
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda images: session.run(["logits"], {"image": images})[0]


def _run_litert(path):
    from ai_edge_litert.interpreter import Interpreter
    interpreter = Interpreter(model_path=path)

    def run(images):
        index = interpreter.get_input_details()[0]["index"]
        interpreter.resize_tensor_input(index, images.shape)
        interpreter.allocate_tensors()
        interpreter.set_tensor(index, images)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"]).copy()
    return run


# name → format; `tfdp export --format` takes a comma list of these names.
FORMATS = {
    "saved_model": Format("saved_model", (), "bytes", _write_saved_model, _run_saved_model),
    "keras": Format("model.keras", (), "bytes", _write_keras, _run_keras),
    "onnx": Format("model.onnx", (("tf2onnx", "onnx"), ("onnx", "onnx"), ("onnxruntime", "onnx")), "pixels",
                   _write_onnx, _run_onnx),
    "litert": Format("model.tflite", (("ai_edge_litert.interpreter", "litert"),), "pixels",
                     _write_litert, _run_litert),
}
DEFAULT_FORMATS = ("saved_model", "keras")


def parse_formats(text: str) -> tuple[str, ...]:
    """`saved_model,onnx` → ("saved_model", "onnx"): known names, each once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UserError(f"--format is empty (valid: {', '.join(FORMATS)}; several as a comma list)")
    for name in names:
        if name not in FORMATS:
            raise UserError(f"--format: unknown export format '{name}' (valid: {', '.join(FORMATS)})")
    return tuple(dict.fromkeys(names))


def check_packages(formats: tuple[str, ...]) -> None:
    """Every package the formats import is there, before anything is built or written."""
    for name in formats:
        for module, extra in FORMATS[name].packages:
            try:
                importlib.import_module(module)
            except ImportError:
                raise UserError(f"--format={name} needs the Python package '{module.split('.')[0]}', which is "
                                f"not installed: pip install 'tfdp[{extra}]'") from None


def export(model: keras.Model, cfg: Config, class_names: tuple[str, ...], out_dir: str,
           formats: tuple[str, ...] = DEFAULT_FORMATS) -> dict[str, str]:
    """Writes each format (and `classes.json`) into `out_dir`; returns name → path."""
    check_packages(formats)
    os.makedirs(out_dir, exist_ok=True)
    network = inference_network(model)
    served = bytes_model(network, cfg)
    paths = {}
    for name in formats:
        paths[name] = os.path.join(out_dir, FORMATS[name].filename)
        try:
            FORMATS[name].write(network, served, cfg, paths[name])
        except (ValueError, TypeError, NotImplementedError, RuntimeError, tf.errors.OpError) as e:
            if name in DEFAULT_FORMATS:
                raise  # the TensorFlow formats take every tfdp model: a failure there is a bug
            raise UserError(f"--format={name}: Keras' exporter cannot convert model '{cfg.model.name}': "
                            f"{first_line(e, 400)}") from None
    paths["classes"] = os.path.join(out_dir, "classes.json")
    with open(paths["classes"], "w", encoding="utf-8") as f:
        json.dump(list(class_names), f)
    return paths


# --- verification -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Agreement:
    """How one exported format's answers compare with the Keras model's on the same images."""
    images: int
    agreeing: int        # images whose top-1 class is the Keras model's
    max_difference: float
    compared: str        # "logit" or "probability"

    @property
    def percent(self) -> float:
        return 100.0 * self.agreeing / max(self.images, 1)


def verification_batches(cfg: Config, split, limit: int, batch: int = 64):
    """(encoded bytes, evaluation crops) of the first `limit` images of `split` (0: all), in listing order.

    The crops are the evaluation pipeline's (`center_crop`, the same function
    `DecodeImages` runs); images that do not decode are left out. A synthetic
    split has no encoded bytes: its bytes are empty strings.
    """
    from tfdp.data import readers
    size = eval_image_size(cfg.data)
    data_cfg = dataclasses.replace(cfg.data, cache=False, image_size=size)  # payloads are paths, read here
    example = readers.example_fn(split, data_cfg, cfg.model.num_classes)
    ds = readers.payloads(split, data_cfg, tf.distribute.InputContext(), False)
    def pair(*element):  # a payload is one tensor (a record) or a tuple (an image's path and label)
        element = element if len(element) > 1 else element[0]
        if split.kind == "synthetic":
            return tf.constant(b""), example(element, 0, None)[0]
        return example(element, 0, lambda data, index: (data, center_crop(data, size, cfg.data.eval_crop_fraction)))[0]
    ds = ds.map(pair).ignore_errors()
    if limit:
        ds = ds.take(limit)
    for data, images in ds.batch(batch):
        yield data.numpy(), images.numpy()


def verify(network: keras.Model, cfg: Config, split, paths: dict[str, str], formats: tuple[str, ...],
           limit: int) -> dict[str, Agreement]:
    """Loads each written format back in its own runtime and compares it with `network` image by image."""
    runners = {name: FORMATS[name].load(paths[name]) for name in formats}
    if split.kind == "synthetic":  # no encoded images to feed the bytes formats
        runners = {n: r for n, r in runners.items() if FORMATS[n].takes == "pixels"}
    tally = {name: [0, 0, 0.0] for name in runners}
    for data, images in verification_batches(cfg, split, limit):
        logits = keras.ops.convert_to_numpy(network(images, training=False)).astype(np.float32)
        probabilities = keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))
        for name, run in runners.items():
            bytes_in = FORMATS[name].takes == "bytes"
            got = np.asarray(run(data if bytes_in else images), np.float32)
            want = probabilities if bytes_in else logits
            t = tally[name]
            t[0] += len(images)
            t[1] += int(np.sum(np.argmax(got, axis=1) == np.argmax(logits, axis=1)))
            t[2] = max(t[2], float(np.max(np.abs(got - want))))
    return {name: Agreement(n, agree, diff, "probability" if FORMATS[name].takes == "bytes" else "logit")
            for name, (n, agree, diff) in tally.items()}


def agreement_line(name: str, path: str, a: Agreement) -> str:
    return (f"tfdp: export: {name}: {path}: top-1 agrees with the Keras model on {a.agreeing}/{a.images} validation "
            f"images ({a.percent:.2f}%), max |{a.compared} difference| {a.max_difference:.2e}")
