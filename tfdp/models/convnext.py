"""ConvNeXt (Liu et al. 2022, "A ConvNet for the 2020s"): keras.applications' implementation, and the
timm and torchvision state dicts mapped onto it.

The architecture is keras.applications' generic `ConvNeXt` builder (weights
None, its own preprocessing off, raw logits): the implementation Keras
maintains, with its layer names, stochastic-depth schedule and layer scale.
Its public `ConvNeXtTiny`... constructors fix `drop_path_rate` at 0, so every
variant goes through the generic builder with its depths and widths: Keras'
own table for tiny, small, base and large (= torchvision's and timm's), timm's
for atto, femto, pico and nano (timm builds those with `conv_mlp=True`, 1x1
convolutions and a channels LayerNorm, the same function as Keras' Dense
layers and LayerNorm: the weight reader only reshapes their kernels).
Parameter counts equal timm's at 1,000 classes (tests/models/test_models.py).
ConvNeXt V2 (`convnextv2_*`, timm's table) is the same builder without layer
scale, each block's GELU swapped for `GELUResponseNorm` (the GELU, then V2's
Global Response Normalization), and timm's V2 weights map onto it.

Three of Keras' layers are swapped after the build (same names, same
function, same rates and initial values), for what training and export
need of them:

- the 7x7 depthwise convolution: Keras builds it as `Conv2D(groups=C)`,
  which its TensorFlow backend runs as a nested XLA function (TensorFlow's
  grouped convolution is broken on CPU), which ONNX and TF Serving builds
  without XLA cannot run, and which the export's per-group split (layers.py)
  would turn into C one-channel convolutions. `DepthwiseConv2D` computes the
  same with TensorFlow's own depthwise kernels; its kernel is (7, 7, C, 1)
  where Conv2D's is (7, 7, 1, C).
- stochastic depth: Keras' `StochasticDepth` draws from Keras' global seed
  generator, which creates its variable inside the first traced step and so
  fails under `MirroredStrategy`; tfdp's `DropPath` (resnet.py) carries its
  own, as timm's drop path it follows (per sample, the rate rising linearly
  from 0 at the first block to `model.drop_path` at the last).
- layer scale (per-channel `gamma`, initial value 1e-6 as in the paper):
  Keras names its variable `variable`; tfdp's names it `gamma`, so
  `optimizer.decay_norm_and_bias: false` leaves it undecayed with the
  LayerNorms' gamma and beta and the biases, as timm's no-decay rule (every
  1-D parameter) does.

`model.dropout` goes between the head's LayerNorm and its Dense layer, where
timm's `head.drop` is. The classifier head (`HEAD_LAYERS`) is the Dense layer
alone: its shape follows the class count, and a frozen backbone
(`train.freeze: [backbone]`) is then a linear probe on the pretrained,
normalised features. timm counts the head's LayerNorm in its head module, and
so does the layer grouping here (`LAYER_GROUPS`: the LayerNorm is matched by no
group, and takes the last learning-rate scale with the Dense layer, as in timm).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import keras
import numpy as np
from keras import layers
from keras.src.applications import convnext as keras_convnext

from tfdp.config import ModelConfig
from tfdp.errors import UserError
from tfdp.models import weights
from tfdp.models.registry import register
from tfdp.models.resnet import DropPath

LAYER_SCALE_INIT = 1e-6


@dataclasses.dataclass(frozen=True)
class ConvNeXtSpec:
    """One ConvNeXt: its name (which prefixes every layer's, as in Keras), blocks per stage, channels per stage;
    `grn` for ConvNeXt V2 (a Global Response Normalization after each block's GELU, no layer scale)."""
    name: str
    depths: tuple[int, ...]
    dims: tuple[int, ...]
    grn: bool = False


def _keras_spec(variant: str) -> ConvNeXtSpec:
    config = keras_convnext.MODEL_CONFIGS[variant]
    return ConvNeXtSpec(f"convnext_{variant}", tuple(config["depths"]), tuple(config["projection_dims"]))


# zoo name → its spec: Keras' table for tiny..large, timm's (timm/models/convnext.py) for atto..nano
SPECS = {spec.name: spec for spec in (
    ConvNeXtSpec("convnext_atto", (2, 2, 6, 2), (40, 80, 160, 320)),
    ConvNeXtSpec("convnext_femto", (2, 2, 6, 2), (48, 96, 192, 384)),
    ConvNeXtSpec("convnext_pico", (2, 2, 6, 2), (64, 128, 256, 512)),
    ConvNeXtSpec("convnext_nano", (2, 2, 8, 2), (80, 160, 320, 640)),
    *(_keras_spec(variant) for variant in ("tiny", "small", "base", "large")),
    # ConvNeXt V2 (Woo et al. 2023, "ConvNeXt V2: Co-designing and Scaling ConvNets with Masked Autoencoders"):
    # timm's table (timm/models/convnext.py, convnextv2_*), V1's depths and widths with huge added
    *(ConvNeXtSpec(f"convnextv2_{size}", depths, dims, grn=True) for size, depths, dims in (
        ("atto", (2, 2, 6, 2), (40, 80, 160, 320)), ("femto", (2, 2, 6, 2), (48, 96, 192, 384)),
        ("pico", (2, 2, 6, 2), (64, 128, 256, 512)), ("nano", (2, 2, 8, 2), (80, 160, 320, 640)),
        ("tiny", (3, 3, 9, 3), (96, 192, 384, 768)), ("small", (3, 3, 27, 3), (96, 192, 384, 768)),
        ("base", (3, 3, 27, 3), (128, 256, 512, 1024)), ("large", (3, 3, 27, 3), (192, 384, 768, 1536)),
        ("huge", (3, 3, 27, 3), (352, 704, 1408, 2816)))),
)}


@keras.saving.register_keras_serializable(package="tfdp", name="ConvNeXtLayerScale")
class LayerScale(layers.Layer):
    """x times a learned per-channel scale (Touvron et al. 2021), as Keras' ConvNeXt `LayerScale`, its variable
    named `gamma` (see the module's docstring). Registered under a name of its own: Keras' registry is by name,
    and ViT's layer scale (vit.py) is another class."""

    def __init__(self, init_value: float, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.init_value, self.dim = float(init_value), int(dim)

    def build(self, input_shape):
        self.gamma = self.add_weight(name="gamma", shape=(self.dim,),
                                     initializer=keras.initializers.Constant(self.init_value))

    def call(self, x):
        return x * self.gamma

    def get_config(self):
        return {**super().get_config(), "init_value": self.init_value, "dim": self.dim}


@keras.saving.register_keras_serializable(package="tfdp")
class GELUResponseNorm(layers.Layer):
    """ConvNeXt V2's GELU and, after it, its Global Response Normalization, as timm's `GlobalResponseNorm`:
    x + beta + gamma * x * N(x), where N divides each channel's L2 norm over the positions by the mean of those
    norms over the channels (plus 1e-6). One layer for the two: Keras' ConvNeXt block has no place between its
    GELU and its second pointwise convolution, so this replaces the GELU (`{block}_grn`, where V1 has
    `{block}_gelu`). gamma and beta start at zero (GRN the identity), as in timm, and are named so
    `optimizer.decay_norm_and_bias: false` leaves them undecayed, as timm's no-decay rule does every 1-D
    parameter. The norms are taken in float32 under mixed precision (a sum of squares over a feature map)."""

    def __init__(self, dim: int, epsilon: float = 1e-6, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.epsilon = int(dim), float(epsilon)

    def build(self, input_shape):
        self.gamma = self.add_weight(name="gamma", shape=(self.dim,), initializer="zeros")
        self.beta = self.add_weight(name="beta", shape=(self.dim,), initializer="zeros")

    def call(self, x):
        x = keras.activations.gelu(x, approximate=False)
        x32 = keras.ops.cast(x, "float32")
        squares = keras.ops.sum(keras.ops.square(x32), axis=(1, 2), keepdims=True)
        # A channel that is zero everywhere (common on a 1x1 map, and in bfloat16) has norm 0, where the square
        # root's gradient is infinite: its gradient is 0 here, as PyTorch's norm gives it (the value is unchanged).
        alive = squares > 0
        norm = keras.ops.where(alive, keras.ops.sqrt(keras.ops.where(alive, squares, 1.0)), 0.0)
        scale = norm / (keras.ops.mean(norm, axis=-1, keepdims=True) + self.epsilon)
        out = x32 + keras.ops.cast(self.beta, "float32") + keras.ops.cast(self.gamma, "float32") * (x32 * scale)
        return keras.ops.cast(out, x.dtype)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "epsilon": self.epsilon}


def _is_depthwise(layer: keras.layers.Layer) -> bool:
    """A Conv2D with one input and one output channel per group: a depthwise convolution."""
    return isinstance(layer, layers.Conv2D) and layer.groups > 1 and layer.groups == layer.filters \
        and layer.kernel.shape[-2] == 1


_GELU = re.compile(r".*_stage_(\d+)_block_\d+_gelu")


def _tfdp_layer(layer: keras.layers.Layer, spec: ConvNeXtSpec) -> keras.layers.Layer:
    """Keras' depthwise Conv2D, stochastic depth and layer scale → the layers the module's docstring
    describes, same name and settings; a V2's GELUs → `GELUResponseNorm`; every other layer as it is."""
    gelu = _GELU.fullmatch(layer.name) if spec.grn else None
    if gelu:
        return GELUResponseNorm(4 * spec.dims[int(gelu[1])], name=layer.name[:-len("gelu")] + "grn")
    if _is_depthwise(layer):
        return layers.DepthwiseConv2D(layer.kernel_size, strides=layer.strides, padding=layer.padding,
                                      use_bias=layer.use_bias, name=layer.name)
    if isinstance(layer, keras_convnext.StochasticDepth):
        return DropPath(layer.drop_path_rate, name=layer.name)
    if isinstance(layer, keras_convnext.LayerScale):
        return LayerScale(layer.init_values, layer.projection_dim, name=layer.name)
    return layer


def _with_head_dropout(model: keras.Model, rate: float) -> keras.Model:
    """A Dropout layer between the head's LayerNorm and its Dense layer (timm's `head.drop`), when rate > 0."""
    if not rate:
        return model
    dense, norm = model.layers[-1], model.layers[-2]
    x = layers.Dropout(rate, name=f"{model.name}_head_dropout")(norm.output)
    return keras.Model(model.input, dense(x), name=model.name)


def convnext(input_shape, num_classes: int, dropout: float, spec: ConvNeXtSpec, drop_path: float = 0.0
             ) -> keras.Model:
    """Keras' ConvNeXt for `spec`, its head's dropout added and three of its layers swapped (see the module), and
    for a V2 its GELUs."""
    model = keras_convnext.ConvNeXt(
        depths=list(spec.depths), projection_dims=list(spec.dims), drop_path_rate=drop_path,
        layer_scale_init_value=None if spec.grn else LAYER_SCALE_INIT, name=spec.name, include_preprocessing=False,
        include_top=True, weights=None, input_shape=tuple(input_shape), classes=num_classes,
        classifier_activation=None)
    model = _with_head_dropout(model, dropout)
    return keras.models.clone_model(model, clone_function=lambda layer: _tfdp_layer(layer, spec))


def layer_groups(spec: ConvNeXtSpec) -> dict[str, str]:
    """timm's ConvNeXt `group_matcher(coarse=False)` on Keras' layer names: the stem, then one group per block,
    a stage's downsampling layers (Keras' `downsampling_*_{stage - 1}`) in the group of its first block (timm
    matches `stages.N.downsample` and `stages.N.blocks.0` to the same ordinal).

    One regex per stage: the downsampling layers and block 0 capture nothing (the stage's ordinal alone), blocks
    1.. their number; the head matches none and comes last.
    """
    p = spec.name
    groups = {"stem": rf"^{p}_stem_"}
    for stage in range(len(spec.depths)):
        into = rf"{p}_downsampling_(?:layernorm|conv)_{stage - 1}$|" if stage else ""
        groups[f"stage{stage}"] = rf"^(?:{into}{p}_stage_{stage}_block_0_|{p}_stage_{stage}_block_(\d+)_)"
    return groups


def _register(spec: ConvNeXtSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return convnext(input_shape, num_classes, dropout, spec, drop_path)
    register(spec.name, drop_path=True, head=(f"{spec.name}_head_dense",),
             layer_groups=layer_groups(spec))(build)


for _spec in SPECS.values():
    _register(_spec)


# ---------------------------------------------------------------- timm and torchvision state dicts


def conv_kernel(w: np.ndarray) -> np.ndarray:
    """PyTorch's OIHW convolution kernel → Keras' HWIO."""
    return w.transpose(2, 3, 1, 0)


def dense_kernel(w: np.ndarray) -> np.ndarray:
    """A Linear weight (out, in), or timm's conv_mlp 1x1 convolution (out, in, 1, 1) → Keras' Dense (in, out)."""
    return w.reshape(w.shape[0], -1).T


def depthwise_kernel(w: np.ndarray) -> np.ndarray:
    """PyTorch's depthwise kernel (C, 1, H, W) → Keras' DepthwiseConv2D (H, W, C, 1)."""
    return w.transpose(2, 3, 0, 1)


def vector(w: np.ndarray) -> np.ndarray:
    """LayerNorm's scale, a layer scale (torchvision keeps it as (C, 1, 1)) → (C,)."""
    return w.reshape(-1)


_BLOCK = r"stages\.(?P<s>\d)\.blocks\.(?P<b>\d+)\."
# timm module → (Keras layer, after the model's name and "_"; how its `weight` is laid out). {s} stage, {b} block,
# {d} Keras' downsampling index (stage - 1: timm's stage 0 has none, its stem downsamples).
TIMM_TO_KERAS: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    r"stem\.0": ("stem_conv", conv_kernel),
    r"stem\.1": ("stem_layernorm", vector),
    r"stages\.(?P<s>[1-9])\.downsample\.0": ("downsampling_layernorm_{d}", vector),
    r"stages\.(?P<s>[1-9])\.downsample\.1": ("downsampling_conv_{d}", conv_kernel),
    _BLOCK + r"conv_dw": ("stage_{s}_block_{b}_depthwise_conv", depthwise_kernel),
    _BLOCK + r"norm": ("stage_{s}_block_{b}_layernorm", vector),
    _BLOCK + r"mlp\.fc1": ("stage_{s}_block_{b}_pointwise_conv_1", dense_kernel),
    _BLOCK + r"mlp\.fc2": ("stage_{s}_block_{b}_pointwise_conv_2", dense_kernel),
    _BLOCK + r"gamma": ("stage_{s}_block_{b}_layer_scale", vector),
    _BLOCK + r"mlp\.grn": ("stage_{s}_block_{b}_grn", vector),
    r"head\.norm": ("head_layernorm", vector),
    r"head\.fc": ("head_dense", dense_kernel),
}
# torchvision's `CNBlock.block` indices → timm's block modules (1 and 6 are permutes, 4 the GELU)
_CN_BLOCK = {"0": "conv_dw", "2": "norm", "3": "mlp.fc1", "5": "mlp.fc2"}
# torchvision module → timm's: `features` alternates stages (odd) and downsampling (even, 0 the stem);
# `classifier` is LayerNorm2d, Flatten, Linear.
TORCHVISION_TO_TIMM: dict[str, Callable[[re.Match], str]] = {
    r"features\.0\.([01])": lambda m: f"stem.{m[1]}",
    r"features\.([2468])\.([01])": lambda m: f"stages.{int(m[1]) // 2}.downsample.{m[2]}",
    r"features\.([13579])\.(\d+)\.block\.([0235])": lambda m: f"stages.{int(m[1]) // 2}.blocks.{m[2]}."
                                                            f"{_CN_BLOCK[m[3]]}",
    r"features\.([13579])\.(\d+)\.layer_scale": lambda m: f"stages.{int(m[1]) // 2}.blocks.{m[2]}.gamma",
    r"classifier\.0": lambda m: "head.norm",
    r"classifier\.2": lambda m: "head.fc",
}
# parameters that are a module of their own in Keras (a LayerScale layer), not a module's weight or bias
_LAYER_SCALES = (".gamma", ".layer_scale")


def timm_module(module: str) -> str | None:
    """A torchvision module name in timm's terms; timm's (and unknown ones) as they are."""
    for pattern, rename in TORCHVISION_TO_TIMM.items():
        m = re.fullmatch(pattern, module)
        if m:
            return rename(m)
    return module


def keras_place(module: str) -> tuple[str, Callable[[np.ndarray], np.ndarray]] | None:
    """(Keras layer name without the model's prefix, the weight's converter) of a timm/torchvision module."""
    module = timm_module(module)
    for pattern, (template, convert) in TIMM_TO_KERAS.items():
        m = re.fullmatch(pattern, module)
        if m:
            fields = m.groupdict()
            return template.format(**fields, d=int(fields.get("s") or 1) - 1), convert
    return None


def _split(key: str) -> tuple[str, str]:
    """A state-dict key → (module, parameter); a layer scale is a module of its own, its value its weight."""
    if key.endswith(_LAYER_SCALES):
        return key, "weight"
    module, _, param = key.rpartition(".")
    return module, param


def read_state_dict(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> weights.Weights:
    """A timm or torchvision ConvNeXt state dict (told apart by their names) as `Weights` for Keras' layers."""
    found: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        module, param = _split(key)
        place = keras_place(module) if param in ("weight", "bias") else None
        if place is None:
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': tensor {key} "
                            f"{tuple(value.shape)} has no place in it (another architecture?)")
        layer, convert = place
        found.setdefault(f"{model_cfg.name}_{layer}", {})[param] = (key, convert(value) if param == "weight" else value)
    values, names = {}, {}
    for layer, params in found.items():
        order = [p for p in ("weight", "bias") if p in params]
        values[layer] = [params[p][1] for p in order]
        names[layer] = [params[p][0] for p in order]
    return weights.Weights(what, values, names)


weights.register_torch_layout(*SPECS, origins=("timm", "torchvision"))(read_state_dict)
