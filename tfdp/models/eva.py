"""EVA-02 (Fang et al. 2023) and DINOv3 (Siméoni et al. 2025) as timm builds them (timm's `Eva`, in
`timm/models/eva.py`), and their weights from timm and from Meta's own DINOv3 checkpoints.

Both are ViTs (tfdp/models/vit.py) whose positions are rotary: in every block the
patch tokens' queries and keys are rotated by angles that grow with the patch's
row and column (RoPE), the prefix tokens left as they are. The angles are
computed for the grid the model is built at, so the same weights read any
multiple of the patch size. The families differ in timm's switches (`EvaSpec`):

- DINOv3: no position embedding; RoPE on patch centres normalised to [-1, 1]
  (timm's `RotaryEmbeddingDinoV3`: periods `100 ** (2i / (head_dim / 2))`, the
  rotate-half layout); four register tokens after the class token (Meta's
  "storage tokens"); layer scale (1e-5) on each branch; LayerNorm epsilon 1e-5;
  the final norm, then the average of the patch tokens (timm's default
  `global_pool='avg'`; Meta's linear probes read the class token). `_qkvb`:
  learned query and value biases; `_plus`: a SwiGLU MLP (`fc1_g`, `fc1_x`,
  `fc2`, its width rounded up to a multiple of 8).
- EVA-02: learned absolute position embeddings as well (resampled on load as a
  ViT's); RoPE on patch indices scaled to the 16x16 grid of pretraining (timm's
  `RotaryEmbeddingCat` with `ref_feat_shape`: frequencies
  `10000 ** (-i / (head_dim / 4))`, the interleaved layout); query and value
  biases; a SwiGLU MLP of 8/3 the width (base and large: a LayerNorm before
  `fc2`, timm's `scale_mlp`); no final norm: the average of the patch tokens,
  then `fc_norm`. LayerNorm epsilon 1e-6.

The key's bias is fixed at 0 wherever the query's and value's are learned (timm's
`EvaAttention`: rotated, a key bias would not cancel in the softmax). One Keras
layer per timm module, named as timm's with `_` for `.` (`blocks.3.attn.qkv` is
`blocks_3_attn_qkv`; the block's layer-scale vectors `blocks.3.gamma_1` and
`gamma_2` are `blocks_3_1_ls` and `blocks_3_2_ls`, as in vit.py); timm's
unfused `q_proj`/`k_proj`/`v_proj` (EVA-02 base and large) and packed SwiGLU
`fc1` (tiny and small) load into the fused `qkv` and the split `fc1_g`/`fc1_x`.
Parameter counts equal timm's.
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
from tfdp.models.vit import (LAYER_GROUPS, PatchMean, PositionEmbedding, PrefixTokens, branch_end,
                             check_patch_divides, dense)
from tfdp.models.weights import Weights, by_module, register_torch_layout, torch_module_values

HEAD = ("head",)


# ---------------------------------------------------------------- rotary position embeddings


def dinov3_angles(grid: tuple[int, int], head_dim: int, temperature: float, ref_grid) -> np.ndarray:
    """(rows * cols, head_dim) angles of DINOv3's RoPE (timm's `RotaryEmbeddingDinoV3`, `normalize_coords=
    'separate'`, no offset, 'ij' indexing): patch centres (i + 0.5) / rows and / cols mapped to [-1, 1]; head_dim / 4
    periods per axis, `temperature ** (2k / (head_dim / 2))`; 2 pi coord / period, rows' then columns', tiled twice
    (the rotate-half layout)."""
    rows, cols = grid
    centres = [2.0 * (np.arange(n, dtype=np.float64) + 0.5) / n - 1.0 for n in (rows, cols)]
    coords = np.stack(np.meshgrid(*centres, indexing="ij"), axis=-1).reshape(-1, 2)   # (HW, 2): row, column
    periods = temperature ** (2.0 * np.arange(head_dim // 4) / (head_dim // 2))
    angles = (2 * math.pi * coords[:, :, None] / periods[None, None, :]).reshape(len(coords), -1)
    return np.tile(angles, 2)


def eva02_angles(grid: tuple[int, int], head_dim: int, temperature: float, ref_grid) -> np.ndarray:
    """(rows * cols, head_dim) angles of EVA-02's RoPE (timm's `RotaryEmbeddingCat`, `in_pixels=False`): patch
    indices scaled to the reference grid (i / rows * ref_rows), head_dim / 4 frequencies per axis,
    `temperature ** (-k / (head_dim / 4))`; index times frequency, rows' then columns', each repeated twice (the
    interleaved layout)."""
    scaled = [np.arange(n, dtype=np.float64) / n * r for n, r in zip(grid, ref_grid)]
    coords = np.stack(np.meshgrid(*scaled, indexing="ij"), axis=-1).reshape(-1, 2)
    bands = 1.0 / temperature ** (np.arange(head_dim // 4) / (head_dim // 4))
    return np.repeat((coords[:, :, None] * bands[None, None, :]).reshape(len(coords), -1), 2, axis=-1)


def rotate_half(x):
    """[x1, x2] → [-x2, x1] over the last axis (the halves of a head)."""
    x1, x2 = keras.ops.split(x, 2, axis=-1)
    return keras.ops.concatenate([-x2, x1], axis=-1)


def rotate_pairs(x):
    """[x0, x1, x2, x3, …] → [-x1, x0, -x3, x2, …] over the last axis (neighbouring pairs)."""
    pairs = keras.ops.reshape(x, (-1, *x.shape[1:-1], x.shape[-1] // 2, 2))
    rotated = keras.ops.stack([-pairs[..., 1], pairs[..., 0]], axis=-1)
    return keras.ops.reshape(rotated, (-1, *x.shape[1:]))


# RoPE by kind: its angles and the rotation their layout pairs with
ROPES = {"dinov3": (dinov3_angles, rotate_half), "eva02": (eva02_angles, rotate_pairs)}


@keras.saving.register_keras_serializable(package="tfdp")
class RopeAttention(layers.Layer):
    """Multi-head attention over a fused (q, k, v) projection (timm's layout) whose patch tokens' queries and keys
    are rotated by the RoPE of `rope` (a key of ROPES) for this layer's grid; the prefix tokens (class, registers)
    are not. With `qkv_bias`, the learned `q_bias` and `v_bias` are added (the key's bias is 0, as timm's
    `EvaAttention`)."""

    def __init__(self, heads: int, grid: tuple[int, int], prefix_tokens: int, rope: str = "dinov3",
                 temperature: float = 100.0, ref_grid: tuple[int, int] | None = None, qkv_bias: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.heads, self.prefix_tokens, self.rope = int(heads), int(prefix_tokens), str(rope)
        self.grid, self.temperature, self.qkv_bias = tuple(int(g) for g in grid), float(temperature), bool(qkv_bias)
        self.ref_grid = tuple(int(g) for g in ref_grid) if ref_grid else None

    def build(self, input_shape):
        width = input_shape[-1] // 3
        angles_of, self.rotation = ROPES[self.rope]
        angles = angles_of(self.grid, width // self.heads, self.temperature, self.ref_grid)
        self.sin, self.cos = np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)
        if self.qkv_bias:
            self.q_bias = self.add_weight(shape=(width,), initializer="zeros", name="q_bias")
            self.v_bias = self.add_weight(shape=(width,), initializer="zeros", name="v_bias")

    def rotate(self, x):
        """x (batch, tokens, heads, head_dim) with its patch tokens rotated, in float32 whatever x's type (as timm's
        rotation under autocast, whose float32 table promotes it: bfloat16 would round the angles' sines)."""
        sin, cos = (keras.ops.convert_to_tensor(t)[None, :, None, :] for t in (self.sin, self.cos))
        prefix, patches = x[:, :self.prefix_tokens], keras.ops.cast(x[:, self.prefix_tokens:], "float32")
        rotated = keras.ops.cast(patches * cos + self.rotation(patches) * sin, x.dtype)
        return keras.ops.concatenate([prefix, rotated], axis=1)

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
                "rope": self.rope, "temperature": self.temperature, "ref_grid": self.ref_grid,
                "qkv_bias": self.qkv_bias}


# ---------------------------------------------------------------- the network


@dataclasses.dataclass(frozen=True)
class EvaSpec:
    """What tells one of timm's Evas from another (its arguments for `vit_*_dinov3*` and `eva02_*`)."""
    patch: int
    dim: int
    depth: int
    heads: int
    rope: str = "dinov3"                 # a key of ROPES
    rope_temperature: float = 100.0
    rope_ref_grid: tuple[int, int] | None = None   # EVA-02's: the grid its angles are scaled to
    pos_embed: bool = False              # learned absolute position embeddings as well (EVA-02)
    qkv_bias: bool = False               # learned q and v biases
    mlp: str = "gelu"                    # "gelu", "swiglu", or "swiglu_norm" (a LayerNorm before fc2)
    mlp_ratio: float = 4.0
    mlp_align: int = 8                   # SwiGLU's width rounded up to a multiple of this (0: not)
    init_values: float | None = 1e-5     # layer scale's start; None: no layer scale
    reg_tokens: int = 4
    norm_eps: float = 1e-5
    fc_norm: bool = False                # the norm after pooling instead of before (EVA-02)

    @property
    def prefix_tokens(self) -> int:
        return 1 + self.reg_tokens


def layer_norm(spec: EvaSpec, name: str):
    return layers.LayerNormalization(epsilon=spec.norm_eps, name=name)


def mlp(x, name: str, spec: EvaSpec):
    """timm's Mlp (fc1, GELU, fc2), or its SwiGLU (silu(fc1_g) * fc1_x, [a LayerNorm], fc2; the width rounded up to
    a multiple of `mlp_align`)."""
    hidden = int(spec.dim * spec.mlp_ratio)
    if spec.mlp == "gelu":
        return dense(spec.dim, f"{name}_fc2")(dense(hidden, f"{name}_fc1", activation="gelu")(x))
    if spec.mlp_align:
        hidden += -hidden % spec.mlp_align
    gate = dense(hidden, f"{name}_fc1_g", activation="silu")(x)
    h = layers.Multiply(name=f"{name}_glu")([gate, dense(hidden, f"{name}_fc1_x")(x)])
    if spec.mlp == "swiglu_norm":
        h = layer_norm(spec, f"{name}_norm")(h)
    return dense(spec.dim, f"{name}_fc2")(h)


def block(x, i: int, spec: EvaSpec, grid: tuple[int, int], drop_path: float):
    """timm's EvaBlock: x + drop_path([gamma_1 *] attn(norm1(x), rope)), then x + drop_path([gamma_2 *]
    mlp(norm2(x)))."""
    name = f"blocks_{i}"
    h = layer_norm(spec, f"{name}_norm1")(x)
    h = dense(3 * spec.dim, f"{name}_attn_qkv", use_bias=False)(h)
    h = RopeAttention(spec.heads, grid, spec.prefix_tokens, spec.rope, spec.rope_temperature, spec.rope_ref_grid,
                      spec.qkv_bias, name=f"{name}_attn")(h)
    h = dense(spec.dim, f"{name}_attn_proj")(h)
    x = layers.Add(name=f"{name}_add1")([x, branch_end(h, f"{name}_1", spec, drop_path)])
    h = mlp(layer_norm(spec, f"{name}_norm2")(x), f"{name}_mlp", spec)
    return layers.Add(name=f"{name}_add2")([x, branch_end(h, f"{name}_2", spec, drop_path)])


def eva(input_shape, num_classes: int, dropout: float, spec: EvaSpec, name: str,
        drop_path: float = 0.0) -> keras.Model:
    grid = check_patch_divides(input_shape, spec.patch, name)
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(spec.dim, spec.patch, strides=spec.patch, name="patch_embed")(inputs)
    x = layers.Reshape((grid[0] * grid[1], spec.dim), name="patch_embed_flatten")(x)
    x = PrefixTokens(reg_tokens=spec.reg_tokens, name="cls_token")(x)
    if spec.pos_embed:
        x = PositionEmbedding(grid, spec.prefix_tokens, name="pos_embed")(x)
    for i in range(spec.depth):
        x = block(x, i, spec, grid, drop_path * i / max(spec.depth - 1, 1))
    if not spec.fc_norm:
        x = layer_norm(spec, "norm")(x)
    x = PatchMean(spec.prefix_tokens, name="pool")(x)
    if spec.fc_norm:
        x = layer_norm(spec, "fc_norm")(x)
    if dropout:
        x = layers.Dropout(dropout, name="head_drop")(x)
    return keras.Model(inputs, dense(num_classes, "head")(x), name=f"{name}_backbone")


# timm's model names → their architecture.
# DINOv3: Meta's distilled ViTs of 2025 (S, S+, B, L, H+), each also `_qkvb`.
DINOV3 = {"small": EvaSpec(16, 384, 12, 6), "small_plus": EvaSpec(16, 384, 12, 6, mlp="swiglu"),
          "base": EvaSpec(16, 768, 12, 12), "large": EvaSpec(16, 1024, 24, 16),
          "huge_plus": EvaSpec(16, 1280, 32, 20, mlp="swiglu")}


def eva02(dim: int, depth: int, heads: int, mlp: str = "swiglu") -> EvaSpec:
    """An EVA-02's architecture (timm's `eva02_*_patch14_*`: 14 px patches, RoPE scaled to the 16x16 grid of its
    224 px pretraining, q/v biases, SwiGLU of 8/3 the width, no layer scale or registers, fc_norm)."""
    return EvaSpec(14, dim, depth, heads, rope="eva02", rope_temperature=10000.0, rope_ref_grid=(16, 16),
                   pos_embed=True, qkv_bias=True, mlp=mlp, mlp_ratio=4 * 2 / 3, mlp_align=0, init_values=None,
                   reg_tokens=0, norm_eps=1e-6, fc_norm=True)


SPECS: dict[str, EvaSpec] = {
    **{f"vit_{size}_patch16_dinov3{bias}": dataclasses.replace(spec, qkv_bias=bool(bias))
       for size, spec in DINOV3.items() for bias in ("", "_qkvb")},
    # EVA-02 (BAAI; MIM-pretrained on ImageNet-22k, fine-tuned at 336 or 448 px): one architecture per width
    **dict.fromkeys(("eva02_tiny_patch14_224", "eva02_tiny_patch14_336"), eva02(192, 12, 3)),
    **dict.fromkeys(("eva02_small_patch14_224", "eva02_small_patch14_336"), eva02(384, 12, 6)),
    **dict.fromkeys(("eva02_base_patch14_224", "eva02_base_patch14_448"), eva02(768, 12, 12, "swiglu_norm")),
    **dict.fromkeys(("eva02_large_patch14_224", "eva02_large_patch14_448"), eva02(1024, 24, 16, "swiglu_norm")),
}


def _register(name: str, spec: EvaSpec) -> None:
    def build(input_shape, num_classes: int, dropout: float, drop_path: float = 0.0) -> keras.Model:
        return eva(input_shape, num_classes, dropout, spec, name, drop_path)
    build.__name__ = name
    register(name, min_size=spec.patch, drop_path=True, fixed_size=True, head=HEAD, layer_groups=LAYER_GROUPS)(build)


for _name, _spec in SPECS.items():
    _register(_name, _spec)


# ---------------------------------------------------------------- weights: timm's and Meta's state dicts


TIMM_MODULES = re.compile(r"cls_token|reg_token|pos_embed|patch_embed\.proj|norm|fc_norm|head|blocks\.\d+|"
                          r"blocks\.\d+\.(norm1|norm2|attn|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2|mlp\.fc1_g|"
                          r"mlp\.fc1_x|mlp\.norm)")
TOKENS = ("cls_token", "reg_token", "pos_embed")   # tensors that are a module themselves
# Meta's DINOv3 checkpoint holds what timm's checkpoint_filter_fn drops: the RoPE periods (tfdp computes them), the
# qkv bias's mask, the pretraining's mask token
META_ONLY = re.compile(r".*\.(periods|bias_mask)$|mask_token")
# timm's checkpoint_filter_fn's renames: Meta's DINOv3 names, and the original SwiGLU names of EVA's and Meta's
META_RENAMES = (("storage_tokens", "reg_token"), (".ls1.gamma", ".gamma_1"), (".ls2.gamma", ".gamma_2"))
RENAMES = ((".mlp.w1.", ".mlp.fc1_g."), (".mlp.w2.", ".mlp.fc1_x."), (".mlp.w3.", ".mlp.fc2."),
           (".mlp.ffn_ln.", ".mlp.norm."))


def split_qkv_bias(key: str, value: np.ndarray, spec: EvaSpec, model_cfg: ModelConfig, what: str
                   ) -> dict[str, np.ndarray]:
    """A fused qkv bias (Meta's: its key third masked to 0) as `q_bias` and `v_bias`; a model without qkv biases
    takes one that is all 0 (Meta's distilled B, L, H+) and stops with one line naming the `_qkvb` model at a
    non-zero one (Meta's S/16), where timm would drop it."""
    q, _, v = np.split(value, 3)
    if spec.qkv_bias:
        return {key.replace("qkv.bias", "q_bias"): q, key.replace("qkv.bias", "v_bias"): v}
    if np.any(q) or np.any(v):
        raise UserError(f"model.init_from: {what} has non-zero query/value biases ({key}), which model "
                        f"'{model_cfg.name}' has no place for: use '{model_cfg.name}_qkvb'")
    return {}


def timm_names(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> dict[str, np.ndarray]:
    """A state dict in the layout tfdp builds: timm's checkpoint_filter_fn's renames (Meta's DINOv3 names and its
    fused qkv bias split, where the file is Meta's; EVA's w1/w2/w3), and timm's unfused attention (`q_proj`,
    `k_proj`, `v_proj`) and packed SwiGLU (`fc1` = gate, then value) as the fused `qkv` and the split
    `fc1_g`/`fc1_x`."""
    spec, meta = SPECS[model_cfg.name], "storage_tokens" in tensors
    out = {}
    for key, value in tensors.items():
        if meta and META_ONLY.fullmatch(key):
            continue
        for old, new in (META_RENAMES if meta else ()) + RENAMES:
            key = key.replace(old, new)
        if meta and key.endswith(".attn.qkv.bias"):
            out.update(split_qkv_bias(key, value, spec, model_cfg, what))
        elif spec.mlp != "gelu" and re.fullmatch(r"blocks\.\d+\.mlp\.fc1\.(weight|bias)", key):
            gate, value_half = np.split(value, 2)
            out[key.replace(".fc1.", ".fc1_g.")], out[key.replace(".fc1.", ".fc1_x.")] = gate, value_half
        else:
            out[key] = value
    for prefix in sorted({k[:-len(".q_proj.weight")] for k in out if k.endswith(".q_proj.weight")}):
        keys = [f"{prefix}.{p}_proj.weight" for p in "qkv"]
        if all(k in out for k in keys) and f"{prefix}.k_proj.bias" not in out:   # else by_module names what is left
            out[f"{prefix}.qkv.weight"] = np.concatenate([out.pop(k) for k in keys])
            for p in "qv":
                if f"{prefix}.{p}_proj.bias" in out:
                    out[f"{prefix}.{p}_bias"] = out.pop(f"{prefix}.{p}_proj.bias")
    return out


def module_values(module: str, params: dict[str, np.ndarray]) -> dict[str, tuple[list[np.ndarray], list[str]]]:
    """One timm module's tensors as {tfdp layer: (its variables in order and Keras' layout, their timm names)}."""
    m = re.fullmatch(r"blocks\.(\d+)", module)
    if m:   # the block's own parameters: its layer-scale vectors
        return {f"blocks_{m[1]}_{n}_ls": ([params[f"gamma_{n}"]], [f"gamma_{n}"]) for n in "12"
                if f"gamma_{n}" in params}
    layer = "patch_embed" if module == "patch_embed.proj" else module.replace(".", "_")
    if module in TOKENS:
        return {layer: ([params[""]], [""])}
    if "q_bias" in params:
        return {layer: ([params["q_bias"], params["v_bias"]], ["q_bias", "v_bias"])}
    if params["weight"].ndim > 1:   # the patch embedding (OIHW → HWIO), Linear ((out, in) → (in, out))
        return {layer: torch_module_values(params, layer)}
    return {layer: ([params["weight"], params["bias"]], ["weight", "bias"])}   # LayerNorm: gamma, beta


@register_torch_layout(*SPECS, origins=("timm",))
def eva_state_dict(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, what: str) -> Weights:
    """A timm (or Meta) EVA-02/DINOv3 state dict as `Weights`; the register tokens live in the class token's layer,
    after it (vit.PrefixTokens)."""
    source = "Meta's layout" if "storage_tokens" in tensors else "timm layout"
    modules = by_module(timm_names(tensors, model_cfg, what), TIMM_MODULES, model_cfg, what, whole=TOKENS)
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
