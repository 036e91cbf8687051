"""Swin Transformer (Liu et al. 2021) as timm builds it, and its weights from timm.

timm's `SwinTransformer` layout, one Keras layer per timm module so the layer
names are timm's module names with `_` for `.` (`layers.2.blocks.5.attn.qkv`
is `layers_2_blocks_5_attn_qkv`): a patch embedding (a convolution of the
patch size and stride, then a LayerNorm), four stages of blocks on an (H, W)
grid of tokens, each stage after the first opening with a patch merging (the
2x2 neighbours' channels concatenated in timm's order, a LayerNorm, a linear
map to twice the width without bias), a final LayerNorm, the average over the
grid and the classifier (`head.fc`). LayerNorm's epsilon is 1e-5 (PyTorch's).

A block is pre-norm, as a ViT's, but attends within windows of W x W tokens
only, with a learned bias per head for every relative position in a window
(`relative_position_bias_table`, indexed as timm's
`get_relative_position_index`); every second block first shifts the grid by
W // 2 (a cyclic roll), the windows that wrap around masked as timm masks them
(-100 between tokens from different regions), and rolls back. A stage whose
grid is no larger than the window attends over the whole grid, unshifted
(timm's `_calc_window_shift`). The per-token linear maps (qkv, proj) commute
with the roll and the window partition, so they are applied on the grid.

The roll is written as two slices and a concatenation, not `tf.roll`, so ONNX
and LiteRT take the graph as they take a ViT's. The grid must divide into
windows at every stage (224 px: 56, 28, 14, 7 with 7x7 windows, so multiples
of 224; 384 px: 96 … 12 with 12x12, and 32, 96, 192, 768): other sizes are one
line naming those that fit, where timm would pad. Stochastic depth rises linearly over all blocks (timm's
`drop_path_rate`; Swin's recipe: 0.2 tiny, 0.3 small, 0.5 base).
"""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
from keras import layers

from tfdp.config import ModelConfig
from tfdp.errors import UserError
from tfdp.models.registry import WITH_PREVIOUS, register
from tfdp.models.resnet import DropPath
from tfdp.models.vit import dense
from tfdp.models.weights import Weights, by_module, register_torch_layout

LAYER_NORM = dict(epsilon=1e-5)
HEAD = ("head_fc",)
# timm's SwinTransformer.group_matcher(coarse=False) on tfdp's layer names: the patch embedding, one group per
# block (a stage's patch merging in its first block's group, as timm gives `layers.N.downsample` and
# `layers.N.blocks.0` one ordinal), the final norm with the last block (timm's MATCH_PREV_GROUP); the classifier
# (unmatched) last.
LAYER_GROUPS = {"stem": r"^patch_embed",
                "blocks": r"^(?:layers_(\d+)_(?:downsample|blocks_0)_|layers_(\d+)_blocks_(\d+)_)",
                WITH_PREVIOUS: r"^norm$"}
MASKED = -100.0   # timm's fill between tokens of different regions of a shifted window


@dataclasses.dataclass(frozen=True)
class SwinSpec:
    """What tells one Swin from another (timm's SwinTransformer arguments)."""
    patch: int
    window: int
    dim: int                      # the first stage's width, doubled at every stage after it
    depths: tuple[int, ...]
    heads: tuple[int, ...]
    mlp_ratio: float = 4.0


# ---------------------------------------------------------------- the grid's bookkeeping (numpy, at build)


def relative_position_index(window: int) -> np.ndarray:
    """timm's `get_relative_position_index`: (W*W, W*W) indices into the (2W-1)^2-row bias table."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    relative = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
    return relative[:, :, 0] * (2 * window - 1) + relative[:, :, 1]


def partition(grid: np.ndarray, window: int) -> np.ndarray:
    """(H, W, ...) → (windows, W*W, ...), windows row-major as timm's `window_partition`."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    x = grid.reshape(h // window, window, w // window, window, *rest).swapaxes(1, 2)
    return x.reshape((h // window) * (w // window), window * window, *rest)


def shifted_window_mask(resolution: int, window: int, shift: int) -> np.ndarray:
    """timm's `get_attn_mask`: (windows, W*W, W*W), 0 within a region of the shifted grid, -100 across regions."""
    regions = np.zeros((resolution, resolution))
    bands = ((0, -window), (-window, -shift), (-shift, None))
    for i, (h0, h1) in enumerate(bands):
        for j, (w0, w1) in enumerate(bands):
            regions[h0:h1, w0:w1] = 3 * i + j
    windows = partition(regions, window)
    return np.where(windows[:, None, :] != windows[:, :, None], MASKED, 0.0).astype("float32")


def window_and_shift(resolution: int, window: int, shift: int) -> tuple[int, int]:
    """timm's `_calc_window_shift`: a grid no larger than the window is one window, unshifted."""
    return (resolution, 0) if resolution <= window else (window, shift)


# ---------------------------------------------------------------- layers


def roll(x, shift: int):
    """A cyclic roll of the grid by `shift` along H and W (torch.roll's direction), as slices and concatenations."""
    for axis in (1, 2):
        size = x.shape[axis]
        s = shift % size
        if s:
            front = (slice(None),) * axis + (slice(size - s, None),)
            back = (slice(None),) * axis + (slice(0, size - s),)
            x = keras.ops.concatenate([x[front], x[back]], axis=axis)
    return x


@keras.saving.register_keras_serializable(package="tfdp")
class WindowAttention(layers.Layer):
    """Multi-head self-attention within (shifted) windows of a grid, from the grid's fused qkv projection
    (B, H, W, 3C), with the learned relative position bias (timm's `WindowAttention`, its bias table here) and
    the shifted windows' mask. Returns (B, H, W, C), before the output projection."""

    def __init__(self, heads: int, window: int, shift: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.window, self.shift = int(heads), int(window), int(shift)

    def build(self, input_shape):
        resolution = input_shape[1]
        self.relative_position_bias_table = self.add_weight(
            shape=((2 * self.window - 1) ** 2, self.heads), name="relative_position_bias_table",
            initializer=keras.initializers.TruncatedNormal(stddev=0.02))
        self.index = relative_position_index(self.window).reshape(-1)
        self.mask = shifted_window_mask(resolution, self.window, self.shift) if self.shift else None

    def call(self, qkv):
        _, h, w, width = qkv.shape
        dim, area, windows = width // 3, self.window * self.window, (h // self.window) * (w // self.window)
        head_dim = dim // self.heads
        x = roll(qkv, -self.shift) if self.shift else qkv
        x = keras.ops.reshape(x, (-1, h // self.window, self.window, w // self.window, self.window, width))
        x = keras.ops.transpose(x, (0, 1, 3, 2, 4, 5))
        x = keras.ops.reshape(x, (-1, windows, area, 3, self.heads, head_dim))
        q, k, v = (x[:, :, :, i] for i in range(3))   # (batch, windows, tokens, heads, head_dim)
        scores = keras.ops.einsum("bwqhd,bwkhd->bwhqk", q * keras.ops.cast(head_dim ** -0.5, q.dtype), k)
        bias = keras.ops.take(keras.ops.cast(self.relative_position_bias_table, scores.dtype), self.index, axis=0)
        scores = scores + keras.ops.transpose(keras.ops.reshape(bias, (area, area, self.heads)), (2, 0, 1))
        if self.mask is not None:
            scores = scores + keras.ops.cast(self.mask[:, None], scores.dtype)
        out = keras.ops.einsum("bwhqk,bwkhd->bwqhd", keras.ops.softmax(scores, axis=-1), v)
        out = keras.ops.reshape(out, (-1, h // self.window, w // self.window, self.window, self.window, dim))
        out = keras.ops.reshape(keras.ops.transpose(out, (0, 1, 3, 2, 4, 5)), (-1, h, w, dim))
        return roll(out, self.shift) if self.shift else out

    def compute_output_shape(self, input_shape):
        return (*input_shape[:3], input_shape[3] // 3)

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "window": self.window, "shift": self.shift}


@keras.saving.register_keras_serializable(package="tfdp")
class MergePatches(layers.Layer):
    """timm's PatchMerging before its norm: each 2x2 neighbourhood's channels concatenated, in timm's order
    (`reshape(B, H/2, 2, W/2, 2, C).permute(0, 1, 3, 4, 2, 5)`: the column offset outer, the row offset inner)."""

    def call(self, x):
        _, h, w, c = x.shape
        x = keras.ops.reshape(x, (-1, h // 2, 2, w // 2, 2, c))
        return keras.ops.reshape(keras.ops.transpose(x, (0, 1, 3, 4, 2, 5)), (-1, h // 2, w // 2, 4 * c))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1] // 2, input_shape[2] // 2, 4 * input_shape[3])


# ---------------------------------------------------------------- the network


def branch(x, name: str, drop_path: float):
    return DropPath(drop_path, name=f"{name}_drop_path")(x) if drop_path else x


def block(x, name: str, dim: int, heads: int, window: int, shift: int, spec: SwinSpec, drop_path: float):
    """timm's SwinTransformerBlock: x + drop_path(attn(norm1(x))), then x + drop_path(mlp(norm2(x)))."""
    h = layers.LayerNormalization(**LAYER_NORM, name=f"{name}_norm1")(x)
    h = dense(3 * dim, f"{name}_attn_qkv")(h)
    h = WindowAttention(heads, window, shift, name=f"{name}_attn")(h)
    h = dense(dim, f"{name}_attn_proj")(h)
    x = layers.Add(name=f"{name}_add1")([x, branch(h, f"{name}_1", drop_path)])
    h = layers.LayerNormalization(**LAYER_NORM, name=f"{name}_norm2")(x)
    h = dense(int(dim * spec.mlp_ratio), f"{name}_mlp_fc1", activation=keras.activations.gelu)(h)
    h = dense(dim, f"{name}_mlp_fc2")(h)
    return layers.Add(name=f"{name}_add2")([x, branch(h, f"{name}_2", drop_path)])


def fits(size: int, spec: SwinSpec) -> bool:
    """Whether every stage's grid at this image side divides into windows (or is no larger than one)."""
    step = spec.patch * 2 ** (len(spec.depths) - 1)
    grids = [size // spec.patch // 2 ** i for i in range(len(spec.depths))]
    return size % step == 0 and all(g <= spec.window or g % spec.window == 0 for g in grids)


def sizes_that_fit(spec: SwinSpec, count: int = 4) -> list[int]:
    step = spec.patch * 2 ** (len(spec.depths) - 1)
    return [s for s in range(step, 4 * step * spec.window + 1, step) if fits(s, spec)][:count]


def check_size(input_shape, spec: SwinSpec, name: str) -> int:
    """The grid side after the patch embedding; one line unless every stage's grid divides into windows."""
    size = input_shape[0]
    if input_shape[1] != size or not fits(size, spec):
        raise UserError(f"model '{name}' attends within {spec.window}x{spec.window} windows of every stage's grid "
                        f"(tfdp does not pad them as timm does): data.image_size must divide into them at every "
                        f"stage ({', '.join(map(str, sizes_that_fit(spec)))}, …), got {size}"
                        + (f"x{input_shape[1]}" if input_shape[1] != size else ""))
    return size // spec.patch


def swin_transformer(input_shape, num_classes: int, dropout: float, spec: SwinSpec, name: str,
                     drop_path: float = 0.0) -> keras.Model:
    grid = check_size(input_shape, spec, name)
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(spec.dim, spec.patch, strides=spec.patch, name="patch_embed")(inputs)
    x = layers.LayerNormalization(**LAYER_NORM, name="patch_embed_norm")(x)
    total, done = sum(spec.depths), 0
    for stage, (depth, heads) in enumerate(zip(spec.depths, spec.heads)):
        dim = spec.dim * 2 ** stage
        if stage:
            x = MergePatches(name=f"layers_{stage}_downsample")(x)
            x = layers.LayerNormalization(**LAYER_NORM, name=f"layers_{stage}_downsample_norm")(x)
            x = dense(dim, f"layers_{stage}_downsample_reduction", use_bias=False)(x)
            grid //= 2
        for i in range(depth):
            window, shift = window_and_shift(grid, spec.window, spec.window // 2 if i % 2 else 0)
            x = block(x, f"layers_{stage}_blocks_{i}", dim, heads, window, shift, spec,
                      drop_path * done / max(total - 1, 1))
            done += 1
    x = layers.LayerNormalization(**LAYER_NORM, name="norm")(x)
    x = layers.GlobalAveragePooling2D(name="head_pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="head_drop")(x)
    logits = dense(num_classes, "head_fc")(x)
    return keras.Model(inputs, logits, name=f"{name}_backbone")


# timm's model names → their architecture
SPECS: dict[str, SwinSpec] = {
    "swin_tiny_patch4_window7_224": SwinSpec(4, 7, 96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "swin_small_patch4_window7_224": SwinSpec(4, 7, 96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "swin_base_patch4_window7_224": SwinSpec(4, 7, 128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "swin_base_patch4_window12_384": SwinSpec(4, 12, 128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "swin_large_patch4_window7_224": SwinSpec(4, 7, 192, (2, 2, 18, 2), (6, 12, 24, 48)),
    "swin_large_patch4_window12_384": SwinSpec(4, 12, 192, (2, 2, 18, 2), (6, 12, 24, 48)),
}


def _register(name: str, spec: SwinSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return swin_transformer(input_shape, num_classes, dropout, spec, name, drop_path)
    build.__name__ = name
    register(name, min_size=sizes_that_fit(spec, 1)[0], drop_path=True, fixed_size=True, head=HEAD,
             layer_groups=LAYER_GROUPS)(build)


for _name, _spec in SPECS.items():
    _register(_name, _spec)


# ---------------------------------------------------------------- weights: timm state dicts


# timm's modules tfdp builds; the buffers older checkpoints hold (relative_position_index, attn_mask) are
# constants tfdp computes, and are skipped as timm's checkpoint_filter_fn skips them
TIMM_MODULES = re.compile(r"patch_embed\.(proj|norm)|norm|head\.fc|layers\.\d+\.downsample\.(norm|reduction)|"
                          r"layers\.\d+\.blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|attn|mlp\.fc1|mlp\.fc2)")
BUFFERS = re.compile(r".*\.(relative_position_index|attn_mask)$")


def timm_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """timm's checkpoint_filter_fn for checkpoints of timm before 0.9 (and Microsoft's): the patch merging moved
    from the end of stage N to the start of stage N + 1, `head` to `head.fc`."""
    if "head.fc.weight" in tensors or "head.weight" not in tensors:
        return tensors
    renamed = {}
    for key, value in tensors.items():
        key = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) + 1}.downsample", key)
        renamed[key.replace("head.", "head.fc.")] = value
    return renamed


def module_values(module: str, params: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[str]]:
    """One timm module's tensors in its Keras layer's variable order and layout."""
    if "relative_position_bias_table" in params:
        return [params["relative_position_bias_table"]], ["relative_position_bias_table"]
    if params["weight"].ndim == 4:   # the patch embedding: OIHW → HWIO
        return [params["weight"].transpose(2, 3, 1, 0), params["bias"]], ["weight", "bias"]
    if params["weight"].ndim == 2:   # Linear (the patch merging's has no bias)
        names = ["weight", "bias"][:len(params)]
        return [params["weight"].T] + ([params["bias"]] if "bias" in params else []), names
    return [params["weight"], params["bias"]], ["weight", "bias"]   # LayerNorm: gamma, beta


@register_torch_layout(*SPECS, origins=("timm",))
def swin_state_dict(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A timm Swin state dict as `Weights`: layer = the module's name with `_` for `.` (the patch embedding's
    projection: `patch_embed`)."""
    kept = {key: value for key, value in timm_names(tensors).items() if not BUFFERS.fullmatch(key)}
    modules = by_module(kept, TIMM_MODULES, model_cfg, what)
    values, names = {}, {}
    for module, params in modules.items():
        layer = "patch_embed" if module == "patch_embed.proj" else module.replace(".", "_")
        values[layer], order = module_values(module, params)
        names[layer] = [f"{module}.{p}" for p in order]
    return Weights(f"{what} (timm layout)", values, names)
