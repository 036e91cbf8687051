"""ImageNet recipes, weight-decay exclusion, mixed precision (its accuracy on the digits: tests/test_cli.py)."""

import dataclasses
import glob
import math
import os

import keras
import pytest

from conftest import REPO, last_line, read_jsonl, run_tfdp
from tfdp.config import load_config, validate
from tfdp.models import build_model
from tfdp.config.image_sizes import variable_size
from tfdp.optim.schedules import build_schedule
from tfdp.train.task import Plan, compile_model


def recipe(name):
    return load_config(os.path.join(REPO, "configs", name))


RECIPES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*.yaml")))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_its_model_and_scales_its_learning_rate(name):
    """Each recipe validates, builds its model for its classes and input size, and its schedule reaches its peak
    (under rules keras lr x global_batch / 256 at the end of warmup; under timm's and torchvision's rules lr as given,
    their per-epoch warmup ending within a rounding of it) at 1 and 8 replicas, lower by the end. The model is built
    for its shapes only (`shapes_only`: no values for ImageNet-sized weights, which the shapes do not need)."""
    from support.shapes import shapes_only
    cfg = recipe(name)  # load_config validates
    with shapes_only():
        model = build_model(cfg.model, cfg.data)
        size = cfg.data.image_size
        # A recipe that trains or tests at more than one size (progressive resizing, FixRes) takes any size.
        assert model.input_shape == ((None, None, None, 3) if variable_size(cfg.data) else (None, size, size, 3))
        assert model.output_shape == (None, cfg.model.num_classes)
    keras.backend.clear_session()
    for replicas in (1, 8):
        global_batch = cfg.train.batch_size_per_replica * replicas
        steps_per_epoch = 1000
        schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, global_batch, steps_per_epoch, cfg.train.epochs,
                                  cfg.rules, cfg.optimizer)
        warmup_steps = round(cfg.schedule.warmup_epochs * steps_per_epoch)
        peak = cfg.optimizer.lr * (global_batch / 256 if cfg.rules == "keras" else 1)
        lr = lambda step: float(schedule(step))  # noqa: E731
        # timm's warmup counts inside the cosine's epochs: its first epoch after warmup is already past the peak by
        # (1 - cos(pi * warmup / epochs)) / 2 (0.6% for RSB A3's 5 of 100 epochs)
        past = (1 - math.cos(math.pi * cfg.schedule.warmup_epochs / cfg.train.epochs)) / 2
        assert lr(warmup_steps) == pytest.approx(peak, rel=1e-6 + (0 if cfg.rules == "keras" else past))
        if warmup_steps:
            if cfg.rules == "keras":
                assert lr(warmup_steps - 1) == pytest.approx(peak, rel=1e-6)
            assert lr(0) < peak / 2
        if cfg.schedule.name != "constant":
            assert lr(cfg.train.epochs * steps_per_epoch - 1) < peak / 2


def test_weight_decay_skips_batch_norm_and_biases():
    """On the demo's small-image ResNet with one block per stage (resnet10_small: the same kinds of layers as
    resnet18_small, kernels, biases and batch norm, in half the blocks)."""
    cfg = validate({"model": {"name": "resnet10_small"}, "data": {"image_size": 16},
                    "optimizer": {"weight_decay": 1e-4, "decay_norm_and_bias": False}})
    model = compile_model(cfg, Plan(64, 10, 640, 0, 10))
    decayed = {v.path for v in model.trainable_variables if model.optimizer._use_weight_decay(v)}
    assert decayed and all(p.endswith("kernel") for p in decayed)
    assert any(p.endswith("gamma") for p in {v.path for v in model.trainable_variables} - decayed)
    cfg = validate({**{"model": {"name": "resnet10_small"}, "data": {"image_size": 16}},
                    "optimizer": {"weight_decay": 1e-4}})
    model = compile_model(cfg, Plan(64, 10, 640, 0, 10))
    assert all(model.optimizer._use_weight_decay(v) for v in model.trainable_variables)


def test_mixed_float16_gets_dynamic_loss_scaling():
    cfg = validate({"model": {"name": "simple_cnn"}, "data": {"image_size": 16},
                    "train": {"precision": "mixed_float16"}})
    model = compile_model(cfg, Plan(64, 10, 640, 0, 10))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.get_layer("simple_cnn_backbone").get_layer("conv1").compute_dtype == "float16"
    assert keras.mixed_precision.global_policy().name == "float32"  # the run's precision does not leak out


def test_unknown_precision_is_a_config_error():
    result = run_tfdp("train", "--set=train.precision=fp8", timeout=60)
    assert result.returncode == 2
    assert "config field 'train.precision': input should be 'float32', 'mixed_bfloat16' or 'mixed_float16'" in result.stderr


@pytest.mark.full(reason="30 CPU-s: whole-step XLA under the mirrored strategy is "
                         "tests/distribute/test_mirrored.py's "
                         "test_whole_step_xla_trains_like_the_plain_keras_step_with_batch_norm")
@pytest.mark.slow
def test_jit_compile_really_compiles_with_xla_under_mirrored_strategy(tmp_path, digits_dir):
    """2 replicas (the demo config's MirroredStrategy): XLA dumps both programs of the per-replica step, the
    forward/backward pass (device flip included) and the optimizer update (momentum included)."""
    dump = tmp_path / "xla"
    result = run_tfdp("train", "--config=configs/digits.yaml", "--model=simple_cnn", "--set=data.image_size=16",
                      f"--data_dir={digits_dir}", f"--model_dir={tmp_path / 'run'}", "--epochs=2",
                      "--set=train.jit_compile=true", "--set=data.hflip=true", timeout=600,
                      env_extra={"XLA_FLAGS": f"--xla_dump_to={dump}"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "on 2 replica(s)" in last_line(result.stdout)
    modules = list(dump.iterdir()) if dump.exists() else []
    step = [p for p in modules if "forward_backward" in p.name and p.name.endswith(".txt")]
    assert step, [p.name for p in modules[:10]]
    assert any(" reverse(" in p.read_text() for p in step)  # the random flip runs inside the compiled step
    update = [p for p in modules if "optimizer_update" in p.name and p.name.endswith(".txt")]
    assert update and any(" multiply(" in p.read_text() for p in update)  # momentum * m - lr * g, compiled
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["val_top1"] > 0.5


def test_recipes_read_imagenet_shards(tmp_path):
    """Every recipe's data section works on standard shards (converted from real photos), only the path changed."""
    from pipelines.convert_imagenet import convert
    from support.photos import write_imagenet_tree
    from tfdp.data import build_source
    write_imagenet_tree(str(tmp_path / "tree"), 2, 2, 1, "ilsvrc")
    convert(str(tmp_path / "tree"), str(tmp_path / "shards"), train_shards=2, val_shards=1, workers=1, progress=False)
    for name in ("resnet50_imagenet.yaml", "resnet18_imagenet.yaml", "vgg16_imagenet.yaml",
                 "efficientnetv2_s_imagenet.yaml", "mobilenet_v2_imagenet.yaml"):
        cfg = recipe(name)
        assert cfg.data.format == "tfrecord" and cfg.data.val_split == "val"
        source = build_source(dataclasses.replace(cfg.data, dir=str(tmp_path / "shards")))
        assert (source.split("train").num_examples, source.split("val").num_examples) == (4, 2)


# One run per recipe family: every switch of the recipe as configured (its optimizer, schedule, loss, augmentations,
# EMA, repeated augmentation, progressive resizing and separate test size), shrunk to the digits: a small model,
# 16-24 px, 64 training images (`tiny_dir`), 2 epochs of 4 steps, the progressive ramp squeezed into them. What the
# runs prove (every switch trains, evaluates and is read back) needs no more images than that. In float32, not
# the recipes' bfloat16: on a CPU without bfloat16 instructions TensorFlow emulates bfloat16 kernels, which made
# these runs minutes long (docs/benchmarks.md, models: precision and XLA); bfloat16 training is proven by
# tests/test_cli.py::test_mixed_bfloat16_matches_float32_accuracy.
# In this process, with the flags `tfdp train` and `tfdp evaluate` would get (resolved to the config as the CLI
# resolves them, then the commands' own functions): what is tested is each recipe's switches, not the process
# boundary, and a fresh process per run would add TensorFlow's start twice per recipe.
RECIPE_TEST_PRECISION = "--set=train.precision=float32"
# The model: the small CNN where the recipe's switches do not touch it (it traces in half the time), the
# demo's small-image ResNet with one block per stage (resnet10_small: any image size, batch norm, cheaper than the
# demo's ResNet-18) where progressive resizing needs a model that takes any image size.
RECIPE_RUNS = {
    # rules torchvision take --lr as given: the recipe's 0.5 is for its global batch 1024, per image 0.5 x 16 / 1024
    "resnet50_torchvision_v2.yaml": ["--model=simple_cnn", "--set=data.eval_image_size=24",
                                     "--set=optimizer.lr=0.0078125"],
    "resnet50_rsb_a3.yaml": ["--model=simple_cnn", "--set=data.eval_image_size=24"],
    "resnet50_ffcv.yaml": ["--model=resnet10_small", "--set=data.eval_image_size=24", "--set=data.progressive_min_size=16",
                           "--set=data.progressive_start_epoch=0", "--set=data.progressive_end_epoch=1",
                           "--set=data.progressive_step=8"],
    "efficientnetv2_s_imagenet.yaml": ["--model=resnet10_small", "--set=data.eval_image_size=24",
                                       "--set=data.progressive_min_size=16",
                                       "--set=data.progressive_start_epoch=0", "--set=data.progressive_end_epoch=1",
                                       "--set=data.progressive_step=8", "--set=model.dropout=0.0"],
    # The transformer-era recipes on the small CNN (stochastic depth is their models' own, tested with them), their
    # fixed global batch cut to 2 micro-batches of 16, so accumulation runs as well.
    **{name: ["--model=simple_cnn", "--set=model.drop_path=0.0", "--set=train.global_batch=32"]
       for name in ("convnext_t_imagenet.yaml", "deit_s16_imagenet.yaml")},
    # DeiT-S distilled on the small CNN without its teacher (no RegNetY weights here; tests/train/test_distillation.py
    # trains with teachers): the rest of DeiT's recipe.
    "deit_s16_distilled_imagenet.yaml": [
        "--model=simple_cnn", "--set=model.drop_path=0.0", "--set=train.global_batch=32",
        "--set=train.teacher.distillation=none", '--set=train.teacher.model=""', '--set=train.teacher.init_from=""',
        "--set=train.teacher.dist_token=false"],
    "vit_b16_finetune.yaml": ["--model=simple_cnn", "--set=model.drop_path=0.0", "--set=train.global_batch=32",
                              '--set=model.init_from=""'],   # no Hub here: layer decay on a fresh model
}


# Rows whose every switch trains elsewhere in the README's run: the full tier runs them whole.
FULL_RECIPE_RUNS = {
    "efficientnetv2_s_imagenet.yaml": "about 21 CPU-s: its switches run in the README's tier elsewhere, TensorFlow's "
                                      "RMSProp with EMA in tests/optim/test_optimizers.py's compiled update on 2 "
                                      "replicas, progressive resizing on resnet10_small in the resnet50_ffcv.yaml row",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full(reason=FULL_RECIPE_RUNS[name]))
                                  if name in FULL_RECIPE_RUNS else name for name in sorted(RECIPE_RUNS)])
def test_each_recipe_family_trains_and_evaluates_on_the_digits(tmp_path, tiny_dir, name):
    """Each modern recipe, its own switches untouched (LAMB + BCE for RSB, TF RMSProp + EMA for EfficientNetV2,
    SGD + linear schedule + progressive resizing for FFCV, TrivialAugment/Mixup/CutMix/erasing/EMA/repeated
    augmentation for torchvision, AdamW + RandAugment + batch-mode Mixup/CutMix + a fixed global batch for ConvNeXt
    and DeiT, layer decay + a head multiplier + gradient clipping for the ViT fine-tune), on the digits with a small model (`simple_cnn`, or `resnet10_small` where
    the recipe resizes progressively, the EfficientNetV2 recipe included) in float32 for 2 epochs: it trains with finite losses, evaluates every epoch
    (the EMA too where the recipe has one), and `tfdp evaluate` (in this process) reads its best checkpoint."""
    from support.inprocess import evaluate_in_process, train_in_process
    cfg = recipe(name)
    common = [f"--config=configs/{name}", f"--data_dir={tiny_dir}", "--data_format=image_folder",
              "--set=model.num_classes=10", "--set=data.image_size=24",
              "--batch_size_per_replica=16", "--set=schedule.warmup_epochs=0", f"--model_dir={tmp_path}",
              RECIPE_TEST_PRECISION, *RECIPE_RUNS[name]]
    train_in_process(*common, "--epochs=2")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss", "val_loss", "val_top1")), row
        assert ("val_ema_top1" in row) == bool(cfg.optimizer.ema_decay)
    evaluated, out = evaluate_in_process(*common, checkpoint=f"{tmp_path}/checkpoints/best.weights.h5")
    assert "top1" in out
    assert evaluated["examples"] == 40   # the whole validation split, through the checkpoint read back


def _is_modern(cfg) -> bool:
    """A recipe past the classic SGD + cross-entropy + flip-and-crop one."""
    return bool(cfg.train.loss != "softmax" or cfg.optimizer.name != "sgd" or cfg.optimizer.ema_decay
                or cfg.augment.mixup_alpha or cfg.augment.rand_augment or cfg.schedule.name == "linear")


def test_recipe_families_are_all_run_on_the_digits():
    """A new modern recipe gets its digits run above. In a family run there: RSB A2 (A3's loss, optimizer and
    augment), Swin-T (DeiT's and ConvNeXt's AdamW, RandAugment, batch-mode Mixup/CutMix, erasing and fixed global
    batch, with the ViT fine-tune's gradient clipping; no EMA)."""
    modern = {name for name in RECIPES if _is_modern(recipe(name))}
    assert modern - {"resnet50_rsb_a2.yaml", "swin_t_imagenet.yaml"} <= set(RECIPE_RUNS), modern - set(RECIPE_RUNS)
