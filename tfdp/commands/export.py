"""`tfdp export`: the trained network in the formats other runtimes load, each checked in its own runtime.

Every format carries the preprocessing: uint8 pixels go in, the
normalisation (`data.mean`/`data.std`) is the graph's first layer. The two
TensorFlow formats take encoded JPEG/PNG bytes and do the evaluation's
decode, central crop and resize themselves (`DecodeImages`), then return
class probabilities: `saved_model/` (TensorFlow Serving; signature `serve`,
input `image_bytes`) and `model.keras`. ONNX and LiteRT have no JPEG decoder
op, so `model.onnx` and `model.tflite` take the uint8 NHWC batch of
evaluation-size crops and return logits, as timm's and torchvision's ONNX
exports do. The SavedModel is TensorFlow's saver applied to the function
Keras' `export(format="tf_saved_model")` traces, the LiteRT files its TFLite
converter on the pixel function (float32, or quantized after training:
float16 weights, or int8 calibrated on training images), each without Keras'
export archive, whose walk over the model is slow; `model.keras` is Keras' own `save`; ONNX is
tf2onnx in its large-model mode (below). All
come from the network rebuilt for inference: without its training-only
random flip, with grouped convolutions split into plain ones
(`tfdp.models.layers`), in float32 whatever `train.precision` trained it in.
docs/export.md is the user's guide.

Memory of the ONNX conversion: tf2onnx copies every weight into a protobuf
message on each of its optimizer passes (a dozen optimizers, repeated until
nothing changes), and protobuf's upb runtime frees a message's memory only
with the message, so through Keras' ONNX export the memory grows by the
weights' size on every pass, and TensorFlow's freezing in the mode Keras
uses holds several copies more. Here the freezing keeps the weights out of
the GraphDef (`large_model=True`), each pass writes the node into a fresh
message (`_fresh_node_protos`), and the weights go straight from tf2onnx's
tensor store into the file: the conversion needs a bounded multiple of the
weights (`onnx_memory_bound`), checked against the memory available before
it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import tempfile
import warnings
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdp.config import Config
from tfdp.data import build_source
from tfdp.data.pipeline import data_errors
from tfdp.distribute.strategy import Runtime
from tfdp.rundir.checkpoints import CheckpointStore, load_checkpoint
from tfdp.rundir.writable import writable_dir
from tfdp.train.task import ClassificationTask
from tfdp.data.preprocess import EVAL_CROPS
from tfdp.errors import UserError, first_line
from tfdp.models.layers import split_grouped_convolutions
from tfdp.config.image_sizes import eval_image_size
from tfdp.startup.console import say
from tfdp.startup.memory import available_memory


@keras.saving.register_keras_serializable(package="tfdp")
class DecodeImages(keras.layers.Layer):
    """Encoded bytes → uint8 images, exactly as the evaluation pipeline prepares them."""

    def __init__(self, image_size: int, crop_fraction: float, interpolation: str = "fast", **kwargs):
        super().__init__(**kwargs)
        self.image_size, self.crop_fraction = int(image_size), float(crop_fraction)
        self.interpolation = interpolation   # data.eval_interpolation

    def call(self, data):
        spec = tf.TensorSpec([self.image_size, self.image_size, 3], tf.uint8)
        crop = EVAL_CROPS[self.interpolation]
        return tf.map_fn(lambda d: crop(d, self.image_size, self.crop_fraction), data, fn_output_signature=spec)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.image_size, self.image_size, 3)

    def get_config(self):
        return {**super().get_config(), "image_size": self.image_size, "crop_fraction": self.crop_fraction,
                "interpolation": self.interpolation}


@dataclasses.dataclass(frozen=True)
class Format:
    """One export format: where it is written, what it needs, and how it is written and run back."""
    filename: str
    # modules it imports, each with the pip extra that installs it
    packages: tuple[tuple[str, str], ...]
    # "bytes": a batch of encoded images in, probabilities out; "pixels": uint8 NHWC crops in, logits out
    takes: str
    # (the export's `Job`, path) → None
    write: Callable
    # path → function(batch) → numpy outputs, run in the format's own runtime
    load: Callable
    # whether it measures activation ranges on training images (`Job.calibration`)
    calibrated: bool = False


@dataclasses.dataclass
class Job:
    """One `export` call: the inference network, its serving model and the config, and what its formats share:
    the files written so far (`onnx_int8` quantizes this call's model.onnx rather than converting again) and the
    calibration images, read once for every int8 format."""
    network: keras.Model
    served: keras.Model
    cfg: Config
    formats: tuple[str, ...]
    written: dict[str, str] = dataclasses.field(default_factory=dict)
    _images: np.ndarray | None = None
    _why_not: str = ""

    def calibration(self, fmt: str) -> np.ndarray:
        """`calibration_images`, read when the first int8 format asks and kept for the others, with one line
        naming the formats they calibrate; where there are none, `fmt`'s one-line error."""
        if self._images is None and not self._why_not:
            try:
                self._images = calibration_images(self.cfg)
            except UserError as e:
                self._why_not = str(e)
            else:
                names = ", ".join(n for n in FORMATS if n in self.formats and FORMATS[n].calibrated)
                say(f"tfdp: export: {names}: activation ranges from {len(self._images)} images of the training "
                    f"split '{self.cfg.data.train_split}'")
        if self._why_not:
            raise UserError(f"--format={fmt} calibrates on the training split: {self._why_not}")
        return self._images


def inference_network(model: keras.Model, portable: bool = True) -> keras.Model:
    """`build_model`'s chain (uint8 image → standardize → backbone → float32 logits) without its random flip.

    Keras' exporters call the model with `training` unset, and a Keras
    preprocessing layer's default is `training=True`: left in, the flip
    would mirror half of every served batch at random. The layers (and so
    the weights) are the model's own, except that `portable` swaps each
    grouped convolution for `SplitGroupsConv2D` (same weights, copied): what
    is exported. The check compares it with `portable=False`, Keras' own.
    """
    inputs = keras.Input(model.input_shape[1:], dtype="uint8", name="image")
    x = inputs
    for layer in model.layers[1:]:
        if not isinstance(layer, keras.layers.RandomFlip):
            x = (split_grouped_convolutions(layer) if portable else layer)(x)
    return keras.Model(inputs, x, name=model.name)


def bytes_model(network: keras.Model, cfg: Config) -> keras.Model:
    """Encoded JPEG/PNG bytes → the evaluation crop → the network → class probabilities."""
    inputs = keras.Input((), dtype="string", name="image_bytes")
    images = DecodeImages(eval_image_size(cfg.data), cfg.data.eval_crop_fraction, cfg.data.eval_interpolation,
                          name="decode")(inputs)
    probabilities = keras.layers.Softmax(name="probabilities", dtype="float32")(network(images))
    return keras.Model(inputs, probabilities, name=f"{network.name}_serving")


def pixel_signature(cfg: Config) -> list[tf.TensorSpec]:
    size = eval_image_size(cfg.data)
    return [tf.TensorSpec([None, size, size, 3], tf.uint8, name="image")]


# --- writers ------------------------------------------------------------------

def variables_held(model) -> tf.Module:
    """A `tf.Module` tracking the model's own `tf.Variable`s (Keras 3's variables wrap them, and the model itself
    is not tracked that way): what TensorFlow's saver and TFLite converter find, save and freeze."""
    holder = tf.Module()
    holder.weights = [v.value for v in model.variables]
    return holder


def _write_saved_model(job, path):
    """The SavedModel Keras' `export(format="tf_saved_model")` writes (endpoint `serve`, also `serving_default`,
    input `image_bytes`, output `output_0`), saved straight from the traced function and the network's own
    `tf.Variable`s (as `_write_litert` gives them to its converter).

    Keras' exporter first walks every object the model holds to collect lookup tables (`TrackableResource`s), a
    walk that costs more than the save itself on a deep network; a tfdp serving model has no such table, and a
    resource the function used but this holder does not track makes `tf.saved_model.save` fail, not write a
    broken file.
    """
    served = job.served

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")], autograph=False)
    def serve(image_bytes):
        return served(image_bytes, training=False)

    holder = variables_held(served)
    holder.serve = serve
    concrete = serve.get_concrete_function()
    tf.saved_model.save(holder, path, signatures={"serve": concrete, "serving_default": concrete})


def _write_keras(job, path):
    job.served.save(path)


# Weights above this many bytes go into `model.onnx.data` beside `model.onnx` (ONNX external data, as timm's large
# exports do): one protobuf file cannot exceed 2 GiB, and onnx/onnxruntime read the pair as one model.
ONNX_INLINE_BYTES = 1 << 30
# The ONNX conversion's peak resident memory above what the process holds before it, as a multiple of the float32
# weights' bytes plus a fixed part (benchmarks/export_memory.py measures it; docs/export.md states the bound).
ONNX_MEMORY_PER_WEIGHT_BYTE = 10
ONNX_MEMORY_FIXED_BYTES = 1 << 30


# The peak resident memory of a whole `tfdp export` process (TensorFlow, the model, every format written and loaded
# back in its runtime for the check), as a fixed part plus a multiple of the weights' bytes: docs/export.md's bound,
# which tests/commands/test_export_zoo.py holds every zoo family to.
EXPORT_MEMORY_FIXED_BYTES = 3 << 30
EXPORT_MEMORY_PER_WEIGHT_BYTE = 16


def export_memory_bound(weights: int) -> int:
    """Bytes a `tfdp export` of every format, with its check, may hold at its peak for `weights` bytes of weights."""
    return EXPORT_MEMORY_FIXED_BYTES + EXPORT_MEMORY_PER_WEIGHT_BYTE * weights


def weight_bytes(network: keras.Model) -> int:
    """Bytes of the network's weights in float32, as every export stores them."""
    return 4 * sum(int(np.prod(v.shape)) for v in network.weights)


def onnx_memory_bound(weights: int) -> int:
    """Bytes the ONNX conversion of a network with `weights` bytes of weights may add to the process at its peak."""
    return ONNX_MEMORY_FIXED_BYTES + ONNX_MEMORY_PER_WEIGHT_BYTE * weights


def _write_onnx(job, path, fmt: str = "onnx"):
    """model.onnx (`fmt`: the format asked for, which the errors name)."""
    network, cfg = job.network, job.cfg
    weights = weight_bytes(network)
    need, free = onnx_memory_bound(weights), available_memory()
    if free is not None and need > free:  # refused before the conversion allocates anything
        raise UserError(f"--format={fmt}: converting model '{cfg.model.name}' ({weights / 2**30:.2f} GiB of "
                        f"weights) needs up to {need / 2**30:.1f} GiB more memory, and {free / 2**30:.1f} GiB is "
                        f"available to this process (the host's memory, or its container's limit)")
    model, storage = _convert_onnx(network, pixel_signature(cfg))
    _check_onnx_ops(model.graph)
    _name_onnx_output(model.graph, "logits")
    _save_onnx(model, storage, path, external=weights > ONNX_INLINE_BYTES)


def _write_onnx_int8(job, path):
    """model.onnx quantized by ONNX Runtime's static quantizer (QDQ: a QuantizeLinear/DequantizeLinear pair around
    each quantized op, which ONNX Runtime fuses into integer kernels): weights int8 per channel, activations uint8
    per tensor (ONNX Runtime's advice for x86 CPUs), each range measured on `Job.calibration`. The input and
    output are model.onnx's (uint8 pixels in, float32 logits out): the one this export wrote, else one converted
    in a scratch folder."""
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static
    cfg = job.cfg
    images = job.calibration("onnx_int8")
    weights, path = weight_bytes(job.network), os.path.abspath(path)
    made = os.path.abspath(job.written["onnx"]) if "onnx" in job.written else None
    # In a scratch folder, made the working one: ONNX Runtime's tools leave files of their own in the working folder
    # when they fail (`sym_shape_infer_temp.onnx`, `<uuid>.data`), which are not the user's to clean up.
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        float_path, prepared = made or os.path.join(folder, "model.onnx"), os.path.join(folder, "prepared.onnx")
        if not made:
            _write_onnx(job, float_path, fmt="onnx_int8")
        # ONNX Runtime's own preparation (its graph optimizations, ONNX's shape inference), which its quantizer asks
        # for; not its symbolic shape inference, which gives up on a ViT's graph ("Incomplete symbolic shape
        # inference") where ONNX's own infers every shape tfdp's graphs have
        try:
            quant_pre_process(float_path, prepared, skip_symbolic_shape=True,
                              save_as_external_data=weights > ONNX_INLINE_BYTES)
            quantize_static(prepared, path, CalibrationBatches(images), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                            use_external_data_format=weights // 4 > ONNX_INLINE_BYTES)
        except Exception as e:  # noqa: BLE001 (ONNX Runtime's tools raise bare Exceptions for what they cannot do)
            raise UserError(f"--format=onnx_int8: ONNX Runtime's quantizer cannot quantize model "
                            f"'{cfg.model.name}': {first_line(e, 400)}") from None


class CalibrationBatches:
    """The calibration images as ONNX Runtime's calibrator reads them (its `CalibrationDataReader` protocol):
    one input dictionary after another, then None."""

    def __init__(self, images: np.ndarray, batch: int = 32):
        self.batches = iter([{"image": images[i:i + batch]} for i in range(0, len(images), batch)])

    def get_next(self):
        return next(self.batches, None)


def _convert_onnx(network, signature):
    """tf2onnx's conversion of the network (uint8 image → logits): the ModelProto, its weights held apart."""
    import tf2onnx
    from keras.src.export.tf2onnx_lib import patch_tf2onnx  # tf2onnx 1.17's numpy-2 gaps, as Keras' export does

    @tf.function(input_signature=signature, autograph=False)
    def serve(image):
        return network(image, training=False)

    quiet = logging.getLogger("tf2onnx")
    level, quiet.level = quiet.level, logging.CRITICAL  # it logs every op it folds; what it cannot convert is
    # found in the converted graph (`_check_onnx_ops`) and reported as one line
    try:
        with warnings.catch_warnings(), _fresh_node_protos():
            warnings.simplefilter("ignore", FutureWarning)  # Keras' numpy-2 patch of tf2onnx probes np.object
            patch_tf2onnx()
            _register_erfc()
            return tf2onnx.convert.from_function(serve, signature, large_model=True)
    finally:
        quiet.setLevel(level)


def _register_erfc() -> None:
    """Gives tf2onnx a conversion of TensorFlow's Erfc, which it lacks (it converts Erf): Erfc(x) = 1 - Erf(x),
    with ONNX's Erf (opset 9 on).

    TensorFlow's exact GELU (`tf.nn.gelu(approximate=False)`, what Keras' `gelu` runs) computes
    0.5 x erfc(-x / sqrt 2): the MLP of every ViT/DeiT block. Registering again replaces the same handler.
    """
    from tf2onnx import utils
    from tf2onnx.handler import tf_op

    class Erfc:
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
            one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype))
            erf = ctx.make_node("Erf", [node.input[0]], op_name_scope=node.name)
            node.type = "Sub"
            ctx.replace_inputs(node, [one.output[0], erf.output[0]])

    tf_op("Erfc")(Erfc)


@contextlib.contextmanager
def _fresh_node_protos():
    """tf2onnx's `Node.update_proto` writes a node's attributes into a fresh NodeProto while it runs.

    Upstream it clears the node's NodeProto and appends the attributes again
    on every optimizer pass; protobuf's upb runtime keeps a cleared field's
    memory in the message's arena until the message itself is freed, so each
    pass added a copy of every weight. A fresh message per update frees the
    previous one whole.
    """
    import onnx
    from tf2onnx.graph import Node
    upstream = Node.update_proto

    def update_proto(self, external_tensor_storage=None):
        fresh = onnx.NodeProto()
        for field, value in self._op.ListFields():
            if field.name == "attribute":  # rewritten from the node's own attributes by upstream
                continue
            if hasattr(value, "extend"):
                getattr(fresh, field.name).extend(value)
            elif hasattr(value, "CopyFrom"):
                getattr(fresh, field.name).CopyFrom(value)
            else:
                setattr(fresh, field.name, value)
        self._op = fresh
        return upstream(self, external_tensor_storage)

    Node.update_proto = update_proto
    try:
        yield
    finally:
        Node.update_proto = upstream


# TensorFlow ops tf2onnx leaves in a graph unconverted → what they usually are in a tfdp model.
UNCONVERTED_HINTS = {
    "StatefulPartitionedCall": "a TensorFlow function it cannot inline, such as the XLA-compiled function "
                               "Keras' TensorFlow backend runs a grouped convolution in",
}


def _check_onnx_ops(graph) -> None:
    """tf2onnx converts a graph even when it cannot convert some TensorFlow ops: it keeps them as they are, and
    onnxruntime would then refuse the file. Such a graph is not written; the ops are named."""
    import onnx
    left = [n for n in graph.node if not n.domain and not onnx.defs.has(n.op_type)]
    if left:
        kinds = sorted({n.op_type for n in left})
        hints = "; ".join(f"{k}: {UNCONVERTED_HINTS[k]}" for k in kinds if k in UNCONVERTED_HINTS)
        raise ValueError(f"tf2onnx cannot convert {len(left)} TensorFlow op(s) ({', '.join(kinds)}), the first in "
                         f"{left[0].name.rsplit('/', 1)[0]}" + (f" ({hints})" if hints else ""))


def _name_onnx_output(graph, name: str) -> None:
    """tf2onnx names the output after the traced function's (`Identity:0`); a client reads `logits`."""
    old = graph.output[0].name
    for node in graph.node:
        node.output[:] = [name if o == old else o for o in node.output]
        node.input[:] = [name if i == old else i for i in node.input]
    graph.output[0].name = name


def _save_onnx(model, storage, path: str, external: bool) -> None:
    """Writes the ModelProto with its weights taken out of tf2onnx's store one tensor at a time: inside the
    file, or (`external`) appended to `<path>.data`, which each tensor then points into (ONNX external data)."""
    import onnx
    data_path = path + ".data"
    tensors = [t for t in _graph_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    with contextlib.ExitStack() as stack:
        data = stack.enter_context(open(data_path, "wb")) if external else None
        for tensor in tensors:
            raw = storage.name_to_tensor_data.pop({e.key: e.value for e in tensor.external_data}["location"])
            del tensor.external_data[:]
            if data is None:
                tensor.data_location = onnx.TensorProto.DEFAULT
                tensor.raw_data = raw
                continue
            offset = data.tell()
            data.write(raw)
            for key, value in (("location", os.path.basename(data_path)), ("offset", str(offset)),
                               ("length", str(len(raw)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    if not external and os.path.exists(data_path):
        os.remove(data_path)  # a previous, larger export's weights: not this model's
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def _graph_tensors(graph):
    """Every TensorProto of a graph: its initializers and the tensors in its nodes' attributes, subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _graph_tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _graph_tensors(sub)


def _write_litert(job, path, quantize=None):
    """TensorFlow's TFLite converter on the network's traced function (uint8 pixels → logits; signature
    `serving_default`, input `image`, output `output_0`, as Keras' exporter names them), `quantize(converter,
    job)` setting its quantization (none: float32).

    Keras' `export(format="litert")` converts the same function but first builds and writes its whole export
    archive, whose walk over the model's objects is slow: a LiteRT export of ResNeXt-50 took 12 s instead of 18 s
    this way, the same file (docs/benchmarks.md). The converter freezes the variables it finds tracked by the
    object it is given: a `tf.Module` holding the network's own `tf.Variable`s (Keras 3's variables wrap them;
    the network itself is not tracked that way, and without them the file's weights would be uninitialised).
    """
    network = job.network

    @tf.function(input_signature=pixel_signature(job.cfg), autograph=False)
    def serve(image):
        return network(image, training=False)

    holder = variables_held(network)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()], holder)
    # Builtin ops only: the plain LiteRT interpreter (phones, ai_edge_litert) has no TensorFlow (Flex) ops.
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if quantize:
        quantize(converter, job)
    flatbuffer = converter.convert()
    with open(path, "wb") as f:
        f.write(flatbuffer)


def float16_weights(converter, job) -> None:
    """Weights stored in float16: half the file. The CPU interpreter widens them to float32 once, at load; GPU
    delegates compute in float16."""
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]


def int8_calibrated(converter, job) -> None:
    """Weights and activations in int8 (a quarter of the file; integer kernels), each activation's range
    measured on `Job.calibration`. Every op of the network is an int8 op (`TFLITE_BUILTINS_INT8`: a model
    with an op LiteRT cannot quantize fails to convert, rather than run part in float unseen); only the ends
    stay as model.tflite's, so the file is used the same way: uint8 pixels are cast and quantized on the way in,
    the logits dequantized to float32 on the way out."""
    images = job.calibration("litert_int8")
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([images[i:i + 1]] for i in range(len(images)))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]


CALIBRATION_IMAGES = 256   # TensorFlow's post-training quantization guide: a few hundred representative images


def calibration_images(cfg: Config, count: int = CALIBRATION_IMAGES) -> np.ndarray:
    """Up to `count` images of the training split (`data.train_split`), through the evaluation crop, for the int8
    formats to measure their activations' ranges on: what the deployed model will be given, and not the
    validation images the export is checked on. The files are spread evenly over the split's listing, so a
    class-folder tree, listed class by class, gives every class. A missing split is its one-line error."""
    name = cfg.data.train_split
    split = build_source(cfg.data, splits=(name,)).split(name)
    share = split.subset(range(0, len(split.files), max(1, len(split.files) // count)))
    batches = [images for _, images in verification_batches(cfg, share, count)]
    if not batches:
        raise UserError(f"no image of '{name}' could be read")
    return np.concatenate(batches)


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
    "onnx_int8": Format("model_int8.onnx", (("tf2onnx", "onnx"), ("onnx", "onnx"), ("onnxruntime", "onnx")), "pixels",
                        _write_onnx_int8, _run_onnx, calibrated=True),
    "litert": Format("model.tflite", (("ai_edge_litert.interpreter", "litert"),), "pixels",
                     _write_litert, _run_litert),
    "litert_float16": Format("model_float16.tflite", (("ai_edge_litert.interpreter", "litert"),), "pixels",
                             functools.partial(_write_litert, quantize=float16_weights), _run_litert),
    "litert_int8": Format("model_int8.tflite", (("ai_edge_litert.interpreter", "litert"),), "pixels",
                          functools.partial(_write_litert, quantize=int8_calibrated), _run_litert, calibrated=True),
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


@dataclasses.dataclass
class Written:
    """What `export` wrote (format or "classes" → path) and, format → one-line reason, what it could not."""
    paths: dict[str, str]
    failed: dict[str, str]

    def failure_line(self) -> str:
        """The failed formats, each with its reason, and the ones written: one line."""
        wrote = [n for n in self.paths if n in FORMATS]
        return "; ".join(self.failed.values()) + f" (written: {', '.join(wrote) if wrote else 'no format'})"


def export(model: keras.Model, cfg: Config, class_names: tuple[str, ...], out_dir: str,
           formats: tuple[str, ...] = DEFAULT_FORMATS) -> Written:
    """Writes each format (and `classes.json`) into `out_dir`.

    A format its converter cannot make, that would not fit in memory or
    whose file cannot be written is recorded with its one-line reason, and
    the next format is written all the same: one model tf2onnx cannot take
    should not cost its LiteRT file. The TensorFlow formats take every tfdp
    model, so a conversion error there is a bug and keeps its traceback.
    The formats are written in `FORMATS`' order, so a quantized file
    follows the float32 one it can start from.
    """
    check_packages(formats)
    os.makedirs(out_dir, exist_ok=True)
    network = inference_network(model)
    job = Job(network, bytes_model(network, cfg), cfg, formats)
    written = Written(job.written, {})
    for name in sorted(formats, key=list(FORMATS).index):
        path = os.path.join(out_dir, FORMATS[name].filename)
        try:
            FORMATS[name].write(job, path)
        except UserError as e:
            written.failed[name] = str(e)
            continue
        except OSError as e:  # the file or folder cannot be made there (a folder in the way, a full disk)
            written.failed[name] = f"--format={name}: cannot write {path}: {e.strerror or first_line(e)}"
            continue
        except (ValueError, TypeError, NotImplementedError, RuntimeError, tf.errors.OpError, MemoryError) as e:
            if name in DEFAULT_FORMATS:
                raise
            written.failed[name] = (f"--format={name}: Keras' exporter cannot convert model '{cfg.model.name}': "
                                    f"{first_line(e, 400)}")
            continue
        written.paths[name] = path
    written.paths["classes"] = os.path.join(out_dir, "classes.json")
    with open(written.paths["classes"], "w", encoding="utf-8") as f:
        json.dump(list(class_names), f)
    return written


# --- verification -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Agreement:
    """How one exported format's answers compare with the Keras model's on the same images."""
    images: int
    agreeing: int        # images whose top-1 class is the Keras model's
    max_difference: float
    compared: str        # "logit" or "probability"
    scale: float = 1.0   # the largest |output| of the Keras model over the same images

    @property
    def percent(self) -> float:
        return 100.0 * self.agreeing / max(self.images, 1)

    @property
    def relative_difference(self) -> float:
        """max |difference| / max |Keras output|: float32 rounding is about 1e-6 of the outputs' scale whatever
        that scale is, so this tells rounding from a broken graph where the absolute figure cannot (a logit
        difference of 40 is rounding on logits of 1e8, and a broken graph on logits of 10)."""
        return self.max_difference / self.scale if self.scale > 0 else (0.0 if self.max_difference == 0 else np.inf)


def verification_batches(cfg: Config, split, limit: int, batch: int = 64):
    """(encoded bytes, evaluation crops) of the first `limit` images of `split` (0: all), in listing order.

    The crops are the evaluation pipeline's (`EVAL_CROPS`, the same function
    `DecodeImages` runs); images that do not decode are left out. A synthetic
    split has no encoded bytes: its bytes are empty strings.
    """
    from tfdp.data import decoding, readers
    size = eval_image_size(cfg.data)
    data_cfg = dataclasses.replace(cfg.data, cache=False, image_size=size)  # payloads are paths, read here
    example = decoding.example_fn(split, data_cfg, cfg.model.num_classes)
    ds = readers.payloads(split, data_cfg, tf.distribute.InputContext(), False)
    # a payload is one tensor (a synthetic example's number) or a tuple (a record's shard and offset, an image's path
    # and label)
    def pair(*element):
        element = element if len(element) > 1 else element[0]
        if split.kind == "synthetic":
            return tf.constant(b""), example(element, 0, None)[0]
        crop = EVAL_CROPS[cfg.data.eval_interpolation]
        return example(element, 0, lambda data, index: (data, crop(data, size, cfg.data.eval_crop_fraction)))[0]
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
    tally = {name: [0, 0, 0.0, 0.0] for name in runners}
    reference = ReferenceOutputs()
    for data, images in verification_batches(cfg, split, limit):
        logits = keras.ops.convert_to_numpy(network(images, training=False)).astype(np.float32)
        reference.add(logits)
        probabilities = keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))
        for name, run in runners.items():
            bytes_in = FORMATS[name].takes == "bytes"
            got = np.asarray(run(data if bytes_in else images), np.float32)
            want = probabilities if bytes_in else logits
            t = tally[name]
            t[0] += len(images)
            # top-1 of like against like: probabilities of near-tied logits can be equal in float32
            t[1] += int(np.sum(np.argmax(got, axis=1) == np.argmax(want, axis=1)))
            t[2] = max(t[2], float(np.max(np.abs(got - want))))
            t[3] = max(t[3], float(np.max(np.abs(want))))
    if (problem := reference.problem()):
        raise UserError(f"{problem}; written, not verified: {', '.join(paths[name] for name in formats)}")
    return {name: Agreement(n, agree, diff, "probability" if FORMATS[name].takes == "bytes" else "logit", scale)
            for name, (n, agree, diff, scale) in tally.items()}


class ReferenceOutputs:
    """The Keras model's logits over the verification images, reduced to what says whether comparing with
    them means anything: a model whose logits are the same for every image (dead units after a diverged
    run: every format "agrees" on its one class) or are not finite (nan's argmax is 0 in every runtime)
    would have every format agree with it on every image."""

    def __init__(self):
        self.images = self.non_finite = 0
        self.low = self.high = None   # per class, over the finite images

    def add(self, logits: np.ndarray) -> None:
        finite = np.all(np.isfinite(logits), axis=1)
        self.images += len(logits)
        self.non_finite += int(np.sum(~finite))
        if np.any(finite):
            low, high = logits[finite].min(axis=0), logits[finite].max(axis=0)
            self.low = low if self.low is None else np.minimum(self.low, low)
            self.high = high if self.high is None else np.maximum(self.high, high)

    def problem(self) -> str:
        """'' when the logits can be compared; else one line saying why not."""
        if self.non_finite:
            return (f"the model's logits are not finite (nan or inf) for {self.non_finite} of the {self.images} "
                    f"validation images checked: nothing to compare; the run diverged?")
        if self.images < 2 or self.low is None:
            return ""
        scale = float(max(np.max(np.abs(self.low)), np.max(np.abs(self.high))))
        # float32 rounds logits to about 1e-7 of their scale: a spread within that is no spread at all
        if float(np.max(self.high - self.low)) <= 1e-6 * scale:
            return (f"the model's logits are the same for every one of the {self.images} validation images "
                    f"checked: nothing to compare; the run diverged?")
        return ""


def agreement_line(name: str, path: str, a: Agreement) -> str:
    """One format's agreement: top-1, then the largest difference relative to the outputs' scale (the absolute
    difference and the largest |output| in brackets)."""
    return (f"tfdp: export: {name}: {path}: top-1 agrees with the Keras model on {a.agreeing}/{a.images} validation "
            f"images ({a.percent:.2f}%), max |{a.compared} difference| / max |{a.compared}| "
            f"{a.relative_difference:.2e} ({a.max_difference:.2e} of {a.scale:.2e})")


def export_checkpoint(cfg: Config, runtime: Runtime, checkpoint: str | None, out_dir: str | None,
                      formats: tuple[str, ...] | None = None, verify_images: int | None = 1000,
                      shown=lambda text: text, pretrained=None) -> dict:
    """Writes the export formats, then (`verify_images` not None; 0: the whole split) runs that many validation
    images through each, loaded back in its own runtime, and prints its agreement with the Keras model.

    A format that could not be written does not stop the others: they are written and checked first, then
    its reason is raised as one line naming the formats that were written. `shown`: a line with its paths
    named as the user finds them (a bucket run's objects, where this one writes a local copy). `pretrained`
    (`tfdp.commands.from_weights.Pretrained`): model.init_from's weights and their classes, not a checkpoint's;
    the validation split then only checks the formats, where data.dir has one."""
    if pretrained is not None:
        cfg = pretrained.cfg
    formats = formats or DEFAULT_FORMATS
    if verify_images is not None and verify_images < 0:
        raise UserError(f"--verify_images must be 0 (the whole validation split) or more, got {verify_images}")
    check_packages(formats)
    model_dir = os.path.expanduser(cfg.model_dir)
    out_dir = writable_dir(out_dir or os.path.join(model_dir, "export"), "the export folder")
    # for the class names and the verification (from weights alone: the verification only, where there is data)
    source = build_source(cfg.data, splits=(cfg.data.val_split,)) if pretrained is None else _checking_source(
        cfg, verify_images)
    # Exports are float32 whatever the training precision (ONNX's exporter requires it; the weights are float32).
    model = ClassificationTask(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="float32"))
                               ).build_model("serve")
    if pretrained is None:
        load_checkpoint(model, checkpoint or CheckpointStore(model_dir).best_weights, cfg)
    else:
        pretrained.load(model)
        if source is None:
            verify_images = None
    written = export(model, cfg, pretrained.names if pretrained is not None else source.class_names, out_dir,
                     formats)
    paths = written.paths
    made = [f for f in formats if f in paths]
    if made:
        say(shown(f"tfdp: export: wrote {', '.join(paths[f] for f in made)} and {paths['classes']}"))
    if verify_images is not None and made:
        split = source.split(cfg.data.val_split)
        with data_errors():
            # The reference is Keras' own network (grouped convolutions as Keras runs them, not as exported).
            agreements = verify(inference_network(model, portable=False), cfg, split, paths, tuple(made),
                                verify_images)
        for name, agreement in agreements.items():
            say(shown(agreement_line(name, paths[name], agreement)))
        paths["agreement"] = agreements
    if written.failed:  # after the others are written and checked: one line, exit status 2
        raise UserError(written.failure_line())
    return paths


def _checking_source(cfg: Config, verify_images: int | None):
    """The validation split an export from weights alone is checked on, where data.dir lists one; None (and one
    line saying the check is skipped) where it does not."""
    if verify_images is None:
        return None
    try:
        return build_source(cfg.data, splits=(cfg.data.val_split,))
    except UserError as e:
        say(f"tfdp: export: not checked on images ({first_line(e)}); give --data_dir with a validation split to "
            f"check each format against Keras")
        return None
