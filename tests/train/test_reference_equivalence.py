"""Each recipe in configs/ trains step for step as the reference trainer it names (timm's train.py, torchvision's
references/classification/train.py): tfdp trains the recipe's own config, sized to the fixture's tiny run, from
the fixture's seeded start on the same 64 real photos in the same order, and gives the reference's learning rate
at every step, its loss at every step and its final (and EMA) weights.

The fixtures are the real trainers' runs (tests/fixtures/make_reference_runs.py: their train.py as a subprocess,
hooked only to feed the order and record each step). Tolerances: the learning rate to 1e-7 (both compute it in
double precision from the same numbers; tfdp's rounding to float32 is 6e-8 relative of rates <= 0.5); the loss
and every weight tensor within NOISE_TIMES times the reference's own float32 noise, measured by the maker as the
reference in float32 against itself in float64, tensor by tensor (floored at FLOOR): two float32 implementations
of the same arithmetic differ by roundings of the same size as either differs from exact arithmetic, and over 24
steps those grow alike for both. (A tensor whose exact gradient is 0, as a ViT's key bias, trains on rounding
noise alone under Adam: its own noise says so, and only its bar is wide.)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import keras
import numpy as np
import pytest

from conftest import REPO
from tfdp.config import read_yaml, validate
from tfdp.distribute.strategy import make_runtime
from tfdp.models import MODELS, build_model
from tfdp.models.weights import load_into, read_source
from tfdp.train.callbacks import ema_weights
from tfdp.train.trainer import Trainer

RUNS = os.path.join(REPO, "tests", "fixtures", "reference_runs")
PHOTOS = os.path.join(RUNS, "photos")
NOISE_TIMES = 10
# A relative weight noise below this is float32's own resolution (2^-23 = 1.2e-7) over a few roundings: the bar
# never asks for less than what one rounding of every weight gives.
FLOOR = {"loss": 1e-6, "weights": 1e-6}

# The tiny run's settings that differ from the recipe's (sizes and where the switches are counted in epochs or
# steps), by recipe; everything else (optimizer, lr, weight decay, schedule shape, smoothing, EMA, clipping, loss)
# is the recipe's as written.
TINY = {
    "resnet50_rsb_a2": {"schedule.warmup_epochs": 2},
    "resnet50_rsb_a3": {"schedule.warmup_epochs": 2},
    # DeiT's main.py keeps timm's EMA at 0.99996 (the recipe reports the raw model, so its config has none)
    "deit_s16_imagenet": {"schedule.warmup_epochs": 2, "optimizer.ema_decay": 0.99996},
    # timm's train.py has no switch for the new head's own rate: the tiny run trains it at the layers' rate
    "vit_b16_finetune": {"schedule.warmup_epochs": 2, "optimizer.head_lr_multiplier": 1.0},
    # torchvision's rates are for their global batch (1024, 256): the tiny run takes them per image, at 16
    "resnet50_torchvision_v2": {"schedule.warmup_epochs": 2, "optimizer.ema_every_steps": 2,
                                "optimizer.lr": 0.5 * 16 / 1024},
    "resnet18_imagenet": {"schedule.decay_epochs": 2, "optimizer.lr": 0.1 * 16 / 256},
    "vgg16_imagenet": {"schedule.decay_epochs": 2, "optimizer.lr": 0.01 * 16 / 256},
    "mobilenet_v2_imagenet": {"optimizer.lr": 0.045 * 16 / 256},
}
# Random switches and sizes no tiny run keeps: each is off in the reference's command line too.
OFF = {"augment": {}, "model.drop_path": 0.0, "model.dropout": 0.0, "data.repeated_augmentation": 1,
       "data.hflip": False, "data.min_crop_area": 1.0, "data.max_crop_area": 1.0, "data.eval_crop_fraction": 1.0,
       "data.eval_image_size": 0, "train.precision": "float32", "train.global_batch": 0,
       "train.checkpoint_every_steps": 0, "log.tensorboard": False}


def fixture(recipe: str) -> dict:
    with open(os.path.join(RUNS, recipe, "run.json"), encoding="utf-8") as f:
        return json.load(f)


def register_tiny_models() -> None:
    """The fixtures' stand-ins as zoo models, each read from its library's layout by the zoo's own reader:
    the ResNet-D (timm's ResNet with resnet18d's switches, one block per stage, 8 to 32 wide), the VGG
    (torchvision's, three convolutions 8 to 32 wide, a classifier 32 wide) and the RegNetY (torchvision's, one
    block per stage, three stages 8 to 32 wide, group width 8)."""
    from tfdp.models.registry import register
    from tfdp.models.resnet import LAYER_GROUPS, ResNetSpec, basic_block, resnet, timm_resnet_d
    from tfdp.models.weights import register_torch_layout

    if "resnet_d_tiny" in MODELS:
        return
    register_tiny_vgg()
    register_tiny_regnety()
    spec = ResNetSpec(basic_block, (1, 1, 1, 1), "resnet_d_tiny_backbone", block_kwargs=(("avg_down", True),),
                      deep_stem=4, widths=(8, 16, 24, 32))

    def resnet_d_tiny(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0):
        return resnet(input_shape, num_classes, dropout, spec, drop_path)
    register("resnet_d_tiny", min_size=8, drop_path=True, layer_groups=LAYER_GROUPS)(resnet_d_tiny)
    register_torch_layout("resnet_d_tiny", origins=("timm",))(timm_resnet_d)


def register_tiny_vgg() -> None:
    from tfdp.models import vgg
    from tfdp.models.weights import register_torch_layout

    plan = (8, "M", 16, "M", 32, "M")

    def vgg_tiny(input_shape, num_classes: int, dropout: float):
        return vgg.vgg(input_shape, num_classes, dropout, plan, False, "vgg_tiny_backbone", hidden=32)
    vgg.register("vgg_tiny", dropout=0.5, fixed_size=True, layer_groups=vgg.LAYER_GROUPS)(vgg_tiny)
    register_torch_layout("vgg_tiny", origins=("torchvision",))(vgg.torchvision_reader(plan, False))


def register_tiny_regnety() -> None:
    from tfdp.models import regnet
    from tfdp.models.weights import register_torch_layout

    regnet._register("regnety_tiny", regnet.RegNetSpec((1, 1, 1), (8, 16, 32), (8, 8, 8), se=True, stem_width=8))
    register_torch_layout("regnety_tiny", origins=("timm", "torchvision"))(regnet.timm_regnet)


def tiny_config(recipe: str, run: dict, model_dir: str):
    """The recipe's config file with the tiny run's data, model, sizes and switches."""
    raw = read_yaml(os.path.join(REPO, "configs", f"{recipe}.yaml"))
    overrides = {**OFF, **TINY[recipe], "model_dir": model_dir, "data.format": "image_folder", "data.dir": PHOTOS,
                 "data.image_size": run["image_size"], "model.name": run["model"], "model.num_classes": 4,
                 "model.init_from": os.path.join(RUNS, recipe, "start.safetensors"), "train.epochs": run["epochs"],
                 "train.batch_size_per_replica": run["batch"], "train.seed": run["seed"], "distribute": {}}
    for dotted, value in overrides.items():
        node, *path = dotted.split(".")
        if not path:
            raw[node] = value
            continue
        section = raw.setdefault(node, {})
        section[path[0]] = value
    raw["data"].pop("format_options", None)
    return validate(raw)


class Steps(keras.callbacks.Callback):
    """Each step's learning rate (as the optimizer computes it for that step) and loss (Keras' logs hold the
    epoch's running mean: step k's own loss is k * mean_k - (k - 1) * mean_(k-1))."""

    def __init__(self):
        super().__init__()
        self.lr, self.loss, self._mean, self._k = [], [], 0.0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._mean, self._k = 0.0, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.lr.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        self._k += 1
        self.loss.append(self._k * mean - (self._k - 1) * self._mean)
        self._mean = mean


class Recorded(Trainer):
    """tfdp's trainer, its model kept and each step recorded."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = Steps()

    def build_run(self, source, plan, model_dir):
        self.run = super().build_run(source, plan, model_dir)
        return self.run

    def build_loggers(self, out, initial_epoch):
        return [self.steps]


def train_recipe(recipe: str, tmp_path) -> tuple[dict, Recorded, object]:
    register_tiny_models()
    run = fixture(recipe)
    cfg = tiny_config(recipe, run, str(tmp_path / "run"))
    trainer = Recorded(cfg, make_runtime(cfg.distribute))
    trainer.train()
    return run, trainer, cfg


def as_tfdp_holds_it(state: dict[str, np.ndarray], model: keras.Model, cfg) -> list[np.ndarray]:
    """A timm-layout state dict as tfdp's model holds it: read by tfdp's own reader (checked against timm's logits in
    tests/models) into a twin of the model, every variable in the model's order."""
    from safetensors.numpy import save_file

    path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
    save_file(state, path)
    twin = build_model(cfg.model, cfg.data)
    _, new = load_into(twin, read_source(path, cfg.model, cfg.data), cfg.model)
    assert new == [] and len(twin.weights) == len(model.weights)
    return [keras.ops.convert_to_numpy(v).astype(np.float64) for v in twin.weights]


def noise_state(state: dict[str, np.ndarray], noise: dict[str, float]) -> dict[str, np.ndarray]:
    """Each tensor filled with its own measured noise: read as the weights are, the values land on the variables
    the weights land on (the readers only move, transpose and split tensors)."""
    return {key: np.full(value.shape, noise[key], np.float32) if key in noise else value
            for key, value in state.items()}


def compare(ours: list[np.ndarray], theirs: list[np.ndarray], noise: list[np.ndarray], names: list[str]) -> dict:
    """Per variable: max|a - b| / max|b| (as the maker measures the noise) and that over its bar (NOISE_TIMES its
    own noise, floored); the worst of each, and where."""
    diff = {name: float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) or 1.0)
            for a, b, name in zip(ours, theirs, names)}
    bars = {name: NOISE_TIMES * max(float(np.max(n)), FLOOR["weights"]) for n, name in zip(noise, names)}
    worst = max(diff, key=diff.get)
    worst_vs_bar = max(diff, key=lambda name: diff[name] / bars[name])
    return {"max": diff[worst], "at": worst, "vs_bar": diff[worst_vs_bar] / bars[worst_vs_bar],
            "vs_bar_at": worst_vs_bar}


def test_tfdp_reads_the_photos_in_the_order_the_fixtures_fed_the_reference():
    """The maker fed the reference tfdp's own order (its seeded permutation and shuffle per epoch, seeded as the
    trainer seeds them): still tfdp's order."""
    import tensorflow as tf
    from tfdp.data import build_source
    from tfdp.data.naming import StreamNames
    from tfdp.data.order import share_sizes

    run = fixture("resnet50_rsb_a2")
    cfg = validate({"data": {"format": "image_folder", "dir": PHOTOS, "image_size": run["image_size"]},
                    "train": {"seed": run["seed"]}})
    keras.utils.set_random_seed(cfg.train.seed)  # as the trainer does: tf.data's seeded shuffle reads it
    split = build_source(cfg.data).split("train")
    size = share_sizes(split, 1)[0]
    names = StreamNames.of_training(split, cfg.data, tf.distribute.InputContext(), False, cfg.train.seed, size)
    train = os.path.join(PHOTOS, "train")
    order = [[os.path.relpath(names(e * size + i), train) for i in range(size)] for e in range(run["epochs"])]
    assert order == run["order"]


def recipes_with_fixtures() -> list[str]:
    return sorted(name for name in TINY if os.path.exists(os.path.join(RUNS, name, "run.json")))


@pytest.mark.full(reason="trains a recipe for 24 steps on CPU and compares with the reference's run (~30 s each)")
@pytest.mark.parametrize("recipe", recipes_with_fixtures())
def test_the_recipe_trains_step_for_step_as_its_reference(recipe, tmp_path):
    from safetensors.numpy import load_file

    run, trainer, cfg = train_recipe(recipe, tmp_path)
    steps, model = trainer.steps, trainer.run.model
    assert len(steps.loss) == run["steps"]
    report = {"recipe": recipe, "lr": float(np.max(np.abs(np.subtract(steps.lr, run["lr"])))),
              "loss": float(np.max(np.abs(np.subtract(steps.loss, run["loss"])))),
              "noise": {k: v for k, v in run["noise"].items() if k != "per_tensor"}}
    names = [v.path for v in model.weights]
    for kind, file in (("weights", "final"), ("ema", "ema")):
        path = os.path.join(RUNS, recipe, f"{file}.safetensors")
        if not os.path.exists(path):
            continue
        state = load_file(path)
        with ema_weights(model) if kind == "ema" else contextlib.nullcontext():
            ours = [keras.ops.convert_to_numpy(v).astype(np.float64) for v in model.weights]
        report[kind] = compare(ours, as_tfdp_holds_it(state, model, cfg),
                               as_tfdp_holds_it(noise_state(state, run["noise"]["per_tensor"][kind]), model, cfg),
                               names)
    print(json.dumps(report))
    assert report["lr"] <= 1e-7, (report, steps.lr, run["lr"])
    assert report["loss"] <= NOISE_TIMES * max(run["noise"]["loss"], FLOOR["loss"]), (report, steps.loss, run["loss"])
    for kind in ("weights", "ema"):
        if kind in report:
            assert report[kind]["vs_bar"] <= 1, report
