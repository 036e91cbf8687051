"""`tfdp export --format=...`: every format, loaded back in its own runtime, gives the Keras model's answers.

The run is a real `tfdp train` (a ResNet with batch norm, `resnet10_small`: the
demo's small-image stem with one block per stage, the random flip on); each
export is read back by the runtime a user would deploy it on: onnxruntime, the
LiteRT interpreter, `tf.saved_model.load`, `keras.saving.load_model`.
"""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, assert_one_line_error, run_tfdp
from tfdp.rundir.checkpoints import CheckpointStore
from support.cgroups import memory_limited, why_no_memory_cgroup
from support.inprocess import cli_config, export_in_process
from tfdp.config import DistributeConfig, validate
from tfdp.data import build_source
from tfdp.data.pipeline import eval_dataset
from tfdp.commands.export import export_checkpoint
from tfdp.rundir.checkpoints import load_checkpoint
from tfdp.commands.export import inference_network
from tfdp.distribute.strategy import make_runtime
from tfdp.train.task import model_in_precision, serving_model

MIN_AGREEMENT = 0.995
FLOAT32_FORMATS = ("saved_model", "keras", "onnx", "litert")
QUANTIZED_FORMATS = ("litert_float16", "litert_int8", "onnx_int8")
# int8 rounds every activation to one of 256 levels of its calibrated range: a near tie may change its answer
MIN_INT8_AGREEMENT = 0.97


@pytest.fixture(scope="module")
def trained_run(digits_dir, tmp_path_factory):
    """One epoch of the demo's recipe with resnet10_small (batch norm, the demo's stem and layer groups; 0.6x the
    CPU of its resnet18_small) on the 1,437 + 360 digits, random flip on; deterministic, so the
    network the checks below need to tell the images apart is the same network in every run (one epoch left it
    anywhere from 19 % to 90 % right when thread timing decided)."""
    run_dir = str(tmp_path_factory.mktemp("run"))
    args = ("--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={digits_dir}",
            f"--model_dir={run_dir}", "--model=resnet10_small", "--set=data.hflip=true")
    # A process of its own: train.deterministic turns op determinism on for the rest of the process's life.
    result = run_tfdp("train", *args, "--epochs=1", "--set=schedule.warmup_epochs=0", "--set=optimizer.lr=0.05",
                      "--set=train.deterministic=true", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return args, cli_config(*args)


def keras_reference(cfg):
    """The trained Keras network, the validation crops, their files and the network's logits."""
    model = serving_model(cfg)
    load_checkpoint(model, CheckpointStore(cfg.model_dir).best_weights, cfg)
    split = build_source(cfg.data).split("val")
    batches = list(eval_dataset(split, cfg.data, 64))
    real = np.concatenate([w.numpy() for _, _, w in batches]) > 0
    images = np.concatenate([x.numpy() for x, _, _ in batches])[real]
    logits = model.predict(images, verbose=0)
    return model, images, split.files, logits


@pytest.fixture(scope="module")
def reference(trained_run):
    """`keras_reference` of the trained run, shared by the two tests that compare the exports with it."""
    return keras_reference(trained_run[1])


def run_litert(path, images):
    from ai_edge_litert.interpreter import Interpreter
    interpreter = Interpreter(model_path=path)
    index = interpreter.get_input_details()[0]["index"]
    interpreter.resize_tensor_input(index, images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(index, images)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def run_onnx(path, images):
    import onnxruntime
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"image": images})[0]


def agreement(name, got, logits, want):
    """Fraction of top-1 answers equal to the Keras model's, printed with the largest output difference."""
    agree = float(np.mean(np.argmax(got, axis=1) == np.argmax(logits, axis=1)))
    diff = float(np.max(np.abs(got - want)))
    print(f"{name}: top-1 agreement with Keras {100 * agree:.2f}% of {len(logits)} validation images, "
          f"max |difference| {diff:.2e}")
    return agree, diff


AGREEMENT_LINE = re.compile(r"tfdp: export: (\w+): .*: top-1 agrees with the Keras model on (\d+)/(\d+) validation "
                            r"images \(([\d.]+)%\), max \|(\w+) difference\| / max \|\w+\| (\S+) \((\S+) of (\S+)\)$")


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    """`tfdp export` of the trained run in every format, checked on the whole validation split, run in this
    process (tests/support/inprocess.py; its exit status and one-line error are
    test_one_format_that_cannot_be_written_does_not_cost_the_others'): what it printed, and the files the tests
    below read back in their own runtimes (one export, shared). The quantized formats are asked for first: the
    network is still converted to ONNX once, `onnx_int8` quantizing the model.onnx written for `onnx`."""
    from tfdp.commands import export
    args, _ = trained_run
    out = tmp_path_factory.mktemp("exported") / "export"
    before = set(os.listdir())
    conversions, convert = [], export._convert_onnx

    def counted(*a, **k):
        conversions.append(a)
        return convert(*a, **k)
    with pytest.MonkeyPatch.context() as patch:   # counted, and converted for real
        patch.setattr(export, "_convert_onnx", counted)
        _, printed = export_in_process(*args, export_dir=str(out), formats=(*QUANTIZED_FORMATS, *FLOAT32_FORMATS),
                                       verify_images=0)
    assert len(conversions) == 1
    # The converters' own scratch files (ONNX Runtime's shape inference writes some into the working folder) are
    # not the user's to clean up.
    assert set(os.listdir()) == before, set(os.listdir()) ^ before
    return printed, out


def test_every_format_agrees_with_keras_in_its_own_runtime(trained_run, exported, reference):
    _, cfg = trained_run
    stdout, out = exported
    printed = {m[1]: m for m in (AGREEMENT_LINE.match(line) for line in stdout.splitlines()) if m}
    assert sorted(printed) == sorted(FLOAT32_FORMATS + QUANTIZED_FORMATS), stdout
    for name, m in printed.items():
        least = MIN_INT8_AGREEMENT if name.endswith("_int8") else MIN_AGREEMENT
        assert int(m[3]) == 360 and int(m[2]) >= least * 360, m[0]
        assert m[5] == ("logit" if name.startswith(("onnx", "litert")) else "probability")
        assert float(m[6]) == pytest.approx(float(m[7]) / float(m[8]), rel=2e-2, abs=1e-30)  # relative to the scale

    # The same, measured here, apart from tfdp's own check.
    model, images, files, logits = reference
    # The comparison means something only if the network tells the images apart: one epoch leaves it anywhere
    # between 30 % and 90 % right, so ask for twice chance and for at least half of the classes among its answers,
    # not for a given accuracy.
    answers = np.argmax(logits, 1)
    assert 0.2 < np.mean(answers == np.array(build_source(cfg.data).split("val").labels)) < 1.0
    assert len(np.unique(answers)) >= 5, np.bincount(answers)
    probabilities = tf.nn.softmax(logits).numpy()
    data = tf.constant([open(f, "rb").read() for f in files])
    loaded = tf.saved_model.load(str(out / "saved_model"))  # keep a reference: it owns the variables
    runs = {
        "onnx": (run_onnx(str(out / "model.onnx"), images), logits, 1e-3),
        "litert": (run_litert(str(out / "model.tflite"), images), logits, 1e-3),
        "saved_model": (loaded.serve(data).numpy(), probabilities, 1e-5),
        "keras": (keras.saving.load_model(str(out / "model.keras")).predict(data, verbose=0), probabilities, 1e-5),
    }
    for name, (got, want, tolerance) in runs.items():
        agree, diff = agreement(name, got, logits, want)
        assert agree >= MIN_AGREEMENT, name
        # Tight: a random flip left in the served graph (Keras' exporters call it with training unset, and a
        # preprocessing layer's default is training=True) would change half the outputs by whole units.
        assert diff < tolerance, name
    graph = open(out / "saved_model" / "saved_model.pb", "rb").read()
    assert b"_XlaMustCompile" not in graph and b"XlaLaunch" not in graph  # no XLA cluster in the served graph


def test_quantized_files_are_a_half_and_a_quarter_and_compute_in_their_types(trained_run, exported, reference):
    """`litert_float16` stores float16 weights; `litert_int8` runs every op of the network on int8 tensors and
    `onnx_int8` quantizes the input of every convolution and dense layer (QDQ), both with the activation ranges
    of 256 training images. All take the float32 files' uint8 pixels and give float32 logits, and all answer as
    the Keras model does (int8 nearly: its accuracy within two points of Keras')."""
    import onnx
    import onnxruntime
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    _, cfg = trained_run
    stdout, out = exported
    # Read once for both int8 formats.
    calibrated = [line for line in stdout.splitlines() if "activation ranges" in line]
    assert calibrated == ["tfdp: export: onnx_int8, litert_int8: activation ranges from 256 images of the training "
                          "split 'train'"], stdout
    size = {name: os.path.getsize(out / name) for name in ("model.tflite", "model_float16.tflite",
                                                           "model_int8.tflite", "model.onnx", "model_int8.onnx")}
    assert 0.45 < size["model_float16.tflite"] / size["model.tflite"] < 0.55, size
    assert 0.2 < size["model_int8.tflite"] / size["model.tflite"] < 0.3, size
    assert 0.2 < size["model_int8.onnx"] / size["model.onnx"] < 0.3, size

    def ops(path):
        """(op name, its output's type) of each op, as the interpreter runs it without a delegate."""
        interpreter = Interpreter(model_path=str(path),
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
        interpreter.allocate_tensors()
        types = {t["index"]: t["dtype"] for t in interpreter.get_tensor_details()}
        ends = (interpreter.get_input_details()[0]["dtype"], interpreter.get_output_details()[0]["dtype"])
        return [(op["op_name"], types[op["outputs"][0]]) for op in interpreter._get_ops_details()], ends

    int8_ops, ends = ops(out / "model_int8.tflite")
    assert ends == (np.uint8, np.float32)
    body = int8_ops[2:-1]   # after the input's cast and quantization, before the logits' dequantization
    assert [name for name, _ in int8_ops[:2]] == ["CAST", "QUANTIZE"] and int8_ops[-1][0] == "DEQUANTIZE", int8_ops
    assert sum(name == "CONV_2D" for name, _ in body) >= 10 and all(t == np.int8 for _, t in body), int8_ops
    float16_ops, ends = ops(out / "model_float16.tflite")
    assert ends == (np.uint8, np.float32) and ("DEQUANTIZE", np.float32) in float16_ops   # float16 weights widened

    graph = onnx.load(str(out / "model_int8.onnx")).graph
    dequantized = {node.output[0] for node in graph.node if node.op_type == "DequantizeLinear"}
    layers = [node for node in graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
    assert len(layers) >= 11 and all(node.input[0] in dequantized and node.input[1] in dequantized
                                     for node in layers), [(n.op_type, list(n.input)) for n in layers]
    session = onnxruntime.InferenceSession(str(out / "model_int8.onnx"), providers=["CPUExecutionProvider"])
    assert (session.get_inputs()[0].type, session.get_outputs()[0].type) == ("tensor(uint8)", "tensor(float)")

    model, images, files, logits = reference
    labels = np.array(build_source(cfg.data).split("val").labels)
    runs = {"model_float16.tflite": (run_litert(str(out / "model_float16.tflite"), images), MIN_AGREEMENT, 1e-3),
            "model_int8.tflite": (run_litert(str(out / "model_int8.tflite"), images), MIN_INT8_AGREEMENT, 0.1),
            "model_int8.onnx": (run_onnx(str(out / "model_int8.onnx"), images), MIN_INT8_AGREEMENT, 0.1)}
    for name, (got, least, most) in runs.items():
        agree, diff = agreement(name, got, logits, logits)
        assert agree >= least and diff < most * np.max(np.abs(logits)), name
        right, keras_right = np.mean(np.argmax(got, 1) == labels), np.mean(np.argmax(logits, 1) == labels)
        print(f"{name}: top-1 {100 * right:.2f}% against Keras' {100 * keras_right:.2f}%")
        assert abs(right - keras_right) <= 0.02, name


def test_exported_graphs_take_raw_uint8_and_normalise_inside(trained_run, exported, reference):
    """uint8 pixels into ONNX and LiteRT (the files `tfdp export` wrote) give what the bare backbone gives on
    (x - data.mean) / data.std."""
    _, cfg = trained_run
    _, out = exported
    paths = {"onnx": str(out / "model.onnx"), "litert": str(out / "model.tflite")}
    model, images, _, _ = reference
    backbone = next(layer for layer in model.layers if isinstance(layer, keras.Model))
    normalised = (images.astype(np.float32) - np.float32(cfg.data.mean)) / np.float32(cfg.data.std)
    expected = backbone(normalised, training=False).numpy()
    import onnxruntime
    session = onnxruntime.InferenceSession(paths["onnx"], providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    assert (given.name, given.type, given.shape[1:]) == ("image", "tensor(uint8)", [16, 16, 3])
    assert session.get_outputs()[0].name == "logits"
    for name, got in (("onnx", run_onnx(paths["onnx"], images)), ("litert", run_litert(paths["litert"], images))):
        print(f"{name}: max |logit difference| from the backbone on normalised input "
              f"{np.max(np.abs(got - expected)):.2e} (logits up to {np.max(np.abs(expected)):.1f})")
        np.testing.assert_allclose(got, expected, atol=1e-3)


@pytest.mark.full(reason="60 CPU-s: float32 logits under mixed precision are tests/models/test_models.py's "
                         "test_logits_stay_float32_under_mixed_precision, every format's agreement "
                         "test_every_format_agrees_with_keras_in_its_own_runtime")
def test_keras_applications_model_trained_in_mixed_precision_exports_in_float32(small_dir, tmp_path):
    """mobilenet_v2 (keras.applications, depthwise convolutions, ReLU6) at 32 px, trained under mixed_bfloat16 for
    12 steps of 32 on the 320 training digits of `small_dir`, checked on its 40 validation digits. Trained eagerly
    (`run_eagerly`): tracing the bfloat16 training step of mobilenet_v2 costs more CPU than 12 eager steps, and how
    the steps run does not change what is exported (the float32 copy of the bfloat16-trained weights). Steps of 32
    (not 64: 10 % less CPU) still leave it answering all 10 classes, 87.5 % of its answers agreeing with the export
    below (the same in 6 runs); fewer steps do not (at 6 it answers one class for everything)."""
    cfg = validate({"model_dir": str(tmp_path), "model": {"name": "mobilenet_v2", "num_classes": 10},
                    "data": {"format": "image_folder", "dir": small_dir, "image_size": 32, "eval_crop_fraction": 1.0},
                    "train": {"precision": "mixed_bfloat16"}})
    keras.utils.set_random_seed(2)
    model = model_in_precision(cfg)
    assert model.get_layer("standardize").compute_dtype == "bfloat16"
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    for layer in model.get_layer("mobilenetv2_1.00_32").layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.5  # moving statistics that follow 12 steps: at 0.99 they stay at their start
    shuffled = eval_dataset(build_source(cfg.data).split("train"), cfg.data, 64).unbatch().shuffle(2000, seed=0)
    model.fit(shuffled.repeat().batch(32).take(12), verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    paths = export_checkpoint(cfg, make_runtime(DistributeConfig(strategy="one_device")), path, str(tmp_path / "out"),
                              ("onnx", "litert"), verify_images=0)
    for name in ("onnx", "litert"):
        a = paths["agreement"][name]
        print(f"mobilenet_v2 {name}: {a.percent:.2f}% of {a.images}, max |logit difference| {a.max_difference:.2e}")
        assert a.images == 40 and a.agreeing >= MIN_AGREEMENT * a.images
    batches = list(eval_dataset(build_source(cfg.data).split("val"), cfg.data, 64))
    real = np.concatenate([w.numpy() for _, _, w in batches]) > 0
    images = np.concatenate([x.numpy() for x, _, _ in batches])[real]
    got = run_onnx(paths["onnx"], images)
    assert got.dtype == np.float32
    # The float32 export against the bfloat16 model it came from: the same model, but bfloat16's 8-bit mantissa
    # moves the close logits of a barely trained model, so only a clear majority of answers is required.
    trained = model.predict(images, verbose=0)
    assert len(set(np.argmax(trained, 1))) > 1  # not one class for everything: agreement would mean little
    print(f"mobilenet_v2 onnx (float32) vs the mixed_bfloat16 model: top-1 agreement "
          f"{100 * np.mean(np.argmax(got, 1) == np.argmax(trained, 1)):.1f}% of {len(images)}")
    assert np.mean(np.argmax(got, 1) == np.argmax(trained, 1)) >= 0.5


def test_bad_export_requests_are_one_line(small_dir, tmp_path):
    args = ("--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={small_dir}",
            f"--model_dir={tmp_path / 'run'}")
    result = run_tfdp("export", *args, "--format=onnx,tflite")
    assert_one_line_error(result, 2, "unknown export format 'tflite'", "litert")

    (tmp_path / "a_file").write_text("")
    result = run_tfdp("export", *args, f"--export_dir={tmp_path / 'a_file' / 'export'}")
    assert_one_line_error(result, 2, "cannot write to the export folder", "a part of the path is a file")

    for module, fmt in (("tf2onnx", "onnx"), ("ai_edge_litert", "litert")):
        # Python's own report of a package that is not there: a module set to None in sys.modules fails
        # to import with ModuleNotFoundError, as an uninstalled one does.
        code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['tfdp', *sys.argv[1:]]; "
                "from tfdp.cli import run; run()")
        result = subprocess.run([sys.executable, "-c", code, "export", *args, f"--format=saved_model,{fmt}"],
                                capture_output=True, text=True, timeout=300, cwd=REPO)
        assert_one_line_error(result, 2, f"--format={fmt} needs the Python package '{module}'",
                              f"pip install 'tfdp[{fmt}]'")
        assert not os.path.exists(tmp_path / "run" / "export" / "saved_model")  # nothing written before the check


def test_a_model_onnx_cannot_take_is_named_and_leaves_no_file(digits_dir, tmp_path):
    """An op tf2onnx has no conversion for (lgamma): one line naming the op and the layer, and no broken
    model.onnx; the SavedModel asked for in the same call is written all the same."""
    from tfdp.commands.export import export
    from tfdp.models.build import Standardize
    cfg = validate({"model_dir": str(tmp_path), "model": {"name": "simple_cnn", "num_classes": 10},
                    "data": {"format": "image_folder", "dir": digits_dir, "image_size": 16}})
    inputs = keras.Input((16, 16, 3), dtype="uint8")
    x = Standardize(cfg.data.mean, cfg.data.std)(inputs)
    x = keras.layers.Conv2D(4, 3, name="stem")(x)
    x = keras.layers.Lambda(lambda t: tf.math.lgamma(tf.abs(t) + 1.0), name="lgamma")(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x)))
    written = export(model, cfg, tuple(map(str, range(10))), str(tmp_path / "out"), ("onnx", "saved_model"))
    message = written.failed["onnx"]
    print(message)
    assert message.startswith("--format=onnx: Keras' exporter cannot convert model 'simple_cnn': tf2onnx cannot "
                              "convert 1 TensorFlow op(s) (Lgamma), the first in ")
    assert "lgamma" in message and "\n" not in message
    assert not os.path.exists(tmp_path / "out" / "model.onnx")
    assert sorted(written.paths) == ["classes", "saved_model"]
    assert "(written: saved_model)" in written.failure_line()
    assert os.path.exists(tmp_path / "out" / "saved_model" / "saved_model.pb")


def test_one_format_that_cannot_be_written_does_not_cost_the_others(trained_run, tmp_path):
    """A folder where model.onnx should go (a real write failure), and an int8 LiteRT file asked for with no
    training split to calibrate it on: the other three formats are written and checked, then one line names the
    failed formats and the written ones, and the exit status is 2."""
    args, _ = trained_run
    out = tmp_path / "export"
    (out / "model.onnx").mkdir(parents=True)
    result = run_tfdp("export", *args, "--format=saved_model,keras,onnx,litert,litert_int8", f"--export_dir={out}",
                      "--verify_images=32", "--set=data.train_split=nosuch", timeout=600)
    line = assert_one_line_error(result, 2, "--format=onnx: cannot write", "model.onnx",
                                 "--format=litert_int8 calibrates on the training split: ", "no 'nosuch' split",
                                 "(written: saved_model, keras, litert)")
    print(line)
    printed = {m[1] for m in (AGREEMENT_LINE.match(line) for line in result.stdout.splitlines()) if m}
    assert printed == {"saved_model", "keras", "litert"}, result.stdout
    assert (out / "model.tflite").is_file() and (out / "model.keras").is_file()
    assert (out / "saved_model" / "saved_model.pb").is_file() and (out / "classes.json").is_file()


# A container's memory limit below the ONNX conversion's bound (1 GiB + 10 x the weights: 1.2 GiB for this network),
# and well above what `tfdp export` charges to a fresh cgroup by the time it checks (0.33 GiB at its peak, measured)
CONTAINER_LIMIT = 1 << 30


@pytest.mark.skipif(why_no_memory_cgroup() is not None, reason=str(why_no_memory_cgroup()))
def test_a_conversion_its_container_cannot_hold_is_refused_before_it_starts(trained_run, tmp_path):
    """`tfdp export` in a real memory cgroup of 1 GiB, as in a container with that limit, on a host with far more
    free: both ONNX formats are refused in one line naming each, with the memory the cgroup leaves, instead of
    the kernel killing the conversion at the limit; nothing is written."""
    args, _ = trained_run
    out = tmp_path / "export"
    with memory_limited(CONTAINER_LIMIT) as inside:
        result = subprocess.run(inside([sys.executable, "-m", "tfdp", "export", *args, "--format=onnx_int8,onnx",
                                        f"--export_dir={out}"]), capture_output=True, text=True, timeout=300,
                                cwd=REPO)
    line = assert_one_line_error(result, 2, "--format=onnx: converting model 'resnet10_small' (",
                                 "--format=onnx_int8: converting model 'resnet10_small' (", "(written: no format)")
    print(line)
    available = [float(g) for g in re.findall(r"and ([0-9.]+) GiB is available to this process", line)]
    assert len(available) == 2 and max(available) < CONTAINER_LIMIT / 2**30, line
    assert not (out / "model.onnx").exists() and not (out / "model_int8.onnx").exists()


@pytest.fixture(scope="module")
def big_logits_export(small_dir, tmp_path_factory):
    """One in-process export (ONNX and LiteRT, checked on the 40 validation digits) of a ResNet with batch norm
    (resnet10_small) with random weights, its classifier's kernel scaled by 1e7 (logits of about 1e7), and
    `ONNX_INLINE_BYTES` lowered to 0, so that its ONNX weights take the external-data path: the model, what the
    export returned, and the lines it printed."""
    import contextlib
    import io

    import tfdp.commands.export
    tmp_path = tmp_path_factory.mktemp("big-logits")
    cfg = validate({"model_dir": str(tmp_path), "model": {"name": "resnet10_small", "num_classes": 10},
                    "data": {"format": "image_folder", "dir": small_dir, "image_size": 16, "eval_crop_fraction": 1.0}})
    keras.utils.set_random_seed(1)
    model = serving_model(cfg)
    head = model.get_layer("resnet10_small_backbone").get_layer("logits")
    kernel, bias = head.get_weights()
    head.set_weights([kernel * 1e7, bias])
    path = str(tmp_path / "big.weights.h5")
    model.save_weights(path)
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(tfdp.commands.export, "ONNX_INLINE_BYTES", 0)
        paths = export_checkpoint(cfg, make_runtime(DistributeConfig(strategy="one_device")), path,
                                  str(tmp_path / "out"), ("onnx", "litert"), verify_images=0)
    print(printed.getvalue(), end="")
    return model, paths, printed.getvalue(), tmp_path / "out"


def test_the_difference_is_printed_relative_to_the_logits_scale(big_logits_export):
    """Logits of about 1e7 (the classifier's weights scaled up): the absolute difference of float32 rounding is
    large, the printed relative one is what rounding gives, and it is the absolute one over the largest logit."""
    _, paths, printed, _ = big_logits_export
    lines = [AGREEMENT_LINE.match(line) for line in printed.splitlines()]
    lines = {m[1]: m for m in lines if m}
    assert sorted(lines) == ["litert", "onnx"]
    for name, m in lines.items():
        a = paths["agreement"][name]
        print(m[0])
        relative, absolute, scale = float(m[6]), float(m[7]), float(m[8])
        assert scale > 1e5 and scale == pytest.approx(a.scale, rel=1e-2)
        assert absolute == pytest.approx(a.max_difference, rel=1e-2, abs=1e-30)
        assert relative == pytest.approx(absolute / scale, rel=2e-2, abs=1e-30)
        assert relative < 1e-4  # rounding, at any scale of the logits


def test_onnx_weights_above_the_inline_limit_go_to_external_data(big_logits_export):
    """Above `ONNX_INLINE_BYTES` the weights are written to model.onnx.data (ONNX external data, how a model
    past protobuf's 2 GiB is stored); onnxruntime loads the pair and agrees with Keras. The limit is lowered to 0
    (in the shared export above) so that a small ResNet's weights take that path."""
    import onnx

    from tfdp.commands.export import weight_bytes
    model, paths, _, out = big_logits_export
    data = out / "model.onnx.data"
    weights = weight_bytes(inference_network(model))
    assert data.stat().st_size >= 0.99 * weights  # the large tensors are there (small ones stay inline)
    assert os.path.getsize(paths["onnx"]) < weights / 10
    header = onnx.load(paths["onnx"], load_external_data=False)
    assert {e.value for t in header.graph.initializer for e in t.external_data if e.key == "location"} == \
        {"model.onnx.data"}
    a = paths["agreement"]["onnx"]
    assert a.images == 40 and a.agreeing == 40 and a.relative_difference < 1e-4
