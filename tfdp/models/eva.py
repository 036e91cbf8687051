"""DINOv3 (Siméoni et al. 2025) as timm builds it (timm's `Eva`, in `timm/models/eva.py`), and its weights from timm
and from Meta's own checkpoints.

A DINOv3 ViT is a ViT (tfdp/models/vit.py) whose positions are rotary, not
added: no position embedding; in every block, the queries and keys of the patch
tokens are rotated by angles that grow with the patch's row and column
(`rope_table`: RoPE on coordinates normalised to [-1, 1], timm's
`RotaryEmbeddingDinoV3`, periods `100 ** (2i / (head_dim / 2))`, the
rotate-half layout), so the same weights read any grid without resampling.
Four register tokens follow the class token (Meta's "storage tokens"), layer
scale (1e-5) ends each branch, LayerNorm's epsilon is 1e-5, and the classifier
reads the average of the patch tokens after the final norm (timm's default
`global_pool='avg'` for DINOv3; Meta's linear probes read the class token).
The `_qkvb` models have learned query and value biases, the key's fixed at 0
(timm's `EvaAttention`: the key bias would be rotated, so it is not a
constant); the others none. `small_plus` and `huge_plus` use a SwiGLU MLP
(`fc1_g`, `fc1_x`, `fc2`, the width rounded up to a multiple of 8).

One Keras layer per timm module, named as timm's with `_` for `.`
(`blocks.3.attn.qkv` is `blocks_3_attn_qkv`; the block's layer-scale vectors
`blocks.3.gamma_1` and `gamma_2` are `blocks_3_1_ls` and `blocks_3_2_ls`, as in
vit.py). Parameter counts equal timm's. Meta publishes DINOv3 without a
classifier, at 256 px; the Hub's timm files have none either, so the head is new
on load (`weights.load_into`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import keras
import numpy as np
from keras import layers

from tfdp.config import ModelConfig
from tfdp.errors import UserError
from tfdp.models.registry import register
from tfdp.models.vit import LAYER_GROUPS, PrefixTokens, branch_end, check_patch_divides, dense
from tfdp.models.weights import Weights, by_module, register_torch_layout

HEAD = ("head",)


# ---------------------------------------------------------------- rotary position embeddings


def rope_table(grid: tuple[int, int], head_dim: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos), each (rows * cols, head_dim), of DINOv3's RoPE on a grid (timm's `RotaryEmbeddingDinoV3` with
    `normalize_coords='separate'`, no offset, 'ij' indexing, rotate-half layout): patch centres (i + 0.5) / rows
    and / cols mapped to [-1, 1]; head_dim / 4 periods per axis, `temperature ** (2k / (head_dim / 2))`; the angles
    2 pi coord / period, rows' then columns', tiled twice."""
    rows, cols = grid
    centres = [2.0 * (np.arange(n, dtype=np.float64) + 0.5) / n - 1.0 for n in (rows, cols)]
    coords = np.stack(np.meshgrid(*centres, indexing="ij"), axis=-1).reshape(-1, 2)   # (HW, 2): row, column
    periods = temperature ** (2.0 * np.arange(head_dim // 4) / (head_dim // 2))
    angles = (2 * math.pi * coords[:, :, None] / periods[None, None, :]).reshape(len(coords), -1)
    angles = np.tile(angles, 2)
    return np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)


def rotate_half(x):
    """[x1, x2] → [-x2, x1] over the last axis (the halves of a head)."""
    x1, x2 = keras.ops.split(x, 2, axis=-1)
    return keras.ops.concatenate([-x2, x1], axis=-1)


@keras.saving.register_keras_serializable(package="tfdp")
class RopeAttention(layers.Layer):
    """Multi-head attention over a fused (q, k, v) projection (timm's layout) whose patch tokens' queries and keys
    are rotated by DINOv3's RoPE for this layer's grid; the prefix tokens (class, registers) are not. With
    `qkv_bias`, the learned `q_bias` and `v_bias` are added (the key's bias is 0, as timm's `EvaAttention`)."""

    def __init__(self, heads: int, grid: tuple[int, int], prefix_tokens: int, temperature: float = 100.0,
                 qkv_bias: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.prefix_tokens = int(heads), int(prefix_tokens)
        self.grid, self.temperature, self.qkv_bias = tuple(int(g) for g in grid), float(temperature), bool(qkv_bias)

    def build(self, input_shape):
        width = input_shape[-1] // 3
        self.sin, self.cos = rope_table(self.grid, width // self.heads, self.temperature)
        if self.qkv_bias:
            self.q_bias = self.add_weight(shape=(width,), initializer="zeros", name="q_bias")
            self.v_bias = self.add_weight(shape=(width,), initializer="zeros", name="v_bias")

    def rotate(self, x):
        """x (batch, tokens, heads, head_dim) with its patch tokens rotated."""
        sin, cos = (keras.ops.cast(t, x.dtype)[None, :, None, :] for t in (self.sin, self.cos))
        prefix, patches = x[:, :self.prefix_tokens], x[:, self.prefix_tokens:]
        return keras.ops.concatenate([prefix, patches * cos + rotate_half(patches) * sin], axis=1)

    def call(self, qkv):
        tokens, width = qkv.shape[1], qkv.shape[2] // 3
        if self.qkv_bias:
            bias = keras.ops.concatenate([self.q_bias, keras.ops.zeros_like(self.q_bias), self.v_bias])
            qkv = qkv + keras.ops.cast(bias, qkv.dtype)
        qkv = keras.ops.reshape(qkv, (-1, tokens, 3, self.heads, width // self.heads))
        q, k, v = (qkv[:, :, i] for i in range(3))   # (batch, tokens, heads, head_dim) each
        out = keras.ops.dot_product_attention(self.rotate(q), self.rotate(k), v)
        return keras.ops.reshape(out, (-1, tokens, width))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], input_shape[2] // 3)

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "grid": self.grid, "prefix_tokens": self.prefix_tokens,
                "temperature": self.temperature, "qkv_bias": self.qkv_bias}


@keras.saving.register_keras_serializable(package="tfdp")
class PatchMean(layers.Layer):
    """The average of the patch tokens, the prefix tokens left out (timm's `global_pool_nlc(x, 'avg')`)."""

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
class EvaSpec:
    """What tells one DINOv3 from another (timm's Eva arguments for `vit_*_dinov3*`)."""
    patch: int
    dim: int
    depth: int
    heads: int
    qkv_bias: bool = False          # learned q and v biases (the `_qkvb` models)
    swiglu: bool = False            # SwiGLU MLP (the `_plus` models)
    mlp_ratio: float = 4.0
    init_values: float = 1e-5       # layer scale's start
    reg_tokens: int = 4
    norm_eps: float = 1e-5
    rope_temperature: float = 100.0

    @property
    def prefix_tokens(self) -> int:
        return 1 + self.reg_tokens


def mlp(x, name: str, spec: EvaSpec):
    """timm's Mlp (fc1, GELU, fc2), or its SwiGLU (silu(fc1_g) * fc1_x, fc2; the width rounded up to a multiple of
    8, timm's `align_to=8`)."""
    hidden = int(spec.dim * spec.mlp_ratio)
    if not spec.swiglu:
        return dense(spec.dim, f"{name}_fc2")(dense(hidden, f"{name}_fc1", activation="gelu")(x))
    hidden += -hidden % 8
    gate = dense(hidden, f"{name}_fc1_g", activation="silu")(x)
    h = layers.Multiply(name=f"{name}_glu")([gate, dense(hidden, f"{name}_fc1_x")(x)])
    return dense(spec.dim, f"{name}_fc2")(h)


def block(x, i: int, spec: EvaSpec, grid: tuple[int, int], drop_path: float):
    """timm's EvaBlock: x + drop_path(gamma_1 * attn(norm1(x), rope)), then x + drop_path(gamma_2 * mlp(norm2(x)))."""
    name = f"blocks_{i}"
    h = layers.LayerNormalization(epsilon=spec.norm_eps, name=f"{name}_norm1")(x)
    h = dense(3 * spec.dim, f"{name}_attn_qkv", use_bias=False)(h)
    h = RopeAttention(spec.heads, grid, spec.prefix_tokens, spec.rope_temperature, spec.qkv_bias,
                      name=f"{name}_attn")(h)
    h = dense(spec.dim, f"{name}_attn_proj")(h)
    x = layers.Add(name=f"{name}_add1")([x, branch_end(h, f"{name}_1", spec, drop_path)])
    h = layers.LayerNormalization(epsilon=spec.norm_eps, name=f"{name}_norm2")(x)
    h = mlp(h, f"{name}_mlp", spec)
    return layers.Add(name=f"{name}_add2")([x, branch_end(h, f"{name}_2", spec, drop_path)])


def dinov3(input_shape, num_classes: int, dropout: float, spec: EvaSpec, name: str,
           drop_path: float = 0.0) -> keras.Model:
    grid = check_patch_divides(input_shape, spec.patch, name)
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(spec.dim, spec.patch, strides=spec.patch, name="patch_embed")(inputs)
    x = layers.Reshape((grid[0] * grid[1], spec.dim), name="patch_embed_flatten")(x)
    x = PrefixTokens(reg_tokens=spec.reg_tokens, name="cls_token")(x)
    for i in range(spec.depth):
        x = block(x, i, spec, grid, drop_path * i / max(spec.depth - 1, 1))
    x = layers.LayerNormalization(epsilon=spec.norm_eps, name="norm")(x)
    x = PatchMean(spec.prefix_tokens, name="pool")(x)
    if dropout:
        x = layers.Dropout(dropout, name="head_drop")(x)
    return keras.Model(inputs, dense(num_classes, "head")(x), name=f"{name}_backbone")


# timm's model names → their architecture (Meta's distilled ViTs of 2025: S, S+, B, L, H+; each also `_qkvb`)
SIZES = {"small": EvaSpec(16, 384, 12, 6), "small_plus": EvaSpec(16, 384, 12, 6, swiglu=True),
         "base": EvaSpec(16, 768, 12, 12), "large": EvaSpec(16, 1024, 24, 16),
         "huge_plus": EvaSpec(16, 1280, 32, 20, swiglu=True)}
SPECS: dict[str, EvaSpec] = {f"vit_{size}_patch16_dinov3{bias}": dataclasses.replace(spec, qkv_bias=bool(bias))
                             for size, spec in SIZES.items() for bias in ("", "_qkvb")}


def _register(name: str, spec: EvaSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return dinov3(input_shape, num_classes, dropout, spec, name, drop_path)
    build.__name__ = name
    register(name, min_size=spec.patch, drop_path=True, fixed_size=True, head=HEAD, layer_groups=LAYER_GROUPS)(build)


for _name, _spec in SPECS.items():
    _register(_name, _spec)


# ---------------------------------------------------------------- weights: timm's and Meta's state dicts


TIMM_MODULES = re.compile(r"cls_token|reg_token|patch_embed\.proj|norm|head|blocks\.\d+|"
                          r"blocks\.\d+\.(norm1|norm2|attn|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2|mlp\.fc1_g|"
                          r"mlp\.fc1_x)")
# Meta's checkpoint holds what timm's checkpoint_filter_fn drops: the RoPE periods (tfdp computes them), the
# qkv bias's mask, the pretraining's mask token
META_ONLY = re.compile(r".*\.(periods|bias_mask)$|mask_token")
META_NAMES = (("storage_tokens", "reg_token"), (".ls1.gamma", ".gamma_1"), (".ls2.gamma", ".gamma_2"),
              (".mlp.w1.", ".mlp.fc1_g."), (".mlp.w2.", ".mlp.fc1_x."), (".mlp.w3.", ".mlp.fc2."))


def timm_names(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> dict[str, np.ndarray]:
    """Meta's DINOv3 checkpoint in timm's names, as timm's checkpoint_filter_fn renames it: `storage_tokens` →
    `reg_token`, `ls1.gamma` → `gamma_1`, SwiGLU's w1/w2/w3 → fc1_g/fc1_x/fc2, the fused qkv bias split into
    `q_bias` and `v_bias` (its key third is 0 by its mask). A model without qkv biases takes a checkpoint whose
    biases are all 0 (Meta's distilled B, L, H+); a non-zero bias there is one line naming the `_qkvb` model, where
    timm would drop it."""
    if "storage_tokens" not in tensors:
        return tensors
    spec = SPECS[model_cfg.name]
    out = {}
    for key, value in tensors.items():
        if META_ONLY.fullmatch(key):
            continue
        for old, new in META_NAMES:
            key = key.replace(old, new)
        if key.endswith(".attn.qkv.bias"):
            q, _, v = np.split(value, 3)
            if spec.qkv_bias:
                out[key.replace("qkv.bias", "q_bias")], out[key.replace("qkv.bias", "v_bias")] = q, v
            elif np.any(q) or np.any(v):
                raise UserError(f"model.init_from: {what} has non-zero query/value biases ({key}), which model "
                                f"'{model_cfg.name}' has no place for: use '{model_cfg.name}_qkvb'")
            continue
        out[key] = value
    return out


def module_values(module: str, params: dict[str, np.ndarray]) -> dict[str, tuple[list[np.ndarray], list[str]]]:
    """One timm module's tensors as {tfdp layer: (its variables in order and Keras' layout, their timm names)}."""
    m = re.fullmatch(r"blocks\.(\d+)", module)
    if m:   # the block's own parameters: its layer-scale vectors
        return {f"blocks_{m[1]}_{n}_ls": ([params[f"gamma_{n}"]], [f"gamma_{n}"]) for n in "12"
                if f"gamma_{n}" in params}
    layer = "patch_embed" if module == "patch_embed.proj" else module.replace(".", "_")
    if module in ("cls_token", "reg_token"):
        return {layer: ([params[""]], [""])}
    if "q_bias" in params:
        return {layer: ([params["q_bias"], params["v_bias"]], ["q_bias", "v_bias"])}
    weight = params["weight"]
    if weight.ndim == 4:   # the patch embedding: OIHW → HWIO
        return {layer: ([weight.transpose(2, 3, 1, 0), params["bias"]], ["weight", "bias"])}
    names = ["weight", "bias"][:len(params)]
    return {layer: ([weight.T if weight.ndim == 2 else weight] + [params[n] for n in names[1:]], names)}


@register_torch_layout(*SPECS)
def dinov3_state_dict(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A timm (or Meta) DINOv3 state dict as `Weights`; the register tokens live in the class token's layer, after
    it (vit.PrefixTokens)."""
    source = "Meta's layout" if "storage_tokens" in tensors else "timm layout"
    modules = by_module(timm_names(tensors, model_cfg, what), TIMM_MODULES, model_cfg, what,
                        whole=("cls_token", "reg_token"))
    values, names = {}, {}
    for module, params in modules.items():
        if module == "reg_token":
            continue
        for layer, (arrays, order) in module_values(module, params).items():
            if module == "cls_token" and "reg_token" in modules:
                arrays, order = arrays + [modules["reg_token"][""]], order + ["reg_token"]
            values[layer] = arrays
            names[layer] = [(f"{module}.{p}" if p else module) if p in params else p for p in order]
    return Weights(f"{what} ({source})", values, names)
