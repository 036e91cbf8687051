"""The documentation: the site builds with no broken link or anchor, every config field and flag is documented,
the generated reference pages match the code, and the README stays a short front door."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "docs"))   # docs/docgen.py, the maintainers' generator
import docgen  # noqa: E402

REGENERATE = f"run `{docgen.REGENERATE}` and commit docs/reference/"


def test_site_builds_strict_with_no_broken_link_or_anchor(tmp_path):
    """mkdocs.yml turns unknown links, missing anchors, absolute links and pages left out of the nav into
    warnings, and --strict makes any warning fail the build."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0, "\n".join(problems) or result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_strict_build_fails_on_a_broken_anchor(tmp_path):
    """The check above can fail: a copy of the docs with one link to a missing anchor does not build."""
    import shutil
    shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs")
    shutil.copy(os.path.join(REPO, "mkdocs.yml"), tmp_path / "mkdocs.yml")
    shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs")  # pages include files from it
    with open(tmp_path / "docs" / "faults.md", "a") as f:
        f.write("\nSee [the demo](benchmarks.md#no-such-section).\n")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode != 0
    assert "no-such-section" in result.stderr


def test_every_config_field_has_a_comment():
    """The generator raises, naming the fields and the command, when a field has no comment above or beside it."""
    try:
        docgen.config_page()
    except docgen.UndocumentedError as e:
        pytest.fail(str(e))


def fresh(code: str) -> str:
    """Runs `code` in a new Python process and returns what it prints. The flags are read there: absl keeps
    one flag registry per process, and a test process may already hold flags of the same name from another
    program (pipelines/convert_imagenet.py's --workers beside tfdp's)."""
    result = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, 'docs')\nimport docgen\n{code}"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    if result.returncode:
        pytest.fail(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output")
    return result.stdout


def test_every_flag_has_help():
    fresh("docgen.cli_page()")  # raises UndocumentedError, naming the flags, when one has no help


def test_every_config_field_and_flag_is_in_the_committed_reference():
    """Each leaf field of tfdp/config/__init__.py and each flag of tfdp's modules has a row in the committed pages."""
    config_md = open(docgen.CONFIG_PAGE).read()
    cli_md = open(docgen.CLI_PAGE).read()
    fields = [f"{prefix}.{f.name}" if prefix else f.name
              for prefix, _, leaves in docgen.config_sections() for f, _ in leaves]
    assert len(fields) > 80
    missing = [k for k in fields if f"| `{k}` |" not in config_md]
    assert not missing, f"config fields missing from docs/reference/config.md: {missing}; {REGENERATE}"
    flags = fresh("print(' '.join(flag.name for flag in docgen.tfdp_flags()))").split()
    assert {"config", "set", "model_dir", "data_service"} <= set(flags)
    missing = [n for n in flags if f"| `--{n}` |" not in cli_md]
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}; {REGENERATE}"


def test_the_committed_reference_pages_are_what_the_code_generates():
    stale = fresh("import os\nprint(' '.join(os.path.relpath(p, docgen.REPO) for p in docgen.stale_pages()))").split()
    assert not stale, f"{', '.join(stale)} out of date with the code: {REGENERATE}"


def test_a_field_without_a_comment_is_caught():
    """The comment finder returns nothing for a bare field, so the generator's check can fail."""
    source = ("@dataclasses.dataclass\nclass C:\n    # what a does\n    a: int = 1\n"
              "    b: int = 2   # what b does\n\n    c: int = 3\n")
    lines, comments = source.splitlines(), docgen._comments_by_line(source)
    body = {n.target.id: n for n in ast.parse(source).body[0].body}
    found = {name: docgen._field_comment(node, lines, comments) for name, node in body.items()}
    assert found == {"a": "what a does", "b": "what b does", "c": ""}


def test_types_and_defaults_read_as_a_user_writes_them():
    assert docgen._render_type(ast.parse('Literal["a", "b"]', mode="eval").body) == "`a` or `b`"
    assert docgen._render_type(ast.parse("Annotated[float, Strict(), Field(ge=0, lt=1)] | None",
                                         mode="eval").body) == "float (≥ 0, < 1) or null"
    field = dataclasses.field(default_factory=lambda: (1, 2))
    assert docgen._render_default(field) == "`(1, 2)`"


def test_readme_is_a_short_front_door_with_the_ci_command():
    """At most 250 lines, and the test command is exactly the one .ci/run runs (CI relies on it)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert len(readme.splitlines()) <= 250
    ci = [line for line in open(os.path.join(REPO, ".ci", "run")).read().splitlines() if line.startswith("python3")]
    assert ci and all(line in readme.splitlines() for line in ci), ci


def test_readme_config_example_is_the_demo_config_as_it_is():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert open(os.path.join(REPO, "configs", "digits.yaml")).read() in readme, \
        "README.md's config example differs from configs/digits.yaml: copy the file into it"


@pytest.mark.full(reason="a 2-epoch fine-tuning run, two predictions and an ONNX export as separate processes: "
                         "about 2 minutes on 2 cores")
def test_the_fine_tune_page_runs_as_written(tmp_path):
    """docs/fine-tune-your-images.md's commands, as written, in one shell, with the timm-made fixture file (a
    ViT with its pretrained cfg and label_names) for the page's two names: predict from the weights, fine-tune 2
    epochs on a class-folder tree of real photos, predict from the run, export ONNX checked against Keras."""
    import json
    import re

    import numpy as np
    from support.photos import photo_jpeg, real_photos

    photos, rng = real_photos(), np.random.default_rng(0)
    classes = {"astronaut": 2, "coffee": 3, "cat": 4}   # scikit-image's astronaut, coffee, chelsea
    for split, count in (("train", 12), ("val", 4)):
        for name, k in classes.items():
            os.makedirs(tmp_path / "my-photos" / split / name)
            for i in range(count):
                (tmp_path / "my-photos" / split / name / f"{i:02d}.jpg").write_bytes(
                    photo_jpeg(photos[k], rng, size=(160, 120), quality=90))
    fixture = os.path.join(REPO, "tests", "fixtures", "predict_timm")
    page = open(os.path.join(REPO, "docs", "fine-tune-your-images.md"), encoding="utf-8").read()
    script = "\n".join(re.findall(r"```bash\n(.*?)```", page, re.S))
    assert script.count("\nWEIGHTS=") == 1 and script.startswith("MODEL=")
    script = re.sub(r"^MODEL=.*$", "MODEL=vit_mini_patch4_small", script, flags=re.M)
    script = re.sub(r"^WEIGHTS=.*$", f"WEIGHTS={fixture}/model.safetensors", script, flags=re.M)
    shell = f'set -euo pipefail\ntfdp() {{ "{sys.executable}" -m tfdp "$@"; }}\n{script}'
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    labels = json.load(open(os.path.join(fixture, "config.json"), encoding="utf-8"))["label_names"]
    before = [json.loads(line) for line in open(tmp_path / "before.jsonl", encoding="utf-8")]
    after = [json.loads(line) for line in open(tmp_path / "after.jsonl", encoding="utf-8")]
    assert len(before) == len(after) == 12
    assert all(p["name"] in labels for row in before for p in row["predictions"])
    assert all({p["name"] for p in row["predictions"]} == set(classes) for row in after)
    assert "tfdp: assumed: image size 32 px, from model.safetensors (its timm pretrained cfg)" in result.stdout
    assert re.search(r"tfdp: export: onnx: .*model\.onnx: top-1 agrees with the Keras model on 12/12 validation "
                     r"images \(100\.00%\)", result.stdout), result.stdout[-3000:]
    assert json.load(open(tmp_path / "my-export" / "classes.json", encoding="utf-8")) == sorted(classes)
