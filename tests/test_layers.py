"""Dependencies point down: no module imports a module of a higher layer.

Layers, lowest first: ``errors`` and ``memo``; ``bias``; ``inputs``; ``ops``; ``dispatch``; ``api``;
then ``nn``, ``integrations``, ``distributed``, ``testing``, ``__main__`` and the package root.
Each layer is imported in a fresh interpreter with the ``biasattn`` package body skipped (it
imports every layer), so only what the layer itself imports gets loaded; and every import statement
of the package, including those inside functions, is read from the source.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import biasattn

LAYERS = ["errors", "memo", "bias", "inputs", "ops", "dispatch", "api"]
RANK = {
    "errors": 0, "memo": 0, "bias": 1, "inputs": 2, "ops": 3, "dispatch": 4, "api": 5,
    "nn": 6, "integrations": 6, "distributed": 6, "testing": 6, "__main__": 6,
}
# The torch.library ops run the dispatcher at call time: they are the compiled path of the API,
# kept beside the operators they wrap.
MODULE_RANK = {"biasattn.ops.custom_ops": RANK["api"]}

_IMPORT_ALONE = """
import importlib, json, sys, types
pkg = types.ModuleType("biasattn")
pkg.__path__ = [{path!r}]
sys.modules["biasattn"] = pkg
importlib.import_module("biasattn.{layer}")
print(json.dumps(sorted(m for m in sys.modules if m.startswith("biasattn."))))
"""


def _rank(module: str) -> int:
    if module in MODULE_RANK:
        return MODULE_RANK[module]
    if module == "biasattn":
        return RANK["__main__"]
    return RANK[module.split(".")[1]]


def upward_imports(layer: str, loaded: list[str]) -> list[str]:
    """The modules among ``loaded`` that belong to a layer above ``layer``."""
    return [m for m in loaded if _rank(m) > RANK[layer]]


def test_the_rule_flags_an_upward_import():
    loaded = ["biasattn.bias", "biasattn.bias.base", "biasattn.errors", "biasattn.api", "biasattn.ops.custom_ops"]
    assert upward_imports("bias", loaded) == ["biasattn.api", "biasattn.ops.custom_ops"]
    assert upward_imports("dispatch", loaded) == ["biasattn.api", "biasattn.ops.custom_ops"]
    assert upward_imports("api", loaded) == []


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imported_alone_loads_no_higher_layer(layer):
    path = str(Path(biasattn.__file__).parent)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE.format(path=path, layer=layer)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"biasattn.{layer}" in loaded
    assert upward_imports(layer, loaded) == [], f"biasattn.{layer} imports a higher layer"


def _imports(path: Path, module: str, package: str) -> list[tuple[str, int]]:
    """``(imported biasattn module, line)`` for every import statement of the file ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(parts + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [f"{name}.{a.name}" for a in node.names] if name == "biasattn" else [name]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(n, node.lineno) for n in names if n == "biasattn" or n.startswith("biasattn.")]
    return out


def test_no_import_statement_points_up_even_inside_a_function():
    root = Path(biasattn.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = ".".join(parts[:-1])
        if parts[-1] == "__init__":
            parts, package = parts[:-1], ".".join(parts[:-1])
        module = ".".join(parts)
        wrong += [f"{module}:{line} imports {name}" for name, line in _imports(path, module, package)
                  if _rank(name) > _rank(module)]
    assert wrong == []
