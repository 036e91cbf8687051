"""`build_model`: a registry backbone wrapped with what every model shares.

The wrapper takes uint8 images, flips them on the device (training only),
normalises them (in the channel order the weights expect) and returns
float32 logits. Where a run feeds more than one image size (progressive
resizing, a separate evaluation size), its input takes any height and width.
"""

from __future__ import annotations

import keras

from tfdp.config import DataConfig, ModelConfig
from tfdp.errors import UserError
from tfdp.models.batch_norm import batch_norm_layers, use_batch_norm_rule
from tfdp.models.registry import BATCH_NORM, DROP_PATH, FIXED_SIZE, MIN_INPUT_SIZE, MODELS
from tfdp.config.image_sizes import image_sizes, variable_size


# channel order the backbone sees → the input's (RGB) channels in that order
CHANNELS = {"rgb": None, "bgr": [2, 1, 0]}


@keras.saving.register_keras_serializable(package="tfdp")
class Standardize(keras.layers.Layer):
    """(x - mean) / std on the device, so the input pipeline can ship uint8; then the channels in the order
    the weights were trained on (`data.channel_order`: Keras' caffe-style ResNets take BGR).

    mean and std are per R, G, B input channel: reordering after normalising gives exactly Keras'
    `preprocess_input` (BGR, minus the BGR mean). A gather, not a reverse, so every export format has it.
    """

    def __init__(self, mean, std, channel_order="rgb", **kwargs):
        super().__init__(**kwargs)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.channel_order = channel_order

    def call(self, inputs):
        x = keras.ops.cast(inputs, self.compute_dtype)
        mean = keras.ops.convert_to_tensor(self.mean, self.compute_dtype)
        inv_std = keras.ops.convert_to_tensor([1.0 / s for s in self.std], self.compute_dtype)
        x = (x - mean) * inv_std
        order = CHANNELS[self.channel_order]
        return x if order is None else keras.ops.take(x, order, axis=-1)

    def get_config(self):
        return {**super().get_config(), "mean": self.mean, "std": self.std, "channel_order": self.channel_order}


def build_model(model_cfg: ModelConfig, data_cfg: DataConfig) -> keras.Model:
    """uint8 images → [random flip] → Standardize (mean, std, channel order) → backbone → logits (float32
    whatever the precision policy).

    The training flip is a layer, not an input-pipeline step, so it runs on
    the accelerator: on the host it cost a share of the pipeline's throughput
    (docs/benchmarks.md). It is active only in training and draws per image.
    `model_cfg.dropout` None means the model's own default (see the registry).
    """
    check_image_sizes(model_cfg.name, data_cfg)
    if model_cfg.drop_path and model_cfg.name not in DROP_PATH:
        raise UserError(f"model.drop_path: model '{model_cfg.name}' has no residual blocks to drop "
                        f"(models that do: {', '.join(sorted(DROP_PATH))})")
    smallest = min(image_sizes(data_cfg))
    backbone = MODELS[model_cfg.name](input_shape=(smallest, smallest, 3), num_classes=model_cfg.num_classes,
                                      dropout=model_cfg.dropout, drop_path_rate=model_cfg.drop_path)
    if variable_size(data_cfg):
        backbone = any_size(backbone)
    inputs = keras.Input(backbone.input_shape[1:], dtype="uint8", name="image")
    x = keras.layers.RandomFlip("horizontal", name="hflip")(inputs) if data_cfg.hflip else inputs
    use_batch_norm_rule(backbone, BATCH_NORM[model_cfg.name], synchronized=model_cfg.sync_bn)
    if (momentum := bn_momentum(model_cfg)) is not None:
        set_bn_momentum(backbone, momentum)
    logits = backbone(Standardize(data_cfg.mean, data_cfg.std, data_cfg.channel_order, name="standardize")(x))
    logits = keras.layers.Activation("linear", dtype="float32", name="logits_float32")(logits)
    return keras.Model(inputs, logits, name=model_cfg.name)


def check_image_sizes(name: str, data_cfg: DataConfig) -> None:
    """The model takes every size the run feeds it: none below its minimum, one size only for a model that
    flattens (`FIXED_SIZE`)."""
    sizes = image_sizes(data_cfg)
    if name in FIXED_SIZE and len(sizes) > 1:
        raise UserError(f"model '{name}' takes only one image size (its classifier reads a flattened feature map), "
                        f"but data.progressive_min_size and data.eval_image_size ask for {sorted(sizes)} px: leave "
                        f"both at 0")
    smallest = min(sizes)
    if smallest >= MIN_INPUT_SIZE[name]:
        return
    if len(sizes) == 1:
        raise UserError(f"model '{name}' needs data.image_size of at least {MIN_INPUT_SIZE[name]}, got {smallest}")
    raise UserError(f"model '{name}' needs images of at least {MIN_INPUT_SIZE[name]} px, but data.image_size, "
                    f"data.eval_image_size and the progressive ramp (data.progressive_*) go down to {smallest} px")


def any_size(backbone: keras.Model) -> keras.Model:
    """The backbone, same layers and weights, re-wired onto an input of any height and width.

    keras.applications refuses an unknown input size with its classifier on,
    so every backbone is built at a fixed size and then re-traced from a
    (None, None, 3) input. Relaxing the nested model's `input_spec` instead
    would work until the model is saved: the spec is not serialized, so a
    reloaded export would refuse any size but the one it was built at.
    """
    inputs = keras.Input((None, None, backbone.input_shape[-1]))
    return keras.models.clone_model(backbone, input_tensors=inputs, clone_function=lambda layer: layer)


# model.bn_momentum auto, training from scratch: timm's (torch's BatchNorm2d default momentum 0.1, kept 0.9 in
# Keras' sense) and Model Garden's ImageNet ResNet's (`norm_momentum=0.9`). keras.applications' 0.99 averages
# over ~100 steps: on a short or small-batch run from scratch the statistics trail weights that change fast,
# and validation, which reads them, sits at chance while training accuracy climbs (docs/models.md).
FROM_SCRATCH_BN_MOMENTUM = 0.9


def bn_momentum(model_cfg: ModelConfig) -> float | None:
    """The batch-norm momentum `model.bn_momentum` asks for; None: keep each layer's own (auto with
    `model.init_from`: the statistics go on at the pace of the weights they came with)."""
    if model_cfg.bn_momentum != "auto":
        return float(model_cfg.bn_momentum)
    return None if model_cfg.init_from else FROM_SCRATCH_BN_MOMENTUM


def set_bn_momentum(model: keras.Model, momentum: float) -> int:
    """Sets every BatchNormalization layer's moving-average momentum; returns how many layers.

    Keras reads `momentum` when the layer is called, so setting it after
    construction, before the training step is traced, reaches every family,
    keras.applications included (they take no momentum argument).
    """
    layers = batch_norm_layers(model)
    for layer in layers:
        layer.momentum = momentum
    return len(layers)
