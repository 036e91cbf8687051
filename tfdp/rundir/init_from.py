"""Weights in a bucket (`model.init_from`, `--checkpoint`): the local copy every reader of weights takes.

The weights' readers (tfdp/models/weights.py) and the preprocessing they bring
(tfdp/config/pretrained.py) read local files: h5py, safetensors and Keras take
no bucket path. So `tfdp train` (for `model.init_from`) and `tfdp
evaluate|export|predict` (for `--checkpoint`) copy what those need into
`data.cache_dir` first, laid out as the bucket is (`data.cache_dir/s3/bucket/
path`, as `tfdp.data.storage.localize` lays out a dataset), and go on with the
copy, before TensorFlow starts:

- an object (a `.safetensors`, `.weights.h5` or `.keras` file): itself;
- a tfdp run in a bucket: what is read of a run, its best checkpoint
  (`checkpoints/best.weights.h5`) and its `config.yaml`; a run with no best
  checkpoint yet is one line naming a checkpoint folder to give instead;
- any other prefix (a keras-hub preset folder, a checkpoint folder): every
  object under it.

With an object or a checkpoint folder of a tfdp run, the run's `config.yaml`
comes too, so the weights' preprocessing reaches the config as it does from a
local run. Every fresh start copies afresh (a run's best checkpoint changes at
the same size as the run goes on), each file replacing its old copy in one
rename: a reader, another worker of the host included, never meets half a
file. A run that resumes (`resumes`) copies nothing: its own checkpoint holds
the weights.
"""

from __future__ import annotations

import os
import posixpath

from tfdp.data import storage
from tfdp.errors import UserError

BEST = "checkpoints/best.weights.h5"
# What init_from reads of a tfdp run: its best weights, their record, its resolved config.
RUN_FILES = (BEST, "checkpoints/best.json", "config.yaml")
# How far above the weights a run's config.yaml is looked for (as tfdp.config.pretrained.run_dir_of looks).
RUN_LEVELS = 4
# What each local copy tfdp made of `model.init_from` stands for (the bucket URL, the Hub handle at its commit): the
# run's config.yaml records that, not a path into this host's cache, so the config runs again on another host.
STANDS_FOR: dict[str, str] = {}


def recorded(spec: str) -> str:
    """What a run's config.yaml records for `model.init_from` = `spec`."""
    return STANDS_FOR.get(spec, spec)


def keep_recorded(model_dir: str, spec: str) -> None:
    """A resumed run (which fetches nothing) keeps what its config.yaml recorded for a Hub handle `spec`: the
    repository at the commit its weights came from, which the handle as given again (a branch) may no longer be."""
    import yaml

    from tfdp.config import yaml_floats
    from tfdp.rundir import hub
    if not hub.is_handle(spec):
        return
    try:
        with open(os.path.join(os.path.expanduser(model_dir), "config.yaml"), encoding="utf-8") as f:
            saved = (yaml_floats.load(f) or {}).get("model", {}).get("init_from")
        same = (isinstance(saved, str) and hub.is_handle(saved) and saved.split(":")[0] == spec.split(":")[0]
                and hub.parse(saved, "")[0] == hub.parse(spec, "")[0])
    except (OSError, yaml.YAMLError, AttributeError, UserError):
        return
    if same:
        STANDS_FOR[spec] = saved


def local_copy(url: str, cache_dir: str, what: str = "model.init_from") -> str:
    """The local path that stands for the bucket `url` once what it holds is copied into `cache_dir`; `what` names
    the setting in the one-line errors."""
    fs, path = storage.filesystem(url)
    path = path.rstrip("/")
    if fs.isfile(path):
        wanted = [path]
    elif is_run(fs, path):
        if not fs.isfile(f"{path}/{BEST}"):
            raise UserError(f"{what}: the run {url} has no best checkpoint yet ({BEST}); give one of its "
                            f"checkpoint folders instead ({url.rstrip('/')}/checkpoints/NAME)")
        wanted = [f"{path}/{rel}" for rel in RUN_FILES if fs.isfile(f"{path}/{rel}")]
    else:
        wanted = fs.find(path)
        if not wanted:
            raise UserError(f"{what}: nothing at {url} (no object, no folder)")
    wanted += run_config_above(fs, path)
    storage.localize([fs.unstrip_protocol(p) for p in wanted], cache_dir, fresh=True)
    return storage.cache_paths([fs.unstrip_protocol(path)], cache_dir)[0]


def resumes(model_dir: str) -> bool:
    """A local `model_dir` holding a complete checkpoint (a folder with its state.json, `tfdp.rundir.checkpoints`;
    a killed write's `.tmp-*` is none): `tfdp train` there continues from it and reads no `model.init_from`, so
    there is nothing to copy or fetch."""
    checkpoints = os.path.join(os.path.expanduser(model_dir), "checkpoints")
    if "://" in model_dir or not os.path.isdir(checkpoints):
        return False
    return any(not name.startswith(".") and os.path.isfile(os.path.join(checkpoints, name, "state.json"))
               for name in os.listdir(checkpoints))


def is_run(fs, path: str) -> bool:
    """A tfdp run directory: config.yaml beside a checkpoints/ folder."""
    return fs.isfile(f"{path}/config.yaml") and fs.isdir(f"{path}/checkpoints")


def run_config_above(fs, path: str) -> list[str]:
    """The config.yaml of the tfdp run `path` lies in (a checkpoint folder, a weights file), if any."""
    for _ in range(RUN_LEVELS - 1):
        parent = posixpath.dirname(path)
        if parent == path or "/" not in parent:   # the bucket itself
            return []
        if is_run(fs, parent):
            return [f"{parent}/config.yaml"]
        path = parent
    return []
