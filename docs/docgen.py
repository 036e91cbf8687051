"""The reference pages of the documentation, generated from the code: `python docs/docgen.py`.

`docs/reference/config.md` comes from the dataclasses in `tfdp/config/__init__.py`
(each field's type, default, and the comment above it or beside it) and
`docs/reference/cli.md` from the absl flags' help texts, so a new field or
flag is documented where it is written and the pages cannot drift from the
code. The tables of docs/pretrained-weights.md that say which models read which
weights come from the weights' registries (`tfdp.models.weights`): the block
between its `GENERATED` markers. `tests/test_docs.py` fails when a field has no comment, a flag no help,
or a committed page differs from what this module generates.

`python docs/docgen.py --check` writes nothing and exits 1 when a page is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import pathlib
import sys
import tokenize

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG_PAGE = REPO / "docs" / "reference" / "config.md"
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
WEIGHTS_PAGE = REPO / "docs" / "pretrained-weights.md"
# The generated block of WEIGHTS_PAGE lies between these lines; the rest of the page is written by hand.
GENERATED = ("<!-- generated from the weights' registries by `python docs/docgen.py`: begin -->",
             "<!-- generated: end -->")
REGENERATE = "python docs/docgen.py"

# How config.py's type aliases read in the reference.
ALIASES = {"PosInt": "int > 0", "NonNegInt": "int ≥ 0", "PosFloat": "float > 0", "NonNegFloat": "float ≥ 0",
           "Fraction": "float in [0, 1]", "Bool": "bool", "Str": "str"}
BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


class UndocumentedError(Exception):
    """A config field without a comment, or a flag without help."""


# --- config fields -----------------------------------------------------------

def _comments_by_line(source: str) -> dict[int, str]:
    """Line number → the text of the comment on that line (without '#')."""
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return comments


def _field_comment(node: ast.AnnAssign, lines: list[str], comments: dict[int, str]) -> str:
    """The comment block right above the field, then the one beside it (and its '...' continuation lines)."""
    above = []
    n = node.lineno - 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
        above.insert(0, comments[n])
        n -= 1
    beside = [comments[node.end_lineno]] if node.end_lineno in comments else []
    return " ".join(part for part in above + beside if part)


def _render_type(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return ALIASES.get(node.id, node.id)
    if isinstance(node, ast.Constant):
        return "null" if node.value is None else repr(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{_render_type(node.left)} or {_render_type(node.right)}"
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        kind = node.value.id
        if kind == "Literal":
            return " or ".join(f"`{a.value}`" if isinstance(a, ast.Constant) else ast.unparse(a) for a in args)
        if kind == "Annotated":
            bounds = [f"{BOUNDS[k.arg]} {ast.unparse(k.value)}" for a in args[1:] if isinstance(a, ast.Call)
                      for k in a.keywords if k.arg in BOUNDS]
            return _render_type(args[0]) + (f" ({', '.join(bounds)})" if bounds else "")
        if kind in ("list", "tuple"):
            return f"{kind} of {_render_type(args[0])}"
    return ast.unparse(node)


def _render_default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "`null`"
    return f"`{value!r}`"


def _class_nodes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def config_sections() -> list[tuple[str, type, list[tuple[dataclasses.Field, ast.AnnAssign]]]]:
    """(section name, dataclass, its leaf fields with their AST nodes), top level first."""
    from tfdp import config
    source = pathlib.Path(config.__file__).read_text()
    nodes = _class_nodes(source)
    out = []

    def walk(prefix: str, cls: type) -> None:
        assigns = {n.target.id: n for n in nodes[cls.__name__].body if isinstance(n, ast.AnnAssign)}
        leaves, nested = [], []
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
                nested.append((f.name, factory))
            else:
                leaves.append((f, assigns[f.name]))
        out.append((prefix, cls, leaves))
        for name, sub in nested:
            walk(f"{prefix}.{name}" if prefix else name, sub)

    walk("", config.Config)
    return out


def config_page() -> str:
    from tfdp import config
    source = pathlib.Path(config.__file__).read_text()
    lines, comments = source.splitlines(), _comments_by_line(source)
    missing = []
    parts = ["# Config reference", "",
             f"<!-- Generated from tfdp/config/__init__.py by `{REGENERATE}`; do not edit by hand. -->", "",
             "Every field of a config file, its type, its default, and what it does. A YAML config sets",
             "any of them; `--set=section.key=value` overrides one from the command line (see",
             "[Configs](../configs.md) for a tour and [CLI reference](cli.md) for the flags).", ""]
    for prefix, cls, leaves in config_sections():
        if not leaves:
            continue
        title = f"`{prefix}`" if prefix else "Top level"
        parts += [f"## {title}", ""]
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        if doc and not doc.startswith(cls.__name__ + "("):
            parts += [doc, ""]
        parts += ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
        for f, node in leaves:
            key = f"{prefix}.{f.name}" if prefix else f.name
            text = _field_comment(node, lines, comments)
            if not text:
                missing.append(key)
            cells = [f"`{key}`", _render_type(node.annotation), _render_default(f), text]
            parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append("")
    if missing:
        raise UndocumentedError(
            f"config field(s) without a comment in tfdp/config/__init__.py: {', '.join(missing)}; write a comment above "
            f"each (what it does), then run `{REGENERATE}`")
    return "\n".join(parts).rstrip() + "\n"


# --- command-line flags --------------------------------------------------------

def _flag_modules() -> list[str]:
    """tfdp's modules that define absl flags: the CLI's and any other that calls flags.DEFINE*."""
    package = REPO / "tfdp"
    found = []
    for path in sorted(package.rglob("*.py")):
        if "flags.DEFINE" in path.read_text():
            found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def tfdp_flags() -> list:
    """Every absl flag a tfdp module defines, in definition order (absl's own flags left out)."""
    import importlib

    from absl import flags
    modules = _flag_modules()
    for name in modules:
        importlib.import_module(name)
    by_module = flags.FLAGS.flags_by_module_dict()
    seen, out = set(), []
    for name in modules:
        for flag in by_module.get(name, []):
            if flag.name not in seen:
                seen.add(flag.name)
                out.append(flag)
    return out


def cli_page() -> str:
    from tfdp import cli
    missing = []
    parts = ["# CLI reference", "",
             f"<!-- Generated from the absl flags of tfdp's modules by `{REGENERATE}`; do not edit by hand. -->",
             "", "```", cli.USAGE.strip(), "```", "",
             "Flags override the config; a flag that names a command (`launch:`, `benchmark:`, ...) is read by",
             "that command only. `tfdp --helpfull` prints the same list. absl's own flags (`--flagfile`,",
             "`--verbosity`, ...) work as in any absl program.", "",
             "| flag | type | default | what it does |", "| --- | --- | --- | --- |"]
    for flag in tfdp_flags():
        help_text = " ".join((flag.help or "").split())
        if not help_text:
            missing.append(f"--{flag.name}")
        default = flag.default_as_str if flag.default not in (None, []) else "(none)"
        cells = [f"`--{flag.name}`", flag.flag_type(), default.replace("'", "`") if default != "(none)" else default,
                 help_text]
        parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if missing:
        raise UndocumentedError(f"flag(s) without help text: {', '.join(missing)}; give each a help string, "
                                f"then run `{REGENERATE}`")
    return "\n".join(parts).rstrip() + "\n"


# --- which models read which weights ----------------------------------------------

def _models(names) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names))


def weights_tables() -> str:
    """The tables of model.init_from's sources by model, from the registries the model files fill: Keras' ImageNet
    files (`keras_imagenet.imagenet_files`), the state-dict readers (`weights.TORCH_LAYOUTS`) and the keras-hub
    readers (`weights.KERAS_HUB_LAYOUTS`)."""
    import tfdp.models  # noqa: F401  (the model files fill the registries)
    from tfdp.models import keras_imagenet, weights
    files = keras_imagenet.imagenet_files()
    parts = ["### `imagenet`: the models with Keras' own ImageNet files", "",
             "| model | Keras' file (at 224 px) |", "| --- | --- |"]
    parts += [f"| `{name}` | `{files[name](224)[0]}` |" for name in sorted(files)]
    readers: dict[tuple[str, str], list[str]] = {}
    for name, read in weights.TORCH_LAYOUTS.items():
        readers.setdefault((read.__module__, read.__qualname__.split(".")[0]), []).append(name)
    parts += ["", "### `.safetensors`: the models that read a PyTorch state dict, by reader", "",
              "| family file | reader | models |", "| --- | --- | --- |"]
    for (module, reader), names in sorted(readers.items()):
        parts.append(f"| `{module.replace('.', '/')}.py` | `{reader}` | {_models(names)} |")
    parts += ["", "### keras-hub presets: the backbone classes read", "",
              "| `config.json` class | family file | reader |", "| --- | --- | --- |"]
    for kind, read in sorted(weights.KERAS_HUB_LAYOUTS.items()):
        parts.append(f"| `{kind}` | `{read.__module__.replace('.', '/')}.py` | `{read.__qualname__}` |")
    return "\n".join(parts) + "\n"


def weights_page() -> str:
    """docs/pretrained-weights.md as committed, its generated block made anew."""
    text = WEIGHTS_PAGE.read_text()
    begin, end = GENERATED
    if text.count(begin) != 1 or text.count(end) != 1:
        raise UndocumentedError(f"{WEIGHTS_PAGE.relative_to(REPO)} must hold the lines {begin} and {end} once each")
    head, rest = text.split(begin + "\n", 1)
    tail = rest.split(end, 1)[1]
    return f"{head}{begin}\n{weights_tables()}{end}{tail}"


# --- entry point ----------------------------------------------------------------

def pages() -> dict[pathlib.Path, str]:
    return {CONFIG_PAGE: config_page(), CLI_PAGE: cli_page(), WEIGHTS_PAGE: weights_page()}


def stale_pages() -> list[pathlib.Path]:
    """The committed reference pages that differ from what the code generates."""
    return [path for path, text in pages().items() if not path.exists() or path.read_text() != text]


def main(argv: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        generated = pages()
    except UndocumentedError as e:
        sys.stderr.write(f"docs/docgen.py: error: {e}\n")
        return 2
    if "--check" in argv:
        stale = [str(p.relative_to(REPO)) for p, text in generated.items() if not p.exists() or p.read_text() != text]
        if stale:
            sys.stderr.write(f"docs/docgen.py: stale: {', '.join(stale)}; run `{REGENERATE}`\n")
            return 1
        return 0
    for path, text in generated.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
