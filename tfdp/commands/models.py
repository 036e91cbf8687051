"""`tfdp models [PATTERN]`: the registry's models, as timm's `list_models('*convnext*')` lists its own.

Each line: the name, its trainable parameters (as timm and torchvision count them: batch-norm statistics left
out), at 1,000 classes and the model's native size, that size (the one in a timm-style name, `_224`; `any` where
the model takes any size, its count then at 224), and the weights `model.init_from` reads into it: PyTorch state
dicts (timm's, torchvision's layouts), keras-hub presets, Keras' own ImageNet files, each from the readers the
families register (`tfdp.models.weights`).

Building every model to count it takes about 15 minutes on two busy CPU cores (seconds each), so the counts are
measured once and kept in `tfdp.models.param_counts`; a model that table lacks is built to count when listed,
and `python -m tfdp.commands.models` measures them all again. A pattern without `*`, `?` or `[` matches within names
(`tfdp models convnext` is `tfdp models '*convnext*'`).
"""

from __future__ import annotations

import fnmatch
import math
import pprint
import sys

from tfdp.errors import UserError

# The size a model is counted at where its name gives none (a count depends on the size only for the models whose
# classifier reads a fixed-size feature map, and for position embeddings).
COUNT_SIZE = 224
COUNT_CLASSES = 1000


def listing_size(name: str) -> int | None:
    """The side `name` is designed for where its name says it (timm's `_224`), else None (any size)."""
    from tfdp.config.pretrained import native_size
    return native_size(name)


def count_trainable(name: str) -> int:
    """Trainable parameters of `name` at 1,000 classes and its listing size. Built in a Keras stateless scope that
    leaves the variables uninitialised (shapes only): an 842M-parameter model neither draws its random values
    (two thirds of the time a build takes) nor holds gigabytes."""
    import keras

    size = listing_size(name) or COUNT_SIZE
    with keras.StatelessScope(initialize_variables=False):
        model = _registry()[name]((size, size, 3), COUNT_CLASSES)
        count = sum(math.prod(w.shape) for w in model.trainable_weights)
    keras.backend.clear_session()
    return count


def weight_sources(name: str) -> list[str]:
    """What `model.init_from` reads into `name`, from the registered readers (`tfdp.models.weights`)."""
    from tfdp.config.pretrained import KERAS_IMAGENET
    from tfdp.models import weights
    sources = list(weights.WEIGHT_ORIGINS.get(name, ()))
    if name in weights.TORCH_LAYOUTS and not {"timm", "torchvision"} & set(sources):
        sources.insert(0, "PyTorch")   # a reader that did not say whose layouts it reads
    if name in KERAS_IMAGENET:   # keras.applications' own files: model.init_from: imagenet
        sources.append("Keras imagenet")
    return sources


def matching(pattern: str) -> list[str]:
    """The registry's names `pattern` matches (fnmatch, as timm's list_models; a bare word matches within names),
    sorted; none is one line."""
    models = _registry()
    glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
    names = sorted(n for n in models if fnmatch.fnmatchcase(n, glob))
    if not names:
        raise UserError(f"no model matches '{pattern}' ({len(models)} models; try a pattern such as "
                        f"'*convnext*', or none for all)")
    return names


def table(names: list[str]) -> list[str]:
    """One aligned line per model: name, parameters, native size, weights it reads."""
    from tfdp.models.param_counts import PARAM_COUNTS
    rows = [("model", "params", "size", "weights (model.init_from)")]
    for name in names:
        count = PARAM_COUNTS.get(name) or count_trainable(name)   # a model the table lacks: built to count
        rows.append((name, f"{count:,}", str(listing_size(name) or "any"),
                     ", ".join(weight_sources(name)) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]


def list_models(pattern: str = "") -> list[str]:
    """`tfdp models [PATTERN]`'s lines: the table, then what its numbers are."""
    lines = table(matching(pattern) if pattern else sorted(_registry()))
    return lines + [f"tfdp: models: {len(lines) - 1} listed; params: trainable, at {COUNT_CLASSES} classes and the "
                    f"native size ({COUNT_SIZE} where any)"]


def _registry() -> dict:
    """The registry, filled (importing `tfdp.models` imports every family)."""
    from tfdp.models import MODELS
    return MODELS


def write_counts(path: str) -> None:
    """Measures every registry model's count and writes `tfdp.models.param_counts`."""
    counts = {}
    for name in sorted(_registry()):
        counts[name] = count_trainable(name)
        print(name, counts[name], flush=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write('"""Trainable parameters of each registry model at 1,000 classes and its native size (224 where its '
                'name gives none),\nas `tfdp models` lists them. Generated: `python -m tfdp.commands.models '
                'tfdp/models/param_counts.py`."""\n\n')
        f.write(f"PARAM_COUNTS = {pprint.pformat(counts, width=100, sort_dicts=True)}\n")


if __name__ == "__main__":
    write_counts(sys.argv[1] if len(sys.argv) > 1 else "tfdp/models/param_counts.py")
