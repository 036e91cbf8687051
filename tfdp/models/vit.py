"""Vision Transformers (ViT, Dosovitskiy et al. 2021), DeiT (Touvron et al. 2021), DINOv2 (Oquab et al. 2024),
CLIP's (Radford et al. 2021) and SigLIP's (Zhai et al. 2023) image towers as timm builds them, and their weights
from timm, torchvision and keras-hub.

timm's `VisionTransformer` layout, one Keras layer per timm module so the
layer names are timm's module names with `_` for `.` (`blocks.3.attn.qkv` is
`blocks_3_attn_qkv`): a patch embedding (a convolution of the patch size and
stride), a class token (and DeiT's distillation token) in front, learned
absolute position embeddings added, pre-norm blocks (LayerNorm, multi-head
self-attention with one fused qkv projection, LayerNorm, a GELU MLP of 4x the
width, each branch added back), a final LayerNorm and the classifier on the
class token. LayerNorm's epsilon is 1e-6, as timm's and torchvision's (CLIP's 1e-5).
Parameter counts equal timm's at 1,000 classes (ViT-B/16 86,567,656;
DeiT-B distilled 87,338,192; tests/models/test_vit.py lists them all);
torchvision's vit_b_16, vit_b_32, vit_l_16 and vit_l_32 are the same
networks as the timm models of those sizes.

Training options, as timm's:

- drop path (stochastic depth) on both residual branches of every block, the
  rate rising linearly from 0 at the first block to `model.drop_path` at the
  last (timm's `drop_path_rate`);
- layer scale (`init_values`, CaiT's LayerScale): each branch multiplied by a
  learned per-channel vector starting at `init_values`; None: none, as the
  ViT and DeiT weights were trained;
- DeiT's distillation token: a second token with its own classifier
  (`head_dist`), trained by a teacher in DeiT; here, as in timm when
  `distilled_training` is off, the two classifiers' logits are averaged, in
  training and at inference;
- `model.dropout` before the classifier (timm's `drop_rate` on the head).

The families differ only in `ViTSpec`'s switches, each timm's: DINOv2's
layer scale and register tokens (`no_embed_class`: the position embeddings
cover the patches only), CLIP's LayerNorm before the blocks (`pre_norm`,
epsilon 1e-5, no patch-embedding bias) and QuickGELU, SigLIP's towers without
a class token and with attention pooling before the classifier (`pool="map"`),
DeiT III's layer scale, and timm's average-pooling ViTs (`pool="avg"`: the
patch tokens' mean, `fc_norm` after it; registers without a class token).

Attention goes through `keras.ops.dot_product_attention`. The position grid
is fixed by the image size the model is built at (`data.image_size`, which
the patch must divide): weights trained at another size have their position
embeddings resampled on load, as timm's `resample_abs_pos_embed` does
(`PositionEmbedding.adapt_loaded`), so a 224 px checkpoint fine-tunes at 384.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import keras
import numpy as np
from keras import layers

from tfdp.config import ModelConfig
from tfdp.errors import UserError
from tfdp.models.registry import WITH_PREVIOUS, register
from tfdp.models.resnet import DropPath
from tfdp.models.weights import (Weights, by_module, h5_groups, keras_hub_head, register_keras_hub_layout,
                                 register_torch_layout)

# timm's VisionTransformer.group_matcher(coarse=False) on tfdp's layer names: the embeddings (the register tokens
# live in the class token's layer, or in their own without one) and CLIP's norm_pre, one group per block, the final
# norm with the last block (timm's MATCH_PREV_GROUP); the classifier, SigLIP's attention pool and fc_norm (unmatched)
# last.
LAYER_GROUPS = {"stem": r"^(?:cls_token|reg_token|pos_embed|patch_embed|norm_pre)", "blocks": r"^blocks_(\d+)_",
                WITH_PREVIOUS: r"^norm$"}
HEAD = ("head", "head_dist")


# ---------------------------------------------------------------- layers


@keras.saving.register_keras_serializable(package="tfdp")
class PrefixTokens(layers.Layer):
    """Puts the learned class token in front of the patch tokens, then DeiT's distillation token or DINOv2's
    register tokens (timm's order: class, distillation or registers, patches); timm's average-pooling ViTs have
    registers without a class token (`class_token=False`)."""

    def __init__(self, distilled: bool = False, reg_tokens: int = 0, class_token: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.distilled = bool(distilled)
        self.reg_tokens = int(reg_tokens)
        self.class_token = bool(class_token)

    def build(self, input_shape):
        dim = input_shape[-1]
        # timm draws them with trunc_normal(std=0.02) (the class token 1e-6); Keras' truncated normal is the same law
        init = keras.initializers.TruncatedNormal(stddev=0.02)
        if self.class_token:
            self.cls_token = self.add_weight(shape=(1, 1, dim), initializer=init, name="cls_token")
        if self.distilled:
            self.dist_token = self.add_weight(shape=(1, 1, dim), initializer=init, name="dist_token")
        if self.reg_tokens:   # timm draws them with normal(std=1e-6)
            self.reg_token = self.add_weight(shape=(1, self.reg_tokens, dim), name="reg_token",
                                             initializer=keras.initializers.RandomNormal(stddev=1e-6))

    def call(self, x):
        batch = keras.ops.shape(x)[0]
        tokens = ([self.cls_token] if self.class_token else []) + ([self.dist_token] if self.distilled else []) + (
            [self.reg_token] if self.reg_tokens else [])
        tokens = [keras.ops.broadcast_to(keras.ops.cast(t, x.dtype), (batch, t.shape[1], x.shape[-1]))
                  for t in tokens]
        return keras.ops.concatenate([*tokens, x], axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1] + self.class_token + self.distilled + self.reg_tokens, input_shape[2])

    def get_config(self):
        return {**super().get_config(), "distilled": self.distilled, "reg_tokens": self.reg_tokens,
                "class_token": self.class_token}


def bicubic_antialias_matrix(in_size: int, out_size: int) -> np.ndarray:
    """(out_size, in_size) weights of PyTorch's `interpolate(mode='bicubic', antialias=True, align_corners=False)`
    along one axis (PIL's resampling: the cubic kernel with a = -0.5, its support widened by the scale when
    shrinking, weights cut at the borders and renormalised; aten/src/ATen/native/cpu/UpSampleKernel.cpp)."""
    scale = in_size / out_size
    support = 2.0 * max(scale, 1.0)
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    matrix = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        weights = cubic((np.arange(lo, hi) - center + 0.5) * inv_scale)
        matrix[i, lo:hi] = weights / weights.sum()
    return matrix


def cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resample_abs_pos_embed(posemb: np.ndarray, new_grid: tuple[int, int], prefix_tokens: int) -> np.ndarray:
    """timm's `resample_abs_pos_embed` (bicubic, antialias=True) in numpy: the prefix tokens' embeddings kept,
    the patch grid's (assumed square, as timm assumes it) resampled to `new_grid`."""
    prefix, grid = posemb[:, :prefix_tokens], posemb[:, prefix_tokens:]
    side = math.isqrt(grid.shape[1])
    grid = grid.reshape(side, side, -1).astype(np.float64)
    rows, cols = bicubic_antialias_matrix(side, new_grid[0]), bicubic_antialias_matrix(side, new_grid[1])
    out = np.einsum("ij,jkc,lk->ilc", rows, grid, cols).reshape(1, -1, grid.shape[-1])
    return np.concatenate([prefix, out.astype(posemb.dtype)], axis=1)


@keras.saving.register_keras_serializable(package="tfdp")
class PositionEmbedding(layers.Layer):
    """Adds learned absolute position embeddings (one per prefix token and per patch of the fixed grid).

    It knows its grid and prefix tokens, so it fits embeddings learned on
    another grid to its own on load (`adapt_loaded`, which `load_into` calls):
    a checkpoint at another image size fine-tunes here.
    """

    def __init__(self, grid: tuple[int, int], prefix_tokens: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.grid = tuple(int(g) for g in grid)
        self.prefix_tokens = int(prefix_tokens)

    def build(self, input_shape):
        self.pos_embed = self.add_weight(shape=(1, input_shape[1], input_shape[2]), name="pos_embed",
                                         initializer=keras.initializers.TruncatedNormal(stddev=0.02))

    def call(self, x):
        return x + keras.ops.cast(self.pos_embed, x.dtype)

    def adapt_loaded(self, values: list[np.ndarray]) -> tuple[list[np.ndarray], str | None]:
        """`values` ([pos_embed]) resampled to this layer's grid where they hold another square grid of the same
        width; anything else comes back as it is (and `load_into` says it does not fit)."""
        (value,) = values
        want = tuple(int(d) for d in self.pos_embed.shape)
        patches = value.shape[1] - self.prefix_tokens if value.ndim == 3 else -1
        side = math.isqrt(max(patches, 0))
        if value.shape == want or value.ndim != 3 or value.shape[2] != want[2] or side * side != patches or not side:
            return values, None
        resampled = resample_abs_pos_embed(np.asarray(value), self.grid, self.prefix_tokens)
        return [resampled], (f"{self.name} resampled from a {side}x{side} to a {self.grid[0]}x{self.grid[1]} grid "
                             f"(bicubic, antialiased, as timm's resample_abs_pos_embed)")

    def get_config(self):
        return {**super().get_config(), "grid": self.grid, "prefix_tokens": self.prefix_tokens}


@keras.saving.register_keras_serializable(package="tfdp")
class SelfAttention(layers.Layer):
    """Multi-head scaled dot-product attention over a fused (q, k, v) projection laid out as timm's and PyTorch's
    (`qkv` reshaped to (3, heads, head_dim)); through `keras.ops.dot_product_attention`."""

    def __init__(self, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = int(heads)

    def call(self, qkv):
        tokens, width = qkv.shape[1], qkv.shape[2] // 3
        qkv = keras.ops.reshape(qkv, (-1, tokens, 3, self.heads, width // self.heads))
        q, k, v = (qkv[:, :, i] for i in range(3))   # (batch, tokens, heads, head_dim) each
        out = keras.ops.dot_product_attention(q, k, v)
        return keras.ops.reshape(out, (-1, tokens, width))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], input_shape[2] // 3)

    def get_config(self):
        return {**super().get_config(), "heads": self.heads}


@keras.saving.register_keras_serializable(package="tfdp")
class LayerScale(layers.Layer):
    """x times a learned per-channel vector starting at `init_values` (timm's LayerScale, CaiT)."""

    def __init__(self, init_values: float, **kwargs):
        super().__init__(**kwargs)
        self.init_values = float(init_values)

    def build(self, input_shape):
        self.gamma = self.add_weight(shape=(input_shape[-1],), name="gamma",
                                     initializer=keras.initializers.Constant(self.init_values))

    def call(self, x):
        return x * keras.ops.cast(self.gamma, x.dtype)

    def get_config(self):
        return {**super().get_config(), "init_values": self.init_values}


@keras.saving.register_keras_serializable(package="tfdp")
class LatentQuery(layers.Layer):
    """The learned latent query of timm's AttentionPoolLatent (`attn_pool.latent`), one per image."""

    def build(self, input_shape):
        dim = input_shape[-1]   # timm draws it with trunc_normal_tf_(std=dim ** -0.5)
        self.latent = self.add_weight(shape=(1, 1, dim), name="latent",
                                      initializer=keras.initializers.TruncatedNormal(stddev=dim ** -0.5))

    def call(self, x):
        return keras.ops.broadcast_to(keras.ops.cast(self.latent, x.dtype), (keras.ops.shape(x)[0], 1, x.shape[-1]))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1, input_shape[-1])


@keras.saving.register_keras_serializable(package="tfdp")
class CrossAttention(layers.Layer):
    """Multi-head attention of queries (B, Q, C) over a fused key-value projection (B, N, 2C) laid out as timm's
    `kv` (reshaped to (2, heads, head_dim)); through `keras.ops.dot_product_attention`."""

    def __init__(self, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = int(heads)

    def call(self, inputs):
        q, kv = inputs
        width = q.shape[-1]
        kv = keras.ops.reshape(kv, (-1, kv.shape[1], 2, self.heads, width // self.heads))
        q = keras.ops.reshape(q, (-1, q.shape[1], self.heads, width // self.heads))
        out = keras.ops.dot_product_attention(q, kv[:, :, 0], kv[:, :, 1])
        return keras.ops.reshape(out, (-1, q.shape[1], width))

    def compute_output_shape(self, input_shapes):
        return input_shapes[0]

    def get_config(self):
        return {**super().get_config(), "heads": self.heads}


@keras.saving.register_keras_serializable(package="tfdp")
def quick_gelu(x):
    """OpenAI CLIP's approximation of GELU, x * sigmoid(1.702 x): its image towers were trained with it (timm's
    `quick_gelu`)."""
    return x * keras.ops.sigmoid(1.702 * x)


@keras.saving.register_keras_serializable(package="tfdp")
def gelu_tanh(x):
    """GELU's tanh approximation (timm's `gelu_tanh`, torch's `GELU(approximate='tanh')`), which some SigLIP towers
    were trained with."""
    return keras.activations.gelu(x, approximate=True)


# The MLP's activation: timm's nn.GELU is the exact one (erf), as Keras' default
ACTIVATIONS = {"gelu": keras.activations.gelu, "quick_gelu": quick_gelu, "gelu_tanh": gelu_tanh}


@keras.saving.register_keras_serializable(package="tfdp")
class HeadAverage(layers.Average):
    """A distilled DeiT's two classifiers averaged, as timm's `forward_head`; while it is trained by a teacher
    (`distilled_training`, set by tfdp.train.distillation, never saved), training calls get both heads side by
    side instead, [class head | distillation head] on the last axis, for the two losses (timm's
    `set_distilled_training`)."""

    distilled_training = False

    def call(self, inputs, training=None):
        if training and self.distilled_training:
            return keras.ops.concatenate(inputs, axis=-1)
        return super().call(inputs)


@keras.saving.register_keras_serializable(package="tfdp")
class Token(layers.Layer):
    """One token of the sequence: the class token (0) or the distillation token (1), for their classifiers."""

    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = int(index)

    def call(self, x):
        return x[:, self.index]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])

    def get_config(self):
        return {**super().get_config(), "index": self.index}


@keras.saving.register_keras_serializable(package="tfdp")
class PatchMean(layers.Layer):
    """The mean of the patch tokens, the prefix tokens (class, registers) left out: timm's `global_pool='avg'`
    (`global_pool_nlc(x, 'avg')`), for its average-pooling ViTs and EVA-02."""

    def __init__(self, prefix_tokens: int, **kwargs):
        super().__init__(**kwargs)
        self.prefix_tokens = int(prefix_tokens)

    def call(self, x):
        return keras.ops.mean(x[:, self.prefix_tokens:], axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])

    def get_config(self):
        return {**super().get_config(), "prefix_tokens": self.prefix_tokens}


# ---------------------------------------------------------------- the network


@dataclasses.dataclass(frozen=True)
class ViTSpec:
    """What tells one ViT from another (timm's VisionTransformer arguments)."""
    patch: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: float = 4.0
    distilled: bool = False
    init_values: float | None = None   # layer scale's start; None: no layer scale
    reg_tokens: int = 0                # DINOv2's register tokens (Darcet et al. 2024), after the class token
    no_embed_class: bool = False       # position embeddings for the patches only, added before the tokens go in
    pre_norm: bool = False             # CLIP's LayerNorm between the embeddings and the blocks (timm's norm_pre),
                                       # and then no bias in the patch embedding
    norm_eps: float = 1e-6             # every LayerNorm's epsilon (timm's and torchvision's ViTs; CLIP's 1e-5)
    act: str = "gelu"                  # the MLP's activation, a key of ACTIVATIONS
    class_token: bool = True           # SigLIP's towers and timm's average-pooling ViTs have none
    pool: str = "token"                # what the classifier reads: the class token, "map" (attention pooling) or
                                       # "avg" (the patch tokens' mean, timm's global_pool='avg')
    fc_norm: bool = False              # the final LayerNorm after the pooling (timm's fc_norm) rather than before


def dense(units: int, name: str, activation=None, use_bias: bool = True):
    """A Dense layer as timm initialises its transformers' Linear layers: trunc_normal(std=0.02), zero biases."""
    return layers.Dense(units, activation=activation, use_bias=use_bias, name=name,
                        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02))


def branch_end(x, name: str, spec: ViTSpec, drop_path: float):
    """A residual branch's output: [layer scale], [drop path]."""
    if spec.init_values is not None:
        x = LayerScale(spec.init_values, name=f"{name}_ls")(x)
    return DropPath(drop_path, name=f"{name}_drop_path")(x) if drop_path else x


def block(x, i: int, spec: ViTSpec, drop_path: float):
    """timm's Block: x + drop_path(ls1(attn(norm1(x)))), then x + drop_path(ls2(mlp(norm2(x))))."""
    name = f"blocks_{i}"
    h = layers.LayerNormalization(epsilon=spec.norm_eps, name=f"{name}_norm1")(x)
    h = dense(3 * spec.dim, f"{name}_attn_qkv")(h)
    h = SelfAttention(spec.heads, name=f"{name}_attn")(h)
    h = dense(spec.dim, f"{name}_attn_proj")(h)
    x = layers.Add(name=f"{name}_add1")([x, branch_end(h, f"{name}_1", spec, drop_path)])
    h = layers.LayerNormalization(epsilon=spec.norm_eps, name=f"{name}_norm2")(x)
    h = dense(int(spec.dim * spec.mlp_ratio), f"{name}_mlp_fc1", activation=ACTIVATIONS[spec.act])(h)
    h = dense(spec.dim, f"{name}_mlp_fc2")(h)
    return layers.Add(name=f"{name}_add2")([x, branch_end(h, f"{name}_2", spec, drop_path)])


def check_patch_divides(input_shape, patch: int, name: str) -> tuple[int, int]:
    height, width = input_shape[0], input_shape[1]
    if height % patch or width % patch:
        raise UserError(f"model '{name}' cuts the image into {patch}x{patch} patches: data.image_size must be a "
                        f"multiple of {patch}, got {height}" + (f"x{width}" if width != height else ""))
    return height // patch, width // patch


def vision_transformer(input_shape, num_classes: int, dropout: float, spec: ViTSpec, name: str,
                       drop_path: float = 0.0) -> keras.Model:
    grid = check_patch_divides(input_shape, spec.patch, name)
    inputs = keras.Input(input_shape)
    # timm gives the patch embedding no bias where a LayerNorm follows the embeddings (CLIP's norm_pre)
    x = layers.Conv2D(spec.dim, spec.patch, strides=spec.patch, use_bias=not spec.pre_norm, name="patch_embed")(inputs)
    x = layers.Reshape((grid[0] * grid[1], spec.dim), name="patch_embed_flatten")(x)
    prefix = spec.class_token + spec.distilled + spec.reg_tokens
    tokens = PrefixTokens(spec.distilled, spec.reg_tokens, spec.class_token,
                          name="cls_token" if spec.class_token else "reg_token") if prefix else None
    if spec.no_embed_class or not prefix:   # timm's no_embed_class (and SigLIP's patches alone): the prefix tokens
        x = PositionEmbedding(grid, 0, name="pos_embed")(x)   # get no position embedding
        x = tokens(x) if tokens else x
    else:
        x = PositionEmbedding(grid, prefix, name="pos_embed")(tokens(x))
    if spec.pre_norm:
        x = layers.LayerNormalization(epsilon=spec.norm_eps, name="norm_pre")(x)
    for i in range(spec.depth):
        x = block(x, i, spec, drop_path * i / max(spec.depth - 1, 1))
    if not spec.fc_norm:
        x = layers.LayerNormalization(epsilon=spec.norm_eps, name="norm")(x)
    heads = []
    for index, head in enumerate(HEAD[:1 + spec.distilled]):
        h = pooled(x, spec, index, head, prefix)
        if spec.fc_norm:
            h = layers.LayerNormalization(epsilon=spec.norm_eps, name="fc_norm")(h)
        if dropout:
            h = layers.Dropout(dropout, name=f"{head}_drop")(h)
        heads.append(dense(num_classes, head)(h))
    logits = HeadAverage(name="head_average")(heads) if spec.distilled else heads[0]
    return keras.Model(inputs, logits, name=f"{name}_backbone")


def pooled(x, spec: ViTSpec, index: int, head: str, prefix: int):
    """What classifier `head` (the `index`th) reads: its token, the attention pool, or the patch tokens' mean."""
    if spec.pool == "map":
        return attention_pool(x, spec)
    if spec.pool == "avg":
        return PatchMean(prefix, name="pool")(x)
    return Token(index, name=f"{head}_token")(x)


def attention_pool(x, spec: ViTSpec):
    """timm's AttentionPoolLatent (SigLIP's "MAP" head, Zhai et al. 2022): a learned latent query attends over the
    tokens, then a projection and a pre-norm MLP on the one pooled token, each branch added back."""
    q = dense(spec.dim, "attn_pool_q")(LatentQuery(name="attn_pool")(x))
    kv = dense(2 * spec.dim, "attn_pool_kv")(x)
    h = dense(spec.dim, "attn_pool_proj")(CrossAttention(spec.heads, name="attn_pool_attn")([q, kv]))
    m = layers.LayerNormalization(epsilon=spec.norm_eps, name="attn_pool_norm")(h)
    m = dense(int(spec.dim * spec.mlp_ratio), "attn_pool_mlp_fc1", activation=ACTIVATIONS[spec.act])(m)
    h = layers.Add(name="attn_pool_add")([h, dense(spec.dim, "attn_pool_mlp_fc2")(m)])
    return Token(0, name="attn_pool_token")(h)


def clip(patch: int, dim: int, depth: int, heads: int, act: str = "gelu") -> ViTSpec:
    """A CLIP image tower's architecture (timm's `vit_*_clip_*`: `pre_norm=True`, LayerNorm epsilon 1e-5)."""
    return ViTSpec(patch, dim, depth, heads, pre_norm=True, norm_eps=1e-5, act=act)


def siglip(patch: int, dim: int, depth: int, heads: int, mlp_ratio: float = 4.0, act: str = "gelu",
           pool: str = "map") -> ViTSpec:
    """A SigLIP image tower's architecture (timm's `vit_*_siglip_*`: `class_token=False, global_pool='map'`; its
    `vit_*_siglip_gap_*`: the same tower averaging the patch tokens, `global_pool='avg', fc_norm=False`)."""
    return ViTSpec(patch, dim, depth, heads, mlp_ratio=mlp_ratio, class_token=False, pool=pool, act=act)


def gap(dim: int, depth: int, heads: int, reg_tokens: int, mlp_ratio: float = 4.0,
        init_values: float | None = 1e-5) -> ViTSpec:
    """One of timm's average-pooling ViTs with registers (its "searching for better ViT baselines" models,
    `vit_*_patch16_reg*_gap_*`): 16 px patches, no class token, register tokens without position embeddings, layer
    scale, the patch tokens' mean normalised by fc_norm."""
    return ViTSpec(16, dim, depth, heads, mlp_ratio=mlp_ratio, init_values=init_values, reg_tokens=reg_tokens,
                   no_embed_class=True, class_token=False, pool="avg", fc_norm=True)


# timm's model names → their architecture
SPECS: dict[str, ViTSpec] = {
    "vit_tiny_patch16_224": ViTSpec(16, 192, 12, 3),
    "vit_small_patch16_224": ViTSpec(16, 384, 12, 6),
    "vit_small_patch32_224": ViTSpec(32, 384, 12, 6),
    "vit_base_patch16_224": ViTSpec(16, 768, 12, 12),
    "vit_base_patch32_224": ViTSpec(32, 768, 12, 12),
    "vit_large_patch16_224": ViTSpec(16, 1024, 24, 16),
    "vit_large_patch32_224": ViTSpec(32, 1024, 24, 16),
    "deit_tiny_patch16_224": ViTSpec(16, 192, 12, 3),
    "deit_small_patch16_224": ViTSpec(16, 384, 12, 6),
    "deit_base_patch16_224": ViTSpec(16, 768, 12, 12),
    "deit_tiny_distilled_patch16_224": ViTSpec(16, 192, 12, 3, distilled=True),
    "deit_small_distilled_patch16_224": ViTSpec(16, 384, 12, 6, distilled=True),
    "deit_base_distilled_patch16_224": ViTSpec(16, 768, 12, 12, distilled=True),
    # DINOv2 (Oquab et al. 2024; self-supervised, published without a classifier, at 518 px): ViTs with 14 px
    # patches and layer scale; `_reg4`: with 4 register tokens and no position embedding for the prefix tokens.
    "vit_small_patch14_dinov2": ViTSpec(14, 384, 12, 6, init_values=1e-5),
    "vit_base_patch14_dinov2": ViTSpec(14, 768, 12, 12, init_values=1e-5),
    "vit_large_patch14_dinov2": ViTSpec(14, 1024, 24, 16, init_values=1e-5),
    "vit_small_patch14_reg4_dinov2": ViTSpec(14, 384, 12, 6, init_values=1e-5, reg_tokens=4, no_embed_class=True),
    "vit_base_patch14_reg4_dinov2": ViTSpec(14, 768, 12, 12, init_values=1e-5, reg_tokens=4, no_embed_class=True),
    "vit_large_patch14_reg4_dinov2": ViTSpec(14, 1024, 24, 16, init_values=1e-5, reg_tokens=4, no_embed_class=True),
    # DeiT III (Touvron et al. 2022; ImageNet-1k, or 21k then 1k): layer scale, and no position embedding for the
    # class token; timm's names for each size they were published at (`_384`: the same architecture).
    **{f"deit3_{size}_patch16_{px}": ViTSpec(16, dim, depth, heads, init_values=1e-6, no_embed_class=True)
       for size, dim, depth, heads, sizes in (("small", 384, 12, 6, (224, 384)), ("medium", 512, 12, 8, (224,)),
                                              ("base", 768, 12, 12, (224, 384)), ("large", 1024, 24, 16, (224, 384)))
       for px in sizes},
    "deit3_huge_patch14_224": ViTSpec(14, 1280, 32, 16, init_values=1e-6, no_embed_class=True),
    # CLIP's image towers (Radford et al. 2021; OpenCLIP): a LayerNorm before the blocks, epsilon 1e-5. timm's
    # ImageNet fine-tunes of them (`*.openai_ft_in1k`, `*.laion2b_ft_in12k_in1k`) use GELU; the towers trained
    # with QuickGELU (OpenAI's own), the `_quickgelu_` models.
    "vit_base_patch32_clip_224": clip(32, 768, 12, 12),
    "vit_base_patch16_clip_224": clip(16, 768, 12, 12),
    "vit_large_patch14_clip_224": clip(14, 1024, 24, 16),
    "vit_huge_patch14_clip_224": clip(14, 1280, 32, 16),
    "vit_base_patch32_clip_quickgelu_224": clip(32, 768, 12, 12, "quick_gelu"),
    "vit_base_patch16_clip_quickgelu_224": clip(16, 768, 12, 12, "quick_gelu"),
    "vit_large_patch14_clip_quickgelu_224": clip(14, 1024, 24, 16, "quick_gelu"),
    "vit_huge_patch14_clip_quickgelu_224": clip(14, 1280, 32, 16, "quick_gelu"),
    # SigLIP's (and SigLIP 2's) image towers (Zhai et al. 2023): no class token, attention pooling ("MAP") before
    # the classifier; timm's names for each size they were published at, one architecture per width.
    **dict.fromkeys(("vit_base_patch16_siglip_224", "vit_base_patch16_siglip_256", "vit_base_patch16_siglip_384",
                     "vit_base_patch16_siglip_512"), siglip(16, 768, 12, 12)),
    **dict.fromkeys(("vit_large_patch16_siglip_256", "vit_large_patch16_siglip_384"), siglip(16, 1024, 24, 16)),
    "vit_large_patch16_siglip_512": siglip(16, 1024, 24, 16, act="gelu_tanh"),
    # (timm's vit_so400m_patch14_siglip_384 convolves 378 of its 384 px; its weights are _378's here, at 378 px)
    **dict.fromkeys(("vit_so400m_patch14_siglip_224", "vit_so400m_patch14_siglip_378"),
                    siglip(14, 1152, 27, 16, mlp_ratio=3.7362)),
    # The same towers averaging their patch tokens (timm's `_gap_` models, for fine-tuning without the pool's query)
    **dict.fromkeys(("vit_base_patch16_siglip_gap_224", "vit_base_patch16_siglip_gap_256",
                     "vit_base_patch16_siglip_gap_384", "vit_base_patch16_siglip_gap_512"),
                    siglip(16, 768, 12, 12, pool="avg")),
    **dict.fromkeys(("vit_large_patch16_siglip_gap_256", "vit_large_patch16_siglip_gap_384"),
                    siglip(16, 1024, 24, 16, pool="avg")),
    "vit_large_patch16_siglip_gap_512": siglip(16, 1024, 24, 16, act="gelu_tanh", pool="avg"),
    **dict.fromkeys(("vit_so400m_patch14_siglip_gap_224", "vit_so400m_patch14_siglip_gap_378",
                     "vit_so400m_patch14_siglip_gap_448"), siglip(14, 1152, 27, 16, mlp_ratio=3.7362, pool="avg")),
    # timm's average-pooling ViTs with registers (Wightman's "searching for better ViT baselines", `.sbb_*` weights)
    "vit_wee_patch16_reg1_gap_256": gap(256, 14, 4, 1, mlp_ratio=5),
    "vit_little_patch16_reg1_gap_256": gap(320, 14, 5, 1, mlp_ratio=5.6),
    "vit_little_patch16_reg4_gap_256": gap(320, 14, 5, 4, mlp_ratio=5.6),
    "vit_medium_patch16_reg1_gap_256": gap(512, 12, 8, 1),
    "vit_medium_patch16_reg4_gap_256": gap(512, 12, 8, 4),
    **dict.fromkeys(("vit_mediumd_patch16_reg4_gap_256", "vit_mediumd_patch16_reg4_gap_384"), gap(512, 20, 8, 4)),
    "vit_betwixt_patch16_reg1_gap_256": gap(640, 12, 10, 1),
    **dict.fromkeys(("vit_betwixt_patch16_reg4_gap_256", "vit_betwixt_patch16_reg4_gap_384"), gap(640, 12, 10, 4)),
    "vit_base_patch16_reg4_gap_256": gap(768, 12, 12, 4, init_values=None),
    # For 16-32 px images (the digits demo, CPU tests): 4 px patches, 4 blocks of width 64; no timm counterpart
    # (timm, torchvision and keras-hub build it from these numbers).
    "vit_mini_patch4_small": ViTSpec(4, 64, 4, 4),
    # The same with DeiT's distillation token and head (the distillation tests' student).
    "deit_mini_distilled_patch4_small": ViTSpec(4, 64, 4, 4, distilled=True),
}


def _register(name: str, spec: ViTSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return vision_transformer(input_shape, num_classes, dropout, spec, name, drop_path)
    build.__name__ = name
    register(name, min_size=spec.patch, drop_path=True, fixed_size=True, head=HEAD[:1 + spec.distilled],
             layer_groups=LAYER_GROUPS)(build)


for _name, _spec in SPECS.items():
    _register(_name, _spec)


# ---------------------------------------------------------------- weights: timm and torchvision state dicts


def linear(weight: np.ndarray, bias: np.ndarray | None = None) -> list[np.ndarray]:
    """A torch Linear's (out, in) weight as a Keras Dense kernel (in, out), with its bias."""
    return [weight.T] + ([bias] if bias is not None else [])


def timm_layer(module: str) -> str:
    """timm's module name → tfdp's layer: `.` → `_` (blocks.0.attn.qkv → blocks_0_attn_qkv), layer scale's
    ls1/ls2 → blocks_N_1_ls / _2_ls, the patch embedding's projection → patch_embed."""
    if module == "patch_embed.proj":
        return "patch_embed"
    m = re.fullmatch(r"blocks\.(\d+)\.ls([12])", module)
    if m:
        return f"blocks_{m[1]}_{m[2]}_ls"
    return module.replace(".", "_")


def torchvision_module(key: str) -> str:
    """torchvision's VisionTransformer parameter name → the timm name of the same tensor."""
    fixed = {"class_token": "cls_token", "encoder.pos_embedding": "pos_embed", "conv_proj.weight":
             "patch_embed.proj.weight", "conv_proj.bias": "patch_embed.proj.bias"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"encoder\.layers\.encoder_layer_(\d+)\.(.+)", key)
    if m:
        parts = {"ln_1": "norm1", "ln_2": "norm2", "self_attention.out_proj": "attn.proj", "mlp.0": "mlp.fc1",
                 "mlp.3": "mlp.fc2", "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2"}
        inner = re.sub(r"^self_attention\.in_proj_(weight|bias)$", r"attn.qkv.\1", m[2])
        module, _, param = inner.rpartition(".")
        return f"blocks.{m[1]}.{parts.get(module, module)}.{param}"
    return {"encoder.ln.weight": "norm.weight", "encoder.ln.bias": "norm.bias", "heads.head.weight": "head.weight",
            "heads.head.bias": "head.bias"}.get(key, key)


# timm's ViT modules tfdp builds
TOKENS = ("cls_token", "dist_token", "reg_token")   # one layer's, in its variables' order
TIMM_MODULES = re.compile(r"cls_token|dist_token|reg_token|pos_embed|patch_embed\.proj|norm_pre|norm|fc_norm|head|"
                          r"head_dist|"
                          r"attn_pool|attn_pool\.(q|kv|proj|norm|mlp\.fc1|mlp\.fc2)|"
                          r"blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2|ls1|ls2)")


def is_torchvision(tensors: dict[str, np.ndarray]) -> bool:
    return "class_token" in tensors or "encoder.pos_embedding" in tensors


def module_values(module: str, params: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[str]]:
    """One timm module's tensors in its Keras layer's variable order and layout."""
    if module in (*TOKENS, "pos_embed"):
        return [params[""]], [module]
    if module == "patch_embed.proj":   # OIHW → HWIO; CLIP's has no bias
        bias = ["bias"] if "bias" in params else []
        return [params["weight"].transpose(2, 3, 1, 0)] + [params[b] for b in bias], ["weight", *bias]
    if "latent" in params:   # attention pooling's query
        return [params["latent"]], ["latent"]
    if "gamma" in params:   # layer scale
        return [params["gamma"]], ["gamma"]
    if params["weight"].ndim == 2:   # Linear
        return linear(params["weight"], params.get("bias")), ["weight", "bias"][:len(params)]
    return [params["weight"], params["bias"]], ["weight", "bias"]   # LayerNorm: gamma, beta


@register_torch_layout(*SPECS, origins=("timm", "torchvision"))
def vit_state_dict(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A timm (or torchvision) ViT/DeiT state dict as `Weights`: torchvision's names are read as timm's first."""
    source = "torchvision" if is_torchvision(tensors) else "timm"
    if source == "torchvision":
        tensors = {torchvision_module(k): v for k, v in tensors.items()}
    modules = by_module(tensors, TIMM_MODULES, model_cfg, what, whole=(*TOKENS, "pos_embed"))
    values, names = {}, {}
    for module, params in modules.items():
        layer = timm_layer(module)
        if module in TOKENS[1:] and "cls_token" in modules:   # the distillation and register tokens live in the
            continue                                             # class token's layer, after it
        arrays, order = module_values(module, params)
        if module == "cls_token":
            extra = [t for t in TOKENS[1:] if t in modules]
            arrays, order = arrays + [modules[t][""] for t in extra], order + extra
        values[layer] = arrays
        names[layer] = [f"{module}.{p}" if p in params else p for p in order]
    return Weights(f"{what} ({source} layout)", values, names)


# ---------------------------------------------------------------- weights: keras-hub presets


def by_block(groups: dict[str, tuple[str, list[np.ndarray]]]) -> dict[str, list[np.ndarray]]:
    """The groups' variables by path, a transformer block's path prefix replaced by `blockN/` (0-based N, from the
    block's own name transformer_block_{N+1}: the paths Keras gives the blocks do not sort as numbers)."""
    prefixes = {path: int(name.rsplit("_", 1)[1]) - 1 for path, (name, _) in groups.items()
                if re.fullmatch(r"transformer_block_\d+", name)}
    out = {}
    for path, (_, arrays) in groups.items():
        prefix = next((p for p in prefixes if path.startswith(p + "/")), None)
        out[f"block{prefixes[prefix]}/{path[len(prefix) + 1:]}" if prefix else path] = arrays
    return out


# keras-hub ViTBackbone's sub-layer → tfdp's layer
KERAS_HUB_NAMES = {
    "layers/vi_t_patching_and_embedding/patch_embedding": "patch_embed",
    "layers/vi_t_patching_and_embedding": "cls_token",
    "layers/vi_t_patching_and_embedding/position_embedding": "pos_embed",
    "layers/vi_t_encoder/layer_norm": "norm",
}
KERAS_HUB_BLOCK = {"layer_norm_1": "norm1", "layer_norm_2": "norm2", "mha/output_dense": "attn_proj",
                   "mlp/dense_1": "mlp_fc1", "mlp/dense_2": "mlp_fc2"}
# ViTBackbone's config values tfdp's ViT has, and what they must be
KERAS_HUB_FIXED = {"use_class_token": True, "use_mha_bias": True, "use_mlp_bias": True, "use_patch_bias": True,
                   "layer_norm_epsilon": 1e-6}


def check_keras_hub_config(config: dict, model_cfg: ModelConfig, what: str) -> None:
    """The preset's backbone is the registry model's architecture (the shapes are checked on load)."""
    for key, want in KERAS_HUB_FIXED.items():
        if config.get(key, want) != want:
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': its ViTBackbone has "
                            f"{key}={config.get(key)}, tfdp's ViT {want}")


# the plain ViTs (class token, no layer scale): what keras-hub's ViT presets are
KERAS_HUB_MODELS = [name for name in SPECS if re.fullmatch(r"vit_[a-z]+_patch\d+_224", name)]


@register_keras_hub_layout("ViTBackbone", models=KERAS_HUB_MODELS)
def keras_hub_vit(preset: str, backbone: dict, task: dict | None, model_cfg: ModelConfig, what: str) -> Weights:
    """A keras-hub ViT preset (ViTBackbone, with ViTImageClassifier's head when the preset holds the task) as
    `Weights`: MultiHeadAttention's separate (dim, heads, head_dim) query/key/value kernels fused into qkv."""
    check_keras_hub_config(backbone["config"], model_cfg, what)
    if task is not None:
        config = task.get("config", {})
        if config.get("pooling", "token") != "token" or config.get("intermediate_dim"):
            raise UserError(f"model.init_from: {what} does not fit model '{model_cfg.name}': its classifier reads "
                            f"pooling={config.get('pooling')!r}, intermediate_dim={config.get('intermediate_dim')}; "
                            f"tfdp's ViT classifies the class token directly")
    found = by_block(h5_groups(os.path.join(preset, "model.weights.h5")))
    values, names = {}, {}

    def put(layer, arrays, sources):
        values[layer], names[layer] = arrays, sources
    for path, arrays in found.items():
        if path in KERAS_HUB_NAMES:
            layer = KERAS_HUB_NAMES[path]
            if layer == "pos_embed":
                arrays = [arrays[0][None]]
            put(layer, arrays, [f"{path}/vars/{i}" for i in range(len(arrays))])
    blocks = sorted({int(p.split("/")[0][len("block"):]) for p in found if re.match(r"block\d+/", p)})
    for i in blocks:
        for part, layer in KERAS_HUB_BLOCK.items():
            arrays = found[f"block{i}/{part}"]
            if part == "mha/output_dense":   # (heads, head_dim, dim) → (dim, dim)
                arrays = [arrays[0].reshape(-1, arrays[0].shape[-1]), arrays[1]]
            put(f"blocks_{i}_{layer}", arrays, [f"transformer_block_{i + 1}/{part}/vars/{k}" for k in range(2)])
        q, k, v = (found[f"block{i}/mha/{n}_dense"] for n in ("query", "key", "value"))
        put(f"blocks_{i}_attn_qkv", [np.concatenate([t[0].reshape(t[0].shape[0], -1) for t in (q, k, v)], axis=1),
                                     np.concatenate([t[1].reshape(-1) for t in (q, k, v)])],
            [f"transformer_block_{i + 1}/mha/query|key|value_dense/vars/{n}" for n in range(2)])
    if task is not None and (head := keras_hub_head(preset)):
        put("head", *head)
    return Weights(f"{what} (keras-hub ViT preset)", values, names)

