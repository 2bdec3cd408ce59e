"""Architecture tests: imports point one way, and each package's public API is its ``__all__``.

``checkpoint -> sharded_tensor -> sharding``; ``sharding`` never communicates. Packages
that do not exist yet are skipped (layering: nothing to scan; API: ``importorskip``).
"""

from __future__ import annotations
import __future__

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sharding", "sharded_tensor", "checkpoint")
FORBIDDEN = {
    "sharding": ("sharded_tensor", "checkpoint", "torch.distributed"),
    "sharded_tensor": ("checkpoint",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module imported by ``tree`` (the code of ``module``).

    Covers ``import a.b``, ``from a import b`` (both ``a`` and ``a.b``, since ``b`` may be a
    submodule), relative imports, and ``importlib.import_module("...")`` / ``__import__("...")``
    with a literal name.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[:max(len(base_parts) - node.level + 1, 0)])
                target = ".".join(p for p in (base, node.module) if p)
            if target:
                found.add(target)
            found.update(".".join(p for p in (target, alias.name) if p) for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def _is_banned(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize(("source", "module", "is_package", "expected"), [
    pytest.param("import torch.distributed as dist", "sharding._x", False, {"torch.distributed"}, id="import"),
    pytest.param("from torch import distributed", "sharding._x", False, {"torch", "torch.distributed"},
                 id="from-import-submodule"),
    pytest.param("from .._specs import x", "sharding.sub._y", False, {"sharding._specs", "sharding._specs.x"},
                 id="relative-up"),
    pytest.param("from . import _specs", "sharding", True, {"sharding", "sharding._specs"}, id="relative-package"),
    pytest.param("from .. import checkpoint", "sharding._x", False, {"checkpoint"}, id="relative-to-top"),
    pytest.param("import importlib\nimportlib.import_module('checkpoint')", "sharding._x", False,
                 {"importlib", "checkpoint"}, id="dynamic"),
    pytest.param("def f():\n    import checkpoint._save", "sharded_tensor._x", False, {"checkpoint._save"},
                 id="local-import"),
])
def test_imported_modules_finds_every_form(source, module, is_package, expected):
    assert _imported_modules(ast.parse(source), module, is_package) == expected


def test_is_banned_matches_whole_names_only():
    assert _is_banned("torch.distributed", ("torch.distributed",))
    assert _is_banned("torch.distributed.tensor", ("torch.distributed",))
    assert not _is_banned("checkpointing", ("checkpoint",))
    assert not _is_banned("torch", ("torch.distributed",))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    banned = FORBIDDEN[package]
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported_modules(tree, _module_name(path), path.name == "__init__.py")
        violations += [f"{path.relative_to(ROOT)} imports {m}" for m in sorted(imported) if _is_banned(m, banned)]
    assert not violations, f"{package} may not import {banned}:\n" + "\n".join(violations)


def test_checkpoint_uses_only_the_public_names_of_sharded_tensor():
    # checkpoint builds on what sharded_tensor offers everyone (its __all__); the private
    # runtime both share lives in _shardkit.
    violations = []
    for path in sorted((ROOT / "checkpoint").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported_modules(tree, _module_name(path), path.name == "__init__.py")
        violations += [f"{path.relative_to(ROOT)} imports {m}" for m in sorted(imported)
                       if m.startswith("sharded_tensor.") and m.split(".")[1].startswith("_")]
    assert not violations, "checkpoint may import only sharded_tensor's public names:\n" + "\n".join(violations)


def _public_names(pkg: types.ModuleType) -> list[str]:
    """Names a user sees in ``vars(pkg)``: no ``_`` prefix, no submodules, no ``__future__`` flags."""
    return sorted(name for name, value in vars(pkg).items()
                  if not name.startswith("_")
                  and not isinstance(value, (types.ModuleType, __future__._Feature)))


@pytest.mark.parametrize("package", PACKAGES)
def test_public_api_is_exactly___all__(package):
    if (ROOT / package / "__init__.py").exists():
        pkg = importlib.import_module(package)  # present: an import error is a failure, not a skip
    else:
        pkg = pytest.importorskip(package, reason=f"package {package!r} does not exist yet")
    assert len(pkg.__all__) == len(set(pkg.__all__)), f"{package}.__all__ has duplicates"
    assert _public_names(pkg) == sorted(pkg.__all__)
    missing = [name for name in pkg.__all__ if not hasattr(pkg, name)]
    assert not missing, f"{package}.__all__ lists names it does not define: {missing}"
