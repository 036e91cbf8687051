"""Every family of the model zoo exports to every format, each checked in its own runtime, within the stated memory.

Each model is randomly initialised (no training: what is checked is the
conversion, not accuracy), at a small image size and 10 classes, saved as a
checkpoint and exported by the real `tfdp export` in a fresh process, whose
peak resident memory is read back (`ru_maxrss` of the finished child) and held
to `tfdp.commands.export.export_memory_bound` for the model's weights (docs/export.md).
One model per family: by default simple_cnn, SqueezeNet, RegNetY-200MF (grouped
convolutions, squeeze-excite), MobileNetV2 and the DeiT. The others run only with TFDP_FULL=1
(and are `slow`), their converter paths taken in the default run: ResNeXt takes RegNetY's grouped convolutions,
EfficientNetV2-B0 and Inception-v3 take MobileNetV2's
(a keras.applications functional graph, batch norm, depthwise convolutions),
ConvNeXt-atto MobileNetV2's depthwise convolutions and the DeiT's LayerNorm and
GELU. VGG is measured by benchmarks/export_memory.py (its export needs more
memory than a test may take beside the suite's other
processes), and EfficientNetV2-L too, without an agreement check: with random
weights its activations grow to ~1e4 and the rounding differences of Keras' own
eager and graph execution alone change its top-1 (no format can agree with that).
"""

import os
import re
import subprocess
import sys

import keras
import pytest

from conftest import REPO
from tfdp.config import validate
from tfdp.commands.export import FORMATS, export_memory_bound, inference_network, weight_bytes
from tfdp.train.task import serving_model

# Reports the peak resident memory of the command it runs (its only child) on its last stderr line.
MEASURED = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print('peak_rss_bytes', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); "
            "sys.exit(rc)")
LINE = re.compile(r"tfdp: export: (\w+): .*: top-1 agrees with the Keras model on (\d+)/(\d+) validation images "
                  r"\(([\d.]+)%\), max \|(\w+) difference\| / max \|\w+\| (\S+) \((\S+) of (\S+)\)$")
# float32 rounding is ~1e-6 of the outputs' scale; a broken graph is off by a whole share of it
MAX_RELATIVE_DIFFERENCE = 1e-4
IMAGES = 24
# The float32 formats; the quantized files come from the same conversions (tests/commands/test_export_formats.py).
ZOO_FORMATS = ("saved_model", "keras", "onnx", "litert")
# Two more keras.applications families, about 50 CPU-s each: mobilenet_v2 takes their converter paths by default.
FULL_ZOO = pytest.mark.full(reason="mobilenet_v2 covers the keras.applications converter paths (functional graph, "
                                   "batch norm, depthwise convolutions) in the default run")

ZOO = [  # (registry name, image size): one per family
    ("simple_cnn", 8),
    ("squeezenet1_1", 32),
    ("regnety_002", 32),   # grouped convolutions and squeeze-excite
    ("mobilenet_v2", 32),
    ("deit_tiny_distilled_patch16_224", 32),   # attention, LayerNorm, GELU, two classifier heads averaged
    # depthwise 7x7 convolutions, LayerNorm, GELU, layer scale: mobilenet_v2's and the DeiT's converter paths
    pytest.param("convnext_atto", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="its converter paths are mobilenet_v2's (depthwise convolutions) and the DeiT's (LayerNorm, GELU) "
               "in the default run")]),
    # ConvNeXt V2: the GRN's norms (a square, a spatial sum, a square root, a channel mean) after the GELU
    pytest.param("convnextv2_atto", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="its block is convnext_atto's with the GRN's elementwise ops and reductions, which every other "
               "family's LayerNorm and pooling convert")]),
    pytest.param("efficientnetv2_b0", 32, marks=[pytest.mark.slow, FULL_ZOO]),   # squeeze-excite, swish
    pytest.param("efficientnet_b0", 32, marks=[pytest.mark.slow, FULL_ZOO]),     # the same, its graph cut at the stem
    pytest.param("inception_v3", 75, marks=[pytest.mark.slow, FULL_ZOO]),        # concatenated branches
    # efficientnet_b0's graph with symmetric padding and torch's batch norm (rebuilt from its config)
    pytest.param("efficientnet_b0_torch", 32, marks=[pytest.mark.slow, FULL_ZOO]),
    # hard-swish, hard-sigmoid gates, a 1x1-convolution head, the stem's own symmetric padding (rebuilt from its config)
    pytest.param("mobilenet_v3_small_torch", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="mobilenet_v2's converter paths with squeeze-excite (the EfficientNets') and elementwise "
               "activations")]),
    # the deep stem and the shortcuts' "same" average pools
    pytest.param("resnet18d", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="regnety_002's converter paths (convolutions, batch norm, shortcuts) with an average pool, which "
               "every family's global pooling converts")]),
    # grouped convolutions in torchvision's bottlenecks: ~50 CPU-s
    pytest.param("resnext50_32x4d", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="regnety_002's grouped convolutions in the default run, at a quarter of the CPU")]),
    # registers without a class token, the patch tokens' mean, fc_norm
    pytest.param("vit_little_patch16_reg4_gap_256", 32, marks=[pytest.mark.slow, pytest.mark.full(
        reason="the DeiT's converter paths with a mean over tokens")]),
]


def export_measured(args, timeout=900):
    result = subprocess.run([sys.executable, "-c", MEASURED, sys.executable, "-m", "tfdp", "export", *args],
                            capture_output=True, text=True, timeout=timeout, cwd=REPO)
    peak = int(re.findall(r"^peak_rss_bytes (\d+)$", result.stderr, re.M)[-1])
    return result, peak


@pytest.mark.parametrize("name,size", ZOO)
def test_zoo_model_exports_to_every_format_within_the_memory_bound(name, size, digits_dir, tmp_path):
    cfg = validate({"model_dir": str(tmp_path), "model": {"name": name, "num_classes": 10},
                    "data": {"format": "image_folder", "dir": digits_dir, "image_size": size,
                             "eval_crop_fraction": 1.0}})
    keras.utils.set_random_seed(0)
    model = serving_model(cfg)
    weights = weight_bytes(inference_network(model, portable=False))
    checkpoint = str(tmp_path / "random.weights.h5")
    model.save_weights(checkpoint)
    del model
    out = tmp_path / "export"
    result, peak = export_measured(
        ("--config=configs/digits.yaml", "--data_format=image_folder", f"--data_dir={digits_dir}",
         f"--model_dir={tmp_path}", f"--model={name}", f"--set=data.image_size={size}", f"--checkpoint={checkpoint}",
         f"--format={','.join(ZOO_FORMATS)}", f"--export_dir={out}", f"--verify_images={IMAGES}"))
    print(f"{name} at {size} px: {weights / 2**20:.1f} MiB of weights, `tfdp export` in all four formats peaked at "
          f"{peak / 2**30:.2f} GiB (bound {export_memory_bound(weights) / 2**30:.2f} GiB)")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {m[1]: m for m in map(LINE.match, result.stdout.splitlines()) if m}
    assert sorted(lines) == sorted(ZOO_FORMATS), result.stdout
    for fmt, m in lines.items():
        print(m[0])
        assert int(m[3]) == IMAGES and int(m[2]) >= IMAGES - 1, m[0]  # a near tie of random logits may flip one
        assert float(m[6]) < MAX_RELATIVE_DIFFERENCE, m[0]
        assert float(m[6]) == pytest.approx(float(m[7]) / float(m[8]), rel=0.02, abs=1e-12), m[0]
    for fmt in ZOO_FORMATS:
        assert os.path.exists(out / FORMATS[fmt].filename), fmt
    # No XLA-compiled function (Keras' grouped convolution) in the served graph: runs without XLA too.
    assert b"_XlaMustCompile" not in (out / "saved_model" / "saved_model.pb").read_bytes()
    assert peak <= export_memory_bound(weights)
