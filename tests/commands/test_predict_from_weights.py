"""`tfdp predict | evaluate | export --init_from=WEIGHTS`: pretrained weights used as they are, with no run and no
training data: their classes (timm's label_names, ImageNet's for a 1,000-class head), their preprocessing (timm's
evaluation resize: the shorter side to size / crop_pct, antialiased as Pillow's, then the central crop), each
assumption said once; the predictions are timm's own pipeline's on real JPEG files of different sizes
(tests/fixtures/make_predict_fixture.py)."""

import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, assert_one_line_error, run_tfdp
from tfdp.commands.from_weights import read_pretrained
from tfdp.commands.predict import predict, read_rows, request
from tfdp.config import load_config, validate
from tfdp.data.preprocess import EVAL_CROPS
from tfdp.distribute.strategy import make_runtime
from tfdp.errors import UserError
from tfdp.models import build_model

FIXTURES = os.path.join(REPO, "tests", "fixtures")
PHOTOS = os.path.join(FIXTURES, "predict_photos")
TIMM = os.path.join(FIXTURES, "predict_timm", "model.safetensors")
FACTS = json.load(open(os.path.join(FIXTURES, "predict_fixture.json"), encoding="utf-8"))
REFERENCE = np.load(os.path.join(FIXTURES, "predict_timm.npz"))
LABELS = json.load(open(os.path.join(FIXTURES, "predict_timm", "config.json"), encoding="utf-8"))["label_names"]
MODEL = "vit_mini_patch4_small"


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_predictions_from_a_timm_file_are_timms_own_pipelines(tmp_path):
    """No run, no config, no data: the weights' classes, their pretrained cfg (mean/std 0.5, 32 px, crop 0.9,
    bicubic), each assumption said once; timm's top-1 on every JPEG and its probabilities."""
    out = tmp_path / "p.jsonl"
    result = run_tfdp("predict", f"--model={MODEL}", f"--init_from={TIMM}", f"--input={PHOTOS}", f"--output={out}",
                      "--top_k=10", "--cpu_replicas=1", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]   # no run directory, nothing else written
    assert all(line.startswith("tfdp: ") for line in result.stderr.splitlines() if line.strip()), result.stderr
    said = [line for line in result.stdout.splitlines() if line.startswith("tfdp: assumed:")]
    assert said == [
        "tfdp: assumed: RGB, mean 127.5,127.5,127.5, std 127.5,127.5,127.5 (R,G,B, 0..255 units), from "
        "model.safetensors (its timm pretrained cfg); set data.mean, data.std, data.channel_order to change",
        "tfdp: assumed: image size 32 px, from model.safetensors (its timm pretrained cfg); set data.image_size to "
        "change",
        "tfdp: assumed: evaluation crop 0.9 of the shorter side at 32 px, after a bicubic resize of the shorter side "
        "to 35 px antialiased as Pillow's; set data.eval_crop_fraction, data.eval_interpolation (fast, bilinear, "
        "bicubic) to change",
        "tfdp: assumed: 10 classes, named by the weights' label_names; fine-tune the weights to predict others "
        "(docs/fine-tune-your-images.md)"], result.stdout
    rows = read_rows(str(out))
    assert [os.path.basename(r["path"]) for r in rows] == FACTS["files"]
    top1 = [r["predictions"][0]["class"] for r in rows]
    assert top1 == REFERENCE["top1"].tolist()
    assert [r["predictions"][0]["name"] for r in rows] == [LABELS[k] for k in top1]
    assert [r["predictions"][0]["text"] for r in rows] == [f"the {LABELS[k]} photo" for k in top1]
    ours = np.zeros((len(rows), 10))
    for i, row in enumerate(rows):
        for p in row["predictions"]:
            ours[i, p["class"]] = p["probability"]
    # The crops differ from Pillow's by 0.1 unit on average (the pixel test below): 4.3e-4 at most on these 10
    # probabilities, from the pixels alone (the same libjpeg decode, float32 rounding ~1e-6), so on any host.
    # Resized bilinearly instead they are 7.6e-3 off, with ImageNet's mean 0.11, with the fast crop 0.14.
    assert np.abs(ours - softmax(REFERENCE["logits"])).max() < 2e-3


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_the_evaluation_resize_is_pillows_within_a_unit_on_average(interpolation):
    """timm's Resize(35) + CenterCrop(32) made by Pillow on the 6 JPEG files (40x30 to 600x400, so enlarged and
    shrunk) against `EVAL_CROPS`: Pillow rounds to uint8 (and clips) between its two passes, TensorFlow once at
    the end, so a pixel may differ by a few units where bicubic overshoots an edge, and by 0.1 on average. The
    fast crop (crop, then bilinear without antialiasing) is 5 to 28 units off on average: the check can fail."""
    differences, fast = [], []
    for i, name in enumerate(FACTS["files"]):
        data = tf.io.read_file(os.path.join(PHOTOS, name))
        theirs = REFERENCE[interpolation][i].astype(int)
        differences.append(np.abs(EVAL_CROPS[interpolation](data, 32, 0.9).numpy().astype(int) - theirs))
        fast.append(np.abs(EVAL_CROPS["fast"](data, 32, 0.9).numpy().astype(int) - theirs).mean())
    means = [d.mean() for d in differences]
    print(f"{interpolation}: mean |difference| per image {np.round(means, 3).tolist()}, max "
          f"{max(d.max() for d in differences)}; fast crop {np.round(fast, 1).tolist()}")
    assert max(means) < 0.25 and max(d.max() for d in differences) <= 8
    assert min(fast) > 2


@pytest.fixture(scope="module")
def imagenet_head(tmp_path_factory):
    """A .weights.h5 file of the small CNN with a 1,000-class head, outside any run."""
    path = str(tmp_path_factory.mktemp("imagenet-head") / "cnn1000.weights.h5")
    cfg = validate({"model": {"name": "simple_cnn", "num_classes": 1000}})
    keras.utils.set_random_seed(3)
    build_model(cfg.model, cfg.data).save_weights(path)
    return path


def pretrained_config(**model) -> dict:
    return {"model": {"name": "simple_cnn", **model}, "distribute": {"strategy": "one_device"}}


def test_a_1000_class_head_predicts_with_imagenets_names_and_no_training_data(imagenet_head, tmp_path):
    """The default config's data is the digits demo (10 classes): predict reads none of it, the 1,000-class
    weights set the class count and ImageNet's names the classes."""
    cfg = load_config(None, {"model.name": "simple_cnn", "model.init_from": imagenet_head,
                             "distribute.strategy": "one_device", "data.dir": str(tmp_path / "no-such-data")},
                      from_run=False)
    weights = read_pretrained(cfg, classes_set=False)
    assert weights.cfg.model.num_classes == 1000 and cfg.model.num_classes == 10
    out = str(tmp_path / "p.csv")
    job = request(cfg, PHOTOS, out, None, classes_known=False)
    predict(cfg, make_runtime(weights.cfg.distribute), None, job, pretrained=weights)
    rows = read_rows(out)
    assert len(rows) == 6 and all(len(r["predictions"]) == 5 for r in rows)
    assert all(p["name"].startswith("n") and len(p["name"]) == 9 for r in rows for p in r["predictions"])
    first = rows[0]["predictions"][0]
    from tfdp.data.imagenet_classes import imagenet_classes
    assert imagenet_classes()[0][first["class"]] == first["name"]


def test_weights_of_another_class_count_or_model_are_one_line(imagenet_head, tmp_path):
    """model.num_classes set to other than the weights' head, or a file of another architecture."""
    cfg = load_config(None, {"model.name": "simple_cnn", "model.init_from": imagenet_head, "model.num_classes": 10},
                      from_run=False)
    with pytest.raises(UserError, match=r"its classifier has 1000 classes, but model.num_classes is 10 \(leave"):
        read_pretrained(cfg, classes_set=True)
    other = load_config(None, {"model.name": "vit_tiny_patch16_224", "model.init_from": TIMM}, from_run=False)
    weights = read_pretrained(other, classes_set=False)
    with pytest.raises(UserError, match="does not fit model 'vit_tiny_patch16_224'"):
        weights.load(build_model(weights.cfg.model, weights.cfg.data))


@pytest.mark.full(reason="a CLI run (~15 s on 2 cores) for what test_weights_of_another_class_count_or_model_are_one_"
                         "line checks in-process: the line and exit status 2 as the user meets them")
def test_weights_of_another_model_end_predict_in_one_line(tmp_path):
    result = run_tfdp("predict", "--model=simple_cnn", f"--init_from={TIMM}", f"--input={PHOTOS}",
                      f"--output={tmp_path / 'p.jsonl'}", cwd=str(tmp_path))
    assert_one_line_error(result, 2, "is a PyTorch state dict, but model 'simple_cnn' has no torchvision or timm "
                                     "layout")


def test_a_source_without_a_classifier_is_refused(tmp_path):
    """A feature extractor (no head in the file) would predict with a random classifier: refused in one line."""
    from safetensors.numpy import load_file, save_file
    tensors = {k: v for k, v in load_file(TIMM).items() if not k.startswith("head.")}
    headless = str(tmp_path / "headless.safetensors")
    save_file(tensors, headless)
    cfg = load_config(None, {"model.name": MODEL, "model.init_from": headless, "data.image_size": 32},
                      from_run=False)
    weights = read_pretrained(cfg, classes_set=False)
    with pytest.raises(UserError, match=r"does not set every layer .* \(new: head \(the source has no classifier\)\)"):
        weights.load(build_model(weights.cfg.model, weights.cfg.data))


@pytest.mark.full(reason="two CLI runs (evaluate, export with its check) of ~20 s each on 2 cores")
def test_evaluate_and_export_start_from_the_weights_alone(tmp_path):
    """evaluate's top-1 over a class-folder tree of the 6 photos is the share timm's top-1 gets right; export
    writes the model with the weights' classes and checks it against Keras on the same images."""
    data = tmp_path / "data"
    for k, label in enumerate(LABELS):   # each class a copy of one photo
        os.makedirs(data / "val" / label)
        shutil.copy(os.path.join(PHOTOS, FACTS["files"][k % 6]), data / "val" / label / "photo.jpg")
    expected = np.mean([REFERENCE["top1"][k % 6] == k for k in range(10)])
    common = (f"--model={MODEL}", f"--init_from={TIMM}", "--data_format=image_folder", f"--data_dir={data}",
              "--cpu_replicas=1")
    result = run_tfdp("evaluate", *common, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"top1 {expected:.4f}" in result.stdout and "over 10 images" in result.stdout, result.stdout
    result = run_tfdp("export", *common, f"--export_dir={tmp_path / 'export'}", "--format=keras", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "top-1 agrees with the Keras model on 10/10 validation images (100.00%)" in result.stdout, result.stdout
    classes = json.load(open(tmp_path / "export" / "classes.json", encoding="utf-8"))
    assert classes == LABELS
    assert not os.path.exists(tmp_path / "runs")


def test_with_neither_a_run_nor_weights_the_line_names_both_ways(tmp_path):
    from tfdp.commands.evaluate import evaluate
    cfg = validate({"model_dir": str(tmp_path / "no-run"), "distribute": {"strategy": "one_device"}})
    with pytest.raises(UserError, match=r"^no checkpoint at .*best\.weights\.h5: train a run there, name one "
                                        r"\(--model_dir=RUN, --checkpoint=FILE\), or start from pretrained weights "
                                        r"\(--init_from=FILE, hf-hub:timm/NAME, \.\.\.\)$"):
        evaluate(cfg, make_runtime(cfg.distribute))


def test_dali_refuses_the_weights_resize():
    """DALI crops evaluation images the fast way: with data.decoder dali, another resize is one line."""
    with pytest.raises(UserError, match=r"data.decoder: dali crops evaluation images as data.eval_interpolation fast, "
                                        r"not bicubic"):
        validate({"data": {"format": "image_folder", "decoder": "dali", "eval_interpolation": "bicubic"}})


@pytest.mark.full(reason="a CLI run (~20 s on 2 cores) with a Hub on loopback: the local file's path, fetched")
def test_predictions_from_a_timm_repository_on_the_hub(tmp_path):
    """`--init_from=hf-hub:ORG/NAME`: the repository fetched into the Hub's cache first, then read as the local
    file is, its config.json's pretrained cfg and label_names with it: timm's top-1 on every JPEG."""
    from support.hf_hub import hub_server
    repo = "timm/vit_mini_patch4_small.predict_test"
    with hub_server() as hub:
        hub.publish_folder(repo, os.path.dirname(TIMM))
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
        out = tmp_path / "p.jsonl"
        result = run_tfdp("predict", f"--model={MODEL}", f"--init_from=hf-hub:{repo}", f"--input={PHOTOS}",
                          f"--output={out}", "--cpu_replicas=1", cwd=str(tmp_path), env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"tfdp: init_from: fetching hf-hub:{repo} from the Hugging Face Hub, or its cache" in result.stdout
    rows = read_rows(str(out))
    assert [r["predictions"][0]["name"] for r in rows] == [LABELS[k] for k in REFERENCE["top1"]]
