"""The module structure: no tfdp module imports a private name of another, and the modules that must load
without TensorFlow do.

A leading underscore says "only this module uses it"; a second module that reaches for it couples the two
behind the reader's back (say, a service module importing the pipeline's helpers).
What two modules share is made public in one of them. Keras's and TensorFlow's private names are another
matter: tfdp/keras_patches/__init__.py lists those in RELIED_ON, with a canary each (tests/keras_patches/test_compat.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = "tfdp"

# (module file, "module.private_name") pairs tolerated for now. Empty: every module keeps to the rule; a
# refactor that cannot yet should list its uses here, one line each with the reason, for the lead to empty.
ALLOWED: set[tuple[str, str]] = set()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of a `from X import ...`, relative imports included."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(path: Path, root: Path) -> list[str]:
    """Every private name of another tfdp module that `path` imports (`from tfdp.x import _y`) or reads
    through an imported tfdp module (`x._y`), as "line: module._name"."""
    importer = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found, modules = [], {}  # modules: local name -> the tfdp module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = resolve(node, importer, path.name == "__init__.py")
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                if is_private(alias.name) and source != importer:
                    found.append(f"{node.lineno}: {source}.{alias.name}")
                if is_module(f"{source}.{alias.name}", root):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    if alias.asname:  # import tfdp.x.y as z: z is tfdp.x.y
                        modules[alias.asname] = alias.name
                    else:  # import tfdp.x.y: binds tfdp
                        modules[PACKAGE] = PACKAGE
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            dotted = ast.unparse(node.value)
            head, _, rest = dotted.partition(".")
            if head in modules:
                target = modules[head] + (f".{rest}" if rest else "")
                if is_module(target, root) and target != importer:
                    found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def violations(root: Path) -> list[str]:
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for hit in private_imports(path, root):
            if (rel, hit.split(": ", 1)[1]) not in ALLOWED:
                out.append(f"{rel}:{hit}")
    return out


def test_no_tfdp_module_imports_a_private_name_of_another():
    found = violations(Path(REPO))
    assert not found, ("modules importing another tfdp module's private names (make the name public in its "
                       "module, or move it):\n" + "\n".join(found))


def test_the_check_catches_each_way_of_reaching_a_private_name(tmp_path):
    """The checker on a small package written here: each form of reaching into another module is reported,
    a module's use of its own private names and a dunder are not."""
    pkg = tmp_path / PACKAGE
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("from .pipeline import _relative\n")
    (pkg / "data" / "pipeline.py").write_text("def _helper(): pass\n_relative = 1\nx = _helper()\n")
    (pkg / "user.py").write_text(
        "import tfdp.data.pipeline\n"
        "from tfdp.data import pipeline\n"
        "from tfdp.data import pipeline as p\n"
        "from tfdp.data.pipeline import _helper, __doc__\n"
        "pipeline._helper(); p._relative; tfdp.data.pipeline._helper(); pipeline.__name__\n")
    found = violations(tmp_path)
    assert sorted(found) == sorted([
        "tfdp/data/__init__.py:1: tfdp.data.pipeline._relative",
        "tfdp/user.py:4: tfdp.data.pipeline._helper",
        "tfdp/user.py:5: tfdp.data.pipeline._helper",
        "tfdp/user.py:5: tfdp.data.pipeline._relative",
        "tfdp/user.py:5: tfdp.data.pipeline._helper",
    ])


# tfdp's packages and top-level modules from the bottom up, the order data flows in: each imports only units
# before it (and the package root, which sets TensorFlow's environment). The folder list is the architecture.
LAYERS = ("errors", "config", "startup", "augment", "data", "rundir", "models", "optim", "keras_patches",
          "distribute", "train", "commands", "cli")
ROOT_FILES = {"__init__", "__main__"}
# (importing file, unit imported) -> why this one import goes upward. Keep it short; empty is the aim.
UPWARD: dict[tuple[str, str], str] = {}


def unit_imports(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, its unit, the unit it imports) for every import of another tfdp unit, function-level ones
    included; a unit is a package under tfdp/ or a top-level module."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root / PACKAGE).with_suffix("").parts
        own = rel[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
                names = ([f"{node.module}.{a.name}" for a in node.names] if node.module == PACKAGE else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
            else:
                continue
            for name in names:
                parts = name.split(".")
                target = parts[1] if len(parts) > 1 else PACKAGE
                if target != own and own not in ROOT_FILES:
                    found.append((path.relative_to(root).as_posix(), node.lineno, own, target))
    return found


def test_the_folders_are_the_layers():
    """Every package and top-level module of tfdp/ is a layer, so a new one has to be given its place."""
    units = {p.stem if p.is_file() else p.name for p in (Path(REPO) / PACKAGE).iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert units == set(LAYERS) | ROOT_FILES


def test_data_flows_one_way_between_the_layers():
    upward = [f"{file}:{line}: {own} imports {target}" for file, line, own, target in unit_imports(Path(REPO))
              if target != PACKAGE and LAYERS.index(target) > LAYERS.index(own) and (file, target) not in UPWARD]
    assert not upward, "imports against the flow (move the shared code down, or the caller up):\n" + "\n".join(upward)
    still = {(file, target) for file, _, own, target in unit_imports(Path(REPO))
             if target != PACKAGE and LAYERS.index(target) > LAYERS.index(own)}
    assert set(UPWARD) <= still, f"listed in UPWARD but gone (take them off): {set(UPWARD) - still}"


# The data package's stages in the order an input flows through them (docs/architecture.md, how an input flows):
# each module imports only stages before it, so a dataset and the callbacks riding on it only ever go forward. A
# stage that needs what a later one knows is handed it as a plain value by the entry points that compose them.
DATA_STAGES = (
    "imagenet_classes",  # a table: ImageNet's class names
    "storage",           # the bytes of one object: buckets, local copies, retries
    "layouts",           # list the source: Source, Split
    "readers",           # where each record is, per format (payloads)
    "order",             # each pipeline's share, each data epoch's order
    "streaming",         # a share's files through the bounded cache
    "memory_cache",      # data.cache: whether a share fits in memory (asked before training)
    "preprocess",        # the per-image transforms: crops, DALI's check
    "decoding",          # payloads → (index, image, label), decoded and cropped
    "corrupt",           # the corrupt-image log (loaded before TensorFlow)
    "naming",            # corrupt images named: the files at a stream's gaps
    "batching",          # per-replica batches with what each accounts for, dealt to the replicas
    "counting",          # the running totals: corrupt images bounded, labels checked, stream positions
    "pipeline",          # the entry points composing the stages
    "dali",              # DALI decoding each replica's checked batches on its device
    "service",           # the tf.data service: the client and the server processes
)


def data_stage_imports(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, its stage, the stage it imports) for every import between two stages of tfdp/data/,
    function-level ones included; a stage is a module of tfdp/data/ or a folder of them."""
    found = []
    data = root / PACKAGE / "data"
    for path in sorted(data.rglob("*.py")):
        rel = path.relative_to(data).with_suffix("").parts
        if rel == ("__init__",):
            continue   # the package root: build_source, the layouts' registry
        own = rel[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = ([f"{node.module}.{a.name}" for a in node.names] if node.module == f"{PACKAGE}.data"
                         else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == [PACKAGE, "data"] and len(parts) > 2 and parts[2] != own:
                    found.append((path.relative_to(root).as_posix(), node.lineno, own, parts[2]))
    return found


def backward_stage_imports(root: Path) -> list[str]:
    return [f"{file}:{line}: {own} imports {target}" for file, line, own, target in data_stage_imports(root)
            if DATA_STAGES.index(target) > DATA_STAGES.index(own)]


def test_every_data_module_is_a_stage():
    """A new module of tfdp/data/ has to be given its place in the flow."""
    data = Path(REPO) / PACKAGE / "data"
    units = {p.stem if p.is_file() else p.name for p in data.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())} - {"__init__"}
    assert units == set(DATA_STAGES)


def test_an_input_flows_one_way_through_the_data_stages():
    backward = backward_stage_imports(Path(REPO))
    assert not backward, ("data stages importing a later stage (hand the earlier one a plain value instead, or "
                          "move the code to the stage it belongs to):\n" + "\n".join(backward))


def test_the_stage_check_catches_a_backward_import(tmp_path):
    """On a small package written here: a stage importing a later one, at module or function level and in
    either import form, is caught; importing an earlier one is not."""
    data = tmp_path / PACKAGE / "data"
    (data / "layouts").mkdir(parents=True)
    (data / "layouts" / "__init__.py").write_text("from tfdp.data import readers, storage\n")
    (data / "readers.py").write_text("from tfdp.data.storage import localize\n")
    (data / "storage.py").write_text("def f():\n    import tfdp.data.pipeline\n")
    assert backward_stage_imports(tmp_path) == ["tfdp/data/layouts/__init__.py:1: layouts imports readers",
                                                "tfdp/data/storage.py:2: storage imports pipeline"]


def test_the_test_folders_mirror_the_packages():
    """A folder of tests per package of tfdp/ (and none for a package that does not exist); what spans the
    packages stays at the top, and the fault tests keep their own folder."""
    tests = Path(REPO) / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    packages = {u for u in LAYERS if (Path(REPO) / PACKAGE / u).is_dir()}
    assert folders == packages | {"faults"}


def test_no_two_test_files_share_a_name():
    """The test folders are not packages: pytest imports each file by its basename, so a second file of the
    same name anywhere under tests/ stops the whole run at collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in (Path(REPO) / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_module_map_in_the_architecture_page_matches_the_folders():
    """docs/architecture.md's module map names every layer's folder or file, and only those that exist."""
    text = (Path(REPO) / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    named = {line.split()[0] for line in block.splitlines() if line.startswith("tfdp/")}
    expected = {f"tfdp/{u}/" if (Path(REPO) / PACKAGE / u).is_dir() else f"tfdp/{u}.py" for u in LAYERS}
    assert named == expected


def test_config_and_the_rand_augment_parser_load_without_tensorflow():
    """The config is loaded and validated (RandAugment's grammar, the weights' preprocessing included) without
    TensorFlow; the augment package loads its TensorFlow modules only when one of their names is used; the
    corrupt-image log, which commands load before TensorFlow's start-up is quieted, needs none."""
    code = ("import sys, tfdp.config, tfdp.config.rand_augment, tfdp.rundir.metrics_file, tfdp.data.corrupt\n"
            "tfdp.config.load_config(None, {'augment.rand_augment': 'rand-m9-n2'})\n"
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
            "from tfdp.augment import build_batch_augment\n"
            "print('tensorflow' in sys.modules, build_batch_augment.__module__)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["[]", "True tfdp.augment.batch"]


def runtime_imports(path: Path, root: Path) -> set[str]:
    """The tfdp modules `path` imports when it runs, function-level imports included; an import under
    `if TYPE_CHECKING:` is for the type checker only, and a name imported from a package counts as that
    package's submodule where one has the name."""
    importer = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = resolve(node, importer, path.name == "__init__.py")
            if base.split(".")[0] == PACKAGE:
                found |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
    return found - {importer}


def import_circles(root: Path) -> list[list[str]]:
    """Groups of tfdp modules that import each other, directly or round a loop (strongly connected components
    of the import graph with more than one module)."""
    graph = {module_name(p, root): runtime_imports(p, root) for p in sorted((root / PACKAGE).rglob("*.py"))}
    order, low, stack, circles = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module] & graph.keys()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                circles.append(sorted(group))
    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_modules_import_each_other():
    """A circle of imports (a function-level import of a module that imports the caller's) ties modules that
    cannot then be read, tested or moved apart; what they share belongs in a module below both."""
    circles = import_circles(Path(REPO))
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_finds_a_function_level_circle(tmp_path):
    """On a small package written here: a lazy import back is a circle; a TYPE_CHECKING-only one is not."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tfdp import b\n")
    (pkg / "b.py").write_text("def f():\n    from tfdp.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tfdp.a import x\n")
    (pkg / "d.py").write_text("import tfdp.c\n")
    assert import_circles(tmp_path) == [["tfdp.a", "tfdp.b"]]


MAX_PARAMETERS = 8   # the house's rule: a function that needs more takes an object that carries them


def long_signatures(root: Path) -> list[str]:
    """Every function and method of the package with more than MAX_PARAMETERS parameters (`self` and `cls`
    aside; `*args` and `**kwargs` count one each), as "file:line name(count)"."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        tree, here = ast.parse(path.read_text(encoding="utf-8")), []
        methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args)]
            if id(node) in methods and names and names[0] in ("self", "cls"):
                names = names[1:]
            count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
            if count > MAX_PARAMETERS:
                here.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {node.name}({count})"))
        found += [line for _, line in sorted(here)]
    return found


def test_no_function_takes_more_than_eight_parameters():
    """Past eight, a call site cannot be read without the signature beside it, and the parameters travel together
    anyway: the Task, Run and config objects (or a small dataclass) carry them."""
    found = long_signatures(Path(REPO))
    assert not found, f"functions over {MAX_PARAMETERS} parameters:\n" + "\n".join(found)


def test_the_parameter_check_counts_as_a_reader_would(tmp_path):
    """On a small package written here: nine parameters are caught, in a function, a nested one or a method
    (keyword-only and *args counted); eight, and a method's self beside eight, are not."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "def ok(a, b, c, d, e, f, g, h):\n    def inner(a, b, c, d, e, f, g, h, *i):\n        pass\n"
        "def long(a, b, c, d, e, f, g, h, *, i=1):\n    pass\n"
        "class K:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"
        "    def n(self, a, b, c, d, e, f, g, h, **i):\n        pass\n")
    assert long_signatures(tmp_path) == ["tfdp/a.py:2 inner(9)", "tfdp/a.py:4 long(9)", "tfdp/a.py:9 n(9)"]
