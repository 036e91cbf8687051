"""YAML as tfdp reads it: PyYAML's safe loader, with numbers written as everyone writes them.

PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent: `1e-3`, `5e-5`, `1E-12` and `+1e3` are
strings there, and a learning rate written as every recipe and paper writes it was refused as "not a number".
`Loader` adds YAML 1.2's exponent forms (the core schema's `[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?`,
of which YAML 1.1 already reads the forms with a dot and no exponent): every place tfdp reads YAML uses it.

`ConfigLoader` (config files and `--set` values) also keeps each number's text as written, so that a string field
given a bare number takes it as typed: `model_dir: 1e3` is the folder `1e3`, not `1000.0`, and `model_dir: 2024`
the folder `2024` (`scalar_text`, which `tfdp.config.Str` runs first).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

FLOAT_TAG = "tag:yaml.org,2002:float"
INT_TAG = "tag:yaml.org,2002:int"
# YAML 1.2 core schema's floats that YAML 1.1 leaves strings: those with an exponent (1e-3, 1.0e3, .5E2, +1e3).
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


class Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads YAML 1.2's exponent floats (`1e-3`) as floats."""


Loader.add_implicit_resolver(FLOAT_TAG, EXPONENT_FLOAT, list("-+.0123456789"))


class WrittenFloat(float):
    """A float that remembers the text it was written as (a string field takes that text)."""
    text: str


class WrittenInt(int):
    """An int that remembers the text it was written as (a string field takes that text)."""
    text: str


class ConfigLoader(Loader):
    """`Loader` whose numbers keep their text, for what goes straight into the config's validation (pydantic
    turns them into plain floats and ints: no `WrittenFloat` outlives it)."""

    def construct_written_float(self, node: yaml.ScalarNode) -> WrittenFloat:
        number = WrittenFloat(self.construct_yaml_float(node))
        number.text = node.value
        return number

    def construct_written_int(self, node: yaml.ScalarNode) -> WrittenInt:
        number = WrittenInt(self.construct_yaml_int(node))
        number.text = node.value
        return number


ConfigLoader.add_constructor(FLOAT_TAG, ConfigLoader.construct_written_float)
ConfigLoader.add_constructor(INT_TAG, ConfigLoader.construct_written_int)


def load(stream: Any) -> Any:
    """`yaml.safe_load` with YAML 1.2's floats."""
    return yaml.load(stream, Loader=Loader)  # noqa: S506  (Loader is a SafeLoader)


def load_config_text(stream: Any) -> Any:
    """A config file or a `--set` value: YAML 1.2's floats, each number keeping its text for string fields."""
    return yaml.load(stream, Loader=ConfigLoader)  # noqa: S506  (ConfigLoader is a SafeLoader)


def scalar_text(value: Any) -> Any:
    """A number as it was written where a string field receives it (`model_dir: 1e3` → "1e3"); anything else
    unchanged, for the field's own check."""
    return value.text if isinstance(value, (WrittenFloat, WrittenInt)) else value
