"""`model.bn_momentum`: every batch-norm layer of every family takes it, and its default lets a keras.applications
ResNet-50 trained from scratch validate well above chance (as the torchvision-layout one does: docs/models.md).

keras.applications builds its batch norms with momentum 0.99: over a short run from scratch the moving statistics
still hold mostly their initial values, and validation (which reads them) sits at chance while training accuracy
climbs. The default (0.9 from scratch, timm's and Model Garden's) closes that gap.
"""

from __future__ import annotations


import keras
import pytest

from tfdp.config import DataConfig, ModelConfig, validate
from tfdp.distribute.strategy import make_runtime
from tfdp.models import MODELS, build_model
from tfdp.train.trainer import Trainer


def batch_norms(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer, however deeply nested (Keras' own traversal), checked against the moving
    means the model holds: one per layer, so none is missed."""
    found = [layer for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(found) == sum(1 for w in model.weights if w.path.endswith("moving_mean")) > 0
    return found


# keras.applications (0.99), torchvision layout (0.9), timm's own EfficientNet on keras.applications' graph (0.9)
@pytest.mark.parametrize("name", ["resnet50", "resnet50_v1_5", "efficientnet_b0_torch"])
def test_the_momentum_reaches_every_batch_norm_layer(name):
    """Built for their layers only (`shapes_only`: a momentum is the layer's, no weight value is needed). Fine-tuning
    keeps the pace the architecture's weights were trained at: timm trained its own EfficientNets at torch's 0.9,
    which tfdp's rebuild of Keras' graph (0.99) sets (`keras_apps.torch_padded`)."""
    from support.shapes import shapes_only
    data = DataConfig(image_size=32)
    with shapes_only():
        own = {layer.name: layer.momentum for layer in
               batch_norms(build_model(ModelConfig(name=name, bn_momentum=0.5, init_from=""), data))}
        assert set(own.values()) == {0.5}
        scratch = build_model(ModelConfig(name=name), data)   # auto, from scratch
        assert {layer.momentum for layer in batch_norms(scratch)} == {0.9}
        fine_tuned = build_model(ModelConfig(name=name, init_from="imagenet"), data)   # auto: the architecture's own
        assert {layer.momentum for layer in batch_norms(fine_tuned)} == {0.99 if name == "resnet50" else 0.9}
        # and every batch norm its family's running-variance rule (tfdp.models.batch_norm), synchronized on demand
        synced = build_model(ModelConfig(name=name, sync_bn=True), data)
        rule = "keras" if name == "resnet50" else "torch"
        assert {(layer.running_variance, layer.synchronized) for layer in batch_norms(synced)} == {(rule, True)}
        assert {(layer.running_variance, layer.synchronized) for layer in batch_norms(scratch)} == {(rule, False)}
    keras.backend.clear_session()


def test_keras_applications_keep_keras_rule_and_every_other_family_takes_torchs():
    """The registry says each family's batch-norm rule by where the architecture comes from: keras.applications'
    graphs as Keras builds them train by Keras' rule; the families built from timm's and torchvision's layouts
    (tfdp's ResNets, ResNet-D, RegNets, VGG, the `_torch` EfficientNets and MobileNetV3s, ...) by torch's."""
    from tfdp.models.keras_apps import APPS, TORCH_PADDED
    from tfdp.models.registry import BATCH_NORM
    assert {name for name, rule in BATCH_NORM.items() if rule == "keras"} == set(APPS)
    assert set(BATCH_NORM) == set(MODELS) and set(BATCH_NORM.values()) == {"keras", "torch"}
    assert {BATCH_NORM[name] for name in (*TORCH_PADDED, "resnet50_v1_5", "resnet18d", "regnety_040", "vgg11_bn",
                                          "resnet10_small")} == {"torch"}


@pytest.fixture
def op_determinism_restored():
    """train.deterministic switches TensorFlow's op determinism on for the whole process; the tests after this one
    in the same process need it off again (tests/support/inprocess.py)."""
    from support.inprocess import op_determinism_as_it_was
    with op_determinism_as_it_was():
        yield


@pytest.mark.slow
@pytest.mark.full(reason="52 CPU-s of ResNet-50 for an accuracy outcome; test_the_momentum_reaches_every_batch_norm_"
                  "layer checks that every batch norm gets the default it depends on")
def test_a_keras_applications_resnet50_from_scratch_validates_well_above_chance(tmp_path, op_determinism_restored):
    """Two epochs of 600 real photos (12 classes) at 32 px in batches of 32 (36 steps, what a 0.9 average needs to
    forget its initial values; 0.99 keeps 70 % of them), deterministic: three times chance at least. The same run
    with model.bn_momentum 0.99 (the architecture's own) trains identically and validates at chance (8.3 %,
    validation loss 1e7), and resnet50_v1_5 beside it validates as the default does: docs/models.md (the reference
    run is left to the docs, at half this test's cost)."""
    from support.photos import write_imagenet_tree
    write_imagenet_tree(str(tmp_path / "photos"), 12, 50, 10, "ilsvrc", size=(64, 48))
    cfg = validate({
        "model_dir": str(tmp_path / "resnet50"),
        "data": {"format": "imagenet", "dir": str(tmp_path / "photos"), "image_size": 32},
        "model": {"name": "resnet50", "num_classes": 12},
        "optimizer": {"lr": 0.1}, "schedule": {"warmup_epochs": 1},
        "train": {"epochs": 2, "batch_size_per_replica": 32, "checkpoint_every_steps": 0, "deterministic": True,
                  "label_smoothing": 0.1},
        "log": {"tensorboard": False},
        "distribute": {"strategy": "one_device"},
    })
    top1 = Trainer(cfg, make_runtime(cfg.distribute)).train()["val_top1"]
    assert top1 >= 0.25, top1   # three times chance; 0.99 gives chance
