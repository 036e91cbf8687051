"""Checks of a zoo family against what a timm fixture recorded: timm's parameter counts and a full-size key list,
and its layer-decay groups (`optimizer.layer_decay`: the id timm's `param_groups_layer_decay` gives each parameter
of a small timm model; a weights reader's names say which parameters fill which layer)."""

from __future__ import annotations

import os
from typing import Callable, Iterable

import keras
import numpy as np

from support.shapes import shapes_only
from tfdp.config import ModelConfig
from tfdp.models import MODELS
from tfdp.models.weights import layers_with_weights, load_into, torch_weights
from tfdp.optim.finetune import layer_ids


def photo_logits(model: keras.Model, data_cfg, every: int = 1, size: int | None = None) -> np.ndarray:
    """The model's logits on tests/fixtures/photos.npy (4 real photos, 224 px; every `every`th row and column, cut
    to `size` where given), normalised as the run's config says."""
    from conftest import REPO
    photos = np.load(os.path.join(REPO, "tests", "fixtures", "photos.npy"))[:, ::every, ::every][:, :size, :size]
    photos = photos.astype(np.float32)
    return model.predict((photos - np.float32(data_cfg.mean)) / np.float32(data_cfg.std), verbose=0)


def assert_logits_are(ours: np.ndarray, theirs: np.ndarray, bound: float = 1e-4) -> None:
    """`ours` equal `theirs` within `bound` of their largest, which differ from photo to photo (the image matters)."""
    scale = np.abs(theirs).max()
    assert np.ptp(theirs, axis=0).max() > 0.1 * scale
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=bound * scale)


def counts_and_key_list_are_timms(counts: dict[str, int], name: str, shapes: dict[str, list[int]]) -> None:
    """Every model of `counts`, built at 224 px and 1,000 classes for its shapes only, has timm's count of trainable
    weights, and timm's full-size key list of `name` (`shapes`; zeros here) fills every layer of the zoo's `name`."""
    with shapes_only():
        for model_name, count in counts.items():
            model = MODELS[model_name]((224, 224, 3), 1000)
            assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == count, model_name
        tensors = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}
        cfg = ModelConfig(name=name, num_classes=1000)
        model = MODELS[name]((224, 224, 3), 1000)
        loaded, new = load_into(model, torch_weights(tensors, cfg, name), cfg)
        assert new == [] and len(loaded) == len(layers_with_weights(model))


def timm_groups(names: dict[str, list[str]], timm_ids: dict[str, int],
                aliases: Callable[[str], Iterable[str]] = lambda param: (param,)) -> dict[str, set[int]]:
    """Each layer's timm ids, through the parameter names a reader gave its values (`Weights.names`; `aliases`: the
    timm names a reader's name may stand for), layers without one left out."""
    found = {layer: {timm_ids[p] for param in params for p in aliases(param) if p in timm_ids}
             for layer, params in names.items()}
    return {layer: ids for layer, ids in found.items() if ids}


def tfdp_groups(model: keras.Model, zoo_name: str) -> tuple[dict[str, set[int]], int]:
    """Each layer's ids under the grouping registered for `zoo_name`, and the number of groups."""
    ids, count = layer_ids(model, zoo_name)
    return {layer.name: {ids[id(w)] for w in layer.trainable_weights} for layer in layers_with_weights(model)
            if layer.trainable_weights}, count
