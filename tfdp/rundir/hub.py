"""Weights on the Hugging Face Hub (`model.init_from: hf-hub:timm/NAME`, `hf://keras/NAME`): the local files
every reader of weights takes.

timm names its weights `hf-hub:ORG/NAME` (`timm.create_model("hf-hub:timm/vit_base_patch16_224.augreg2_in21k_
ft_in1k")`), keras-hub `hf://ORG/NAME`; both may end in `@REVISION` (a branch, tag or commit). `tfdp train` fetches
what tfdp reads of such a repository with `huggingface_hub`, into the Hub's own cache (`HF_HOME`, `HF_HUB_CACHE`),
before TensorFlow starts, and goes on with the cached files:

- a repository whose `config.json` names a keras-hub class: the preset's files (`model.weights.h5`, and where the
  repository has them its task, preprocessor and image converter), and the run starts from the snapshot folder;
- any other (timm's layout): `model.safetensors`, and `config.json` beside it when there is one, whose pretrained
  cfg (mean, std, crop, interpolation) reaches the data config as from a file on disk.

Every file comes from the one commit the first answered for, so a branch that moves mid-download cannot mix two
versions. A file already in the cache at that commit is not fetched again, and with no network (or
`HF_HUB_OFFLINE=1`) the cache answers alone: a cluster's hosts without network start from what was fetched where
there was. Tokens (`HF_TOKEN`, for gated repositories), mirrors (`HF_ENDPOINT`) and the cache's place are
huggingface_hub's own settings. Whatever stops the download is one line.
"""

from __future__ import annotations

import json
import os
import re

from tfdp.errors import UserError, first_line

# timm's prefix, keras-hub's; and keras-hub's other home, which tfdp does not fetch from
HANDLES = ("hf-hub:", "hf://")
REFUSED = ("kaggle://",)
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
# What tfdp reads of a keras-hub preset (tfdp.models.weights, tfdp.config.pretrained): the backbone's weights
# must be there; a task's classifier and the image converter's preprocessing where the preset has them.
PRESET_WEIGHTS = "model.weights.h5"
PRESET_OPTIONAL = ("task.json", "task.weights.h5", "preprocessor.json", "image_converter.json", "metadata.json")


def is_handle(spec: str) -> bool:
    return spec.startswith(HANDLES)


def is_refused_handle(spec: str) -> bool:
    return spec.startswith(REFUSED)


def refusal(spec: str, what: str) -> str:
    """The one line for a Kaggle preset handle: where its files can come from instead."""
    return (f"{what}: {spec} is a keras-hub preset handle on Kaggle, which tfdp does not fetch from: give the "
            f"preset's copy on the Hugging Face Hub (hf://ORG/NAME), or download it to a folder first (on a machine "
            f"with network: keras_hub.models.ImageClassifier.from_preset('{spec}').save_to_preset(DIR)) and give that "
            f"folder")


def pinned(handle: str, local: str) -> str:
    """`handle` at the commit of its local copy (`…/snapshots/COMMIT`, or a file in it): what the run records."""
    prefix = next(p for p in HANDLES if handle.startswith(p))
    repo, _ = parse(handle, "model.init_from")
    return f"{prefix}{repo}@{os.path.basename(local if os.path.isdir(local) else os.path.dirname(local))}"


def parse(handle: str, what: str) -> tuple[str, str]:
    """(repository id, revision) of `hf-hub:ORG/NAME[@REV]` or `hf://ORG/NAME[@REV]`; the revision defaults to main."""
    rest = handle[len(next(p for p in HANDLES if handle.startswith(p))):].strip("/")
    repo, at, revision = rest.partition("@")
    if not REPO_ID.match(repo) or (at and not revision):
        raise UserError(f"{what}: {handle} does not name a Hugging Face Hub repository (hf-hub:ORG/NAME or "
                        f"hf://ORG/NAME, optionally @REVISION)")
    return repo, revision or "main"


def local_copy(handle: str, what: str = "model.init_from") -> str:
    """The local path that stands for `handle` once what tfdp reads of it is in the Hub's cache: a keras-hub preset's
    snapshot folder, or a timm repository's model.safetensors."""
    repo, revision = parse(handle, what)
    from huggingface_hub.utils import disable_progress_bars, logging as hub_logging
    disable_progress_bars()   # tfdp's own lines say what is fetched; bars would fill a cluster's logs
    hub_logging.set_verbosity_error()   # and its retries' warnings (twice each, through absl too): the line says why
    try:
        config, commit = _config(repo, revision)
        if config is not None and _is_keras_hub(config):
            _fetch(repo, PRESET_WEIGHTS, commit, handle, what, "the keras-hub preset's weights")
            for name in PRESET_OPTIONAL:
                _fetch(repo, name, commit, handle, what)
            return os.path.dirname(config)
        return _fetch(repo, SAFETENSORS, commit, handle, what, "the timm weights tfdp reads (or a keras-hub preset, "
                                                                "whose config.json names a keras_hub class)")
    except UserError:
        raise
    except Exception as e:   # huggingface_hub's errors, each named in one line
        raise UserError(f"{what}: {handle}: {_why(e, repo, revision)}") from None


def _config(repo: str, revision: str) -> tuple[str | None, str]:
    """The repository's config.json at `revision` (None where it has none) and the commit `revision` stands for."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError
    try:
        path = hf_hub_download(repo, CONFIG, revision=revision)
        return path, os.path.basename(os.path.dirname(path))   # …/snapshots/COMMIT/config.json
    except RemoteEntryNotFoundError as e:
        return None, e.response.headers.get("X-Repo-Commit") or revision
    except LocalEntryNotFoundError:
        if _known_absent(try_to_load_from_cache(repo, CONFIG, revision=revision)):
            return None, revision
        raise


def _known_absent(cached) -> bool:
    """try_to_load_from_cache's answer for a file the cache knows the commit lacks (neither a path nor None)."""
    return cached is not None and not isinstance(cached, str)


def _fetch(repo: str, name: str, commit: str, handle: str, what: str, needed_as: str | None = None) -> str | None:
    """`name` at `commit`, from the cache or the Hub; None for a file the repository lacks, unless it is needed (as
    what `needed_as` says), which stops the run in one line."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import RemoteEntryNotFoundError
    if not _known_absent(try_to_load_from_cache(repo, name, revision=commit)):
        try:
            return hf_hub_download(repo, name, revision=commit)
        except RemoteEntryNotFoundError:
            pass
    if needed_as is None:
        return None
    raise UserError(f"{what}: {handle} has no {name} (at commit {commit[:12]}): {needed_as}")


def _is_keras_hub(config_path: str) -> bool:
    try:
        with open(config_path, encoding="utf-8") as f:
            return str(json.load(f).get("module", "")).startswith("keras_hub")
    except (OSError, ValueError, AttributeError):
        return False


def _why(error: Exception, repo: str, revision: str) -> str:
    """huggingface_hub's error as the part of the line after the handle."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    if isinstance(error, GatedRepoError):
        return "the repository is gated: accept its terms on the Hub with your account, and give that account's " \
               "token in HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return (f"no repository {repo} on the Hub ({constants.ENDPOINT}), or a private one this token cannot read "
                f"(HF_TOKEN {'is set' if os.environ.get('HF_TOKEN') else 'is not set'})")
    if isinstance(error, RevisionNotFoundError):
        return f"the repository has no revision {revision}"
    if isinstance(error, LocalEntryNotFoundError):
        if constants.is_offline_mode():
            return f"HF_HUB_OFFLINE is set and the cache ({constants.HF_HUB_CACHE}) has no copy of it"
        return (f"the Hub ({constants.ENDPOINT}) cannot be reached and the cache ({constants.HF_HUB_CACHE}) has no "
                f"copy of it: fetch it once where there is network and copy the cache (HF_HOME) here, or set "
                f"HF_ENDPOINT to a mirror")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        return f"the Hub ({constants.ENDPOINT}) answered HTTP {error.response.status_code}"
    if isinstance(error, OSError):
        return (f"cannot write the Hugging Face cache ({constants.HF_HUB_CACHE}): {first_line(error)}; set HF_HOME "
                f"to a writable folder")
    return f"{type(error).__name__}: {first_line(error)}"
