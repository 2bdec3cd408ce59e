"""Architecture tests: imports point one way, and each package's public API is its ``__all__``.

``checkpoint -> sharded_tensor -> _shardkit -> sharding``; ``sharding`` never communicates.
A package reaches another only through its public names: never through its ``_private``
modules or names. ``_shardkit`` is the one shared internal package, open to
``sharded_tensor`` and ``checkpoint`` (but not its own ``_private`` parts); it depends on
nothing but the standard library, torch and ``sharding``. Scripts never import the tests.
Packages that do not exist yet are skipped (layering: nothing to scan; API: ``importorskip``).
"""

from __future__ import annotations
import __future__

import ast
import functools
import importlib
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sharding", "sharded_tensor", "checkpoint")  # public packages, API pinned by __all__
# Every top-level package of the project, and the folders scanned besides them.
PROJECT = ("sharding", "_shardkit", "sharded_tensor", "checkpoint", "tests", "scripts")
SCANNED = ("sharding", "_shardkit", "sharded_tensor", "checkpoint", "scripts")
FORBIDDEN = {
    "sharding": ("_shardkit", "sharded_tensor", "checkpoint", "tests", "torch.distributed"),
    "_shardkit": ("sharded_tensor", "checkpoint", "tests"),
    "sharded_tensor": ("checkpoint", "tests"),
    "checkpoint": ("tests",),
    "scripts": ("tests",),
}
# Packages restricted to a list of dependencies (the standard library is always allowed).
ONLY = {
    "_shardkit": ("torch", "sharding", "_shardkit"),
}
# Private top-level packages shared with a few others: who may import them.
SHARED_INTERNAL = {
    "_shardkit": ("sharded_tensor", "checkpoint"),
}
# Packages whose private modules others must not import (scripts may poke internals).
PRIVATE_RULE = ("sharding", "_shardkit", "sharded_tensor", "checkpoint")
# Known violations, (file, imported module) -> why it is tolerated for now. Each entry must
# still be needed (test_known_violations_are_still_needed), so it goes away with the fix.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


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


def _private_violation(importer: str, name: str) -> bool:
    """Whether package ``importer`` importing ``name`` reaches into another package's private parts.

    A private part is a module or name starting with ``_`` below a project package's top level
    (``sharded_tensor._plan``, ``_shardkit.memory._ALONE``), or a private top-level package
    (``_shardkit``) used by a package it is not shared with. A package's own parts are its own.
    """
    parts = name.split(".")
    top = parts[0]
    if top not in PROJECT or top == importer:
        return False
    if top.startswith("_") and importer not in SHARED_INTERNAL.get(top, ()):
        return True
    return any(part.startswith("_") for part in parts[1:])


def _outside_allowed(importer: str, name: str) -> bool:
    """Whether ``name`` is outside the dependencies ``importer`` is restricted to (``ONLY``)."""
    allowed = ONLY.get(importer)
    if allowed is None:
        return False
    top = name.split(".")[0]
    return top not in sys.stdlib_module_names and top != "__future__" and not _is_banned(name, allowed)


def _known(path: str, name: str, known: dict[tuple[str, str], str] | None = None) -> bool:
    """Whether ``path`` importing ``name`` (the module or a name in it) is in ``KNOWN_VIOLATIONS``."""
    entries = KNOWN_VIOLATIONS if known is None else known
    return any(path == file and _is_banned(name, (module,)) for file, module in entries)


@functools.cache
def _scan(folder: str) -> list[tuple[str, str]]:
    """``(file relative to the root, imported module)`` for every import under ``folder``."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported_modules(tree, _module_name(path), path.name == "__init__.py")
        found += [(path.relative_to(ROOT).as_posix(), m) for m in sorted(imported)]
    return found


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


@pytest.mark.parametrize(("importer", "name", "expected"), [
    pytest.param("checkpoint", "sharded_tensor._plan", True, id="private-module"),
    pytest.param("checkpoint", "sharded_tensor._plan.plan_reshard", True, id="name-in-private-module"),
    pytest.param("checkpoint", "sharding._specs", True, id="private-module-of-sharding"),
    pytest.param("checkpoint", "sharded_tensor._model.registry", True, id="private-subpackage"),
    pytest.param("sharded_tensor", "_shardkit.memory._ALONE", True, id="private-name-in-shared-package"),
    pytest.param("sharding", "_shardkit.comm", True, id="shared-package-not-shared-with-importer"),
    pytest.param("sharded_tensor", "_shardkit.comm", False, id="shared-package"),
    pytest.param("checkpoint", "_shardkit.launch", False, id="shared-package-checkpoint"),
    pytest.param("checkpoint", "sharding.layout", False, id="public-module"),
    pytest.param("checkpoint", "sharded_tensor.ShardedTensor", False, id="public-name"),
    pytest.param("sharded_tensor", "sharded_tensor._plan", False, id="own-private-module"),
    pytest.param("_shardkit", "_shardkit.memory._ALONE", False, id="own-private-name"),
    pytest.param("checkpoint", "torch._C", False, id="third-party-private"),
    pytest.param("scripts", "tests._s3", True, id="tests-private"),
])
def test_private_violation(importer, name, expected):
    assert _private_violation(importer, name) is expected


@pytest.mark.parametrize(("importer", "name", "expected"), [
    pytest.param("_shardkit", "torch.distributed", False, id="torch"),
    pytest.param("_shardkit", "sharding.layout", False, id="sharding"),
    pytest.param("_shardkit", "os.path", False, id="stdlib"),
    pytest.param("_shardkit", "__future__", False, id="future"),
    pytest.param("_shardkit", "numpy", True, id="other-third-party"),
    pytest.param("_shardkit", "fsspec", True, id="fsspec"),
    pytest.param("_shardkit", "sharded_tensor", True, id="upper-layer"),
    pytest.param("checkpoint", "fsspec", False, id="unrestricted-package"),
])
def test_outside_allowed(importer, name, expected):
    assert _outside_allowed(importer, name) is expected


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    banned = FORBIDDEN[package]
    violations = [f"{path} imports {m}" for path, m in _scan(package) if _is_banned(m, banned)]
    assert not violations, f"{package} may not import {banned}:\n" + "\n".join(violations)


@pytest.mark.parametrize("package", PRIVATE_RULE)
def test_no_imports_of_other_packages_private_parts(package):
    violations = [f"{path} imports {m}" for path, m in _scan(package)
                  if _private_violation(package, m) and not _known(path, m)]
    assert not violations, (f"{package} reaches into other packages' private parts; import public names, "
                            f"or move what is shared to _shardkit:\n" + "\n".join(violations))


@pytest.mark.parametrize("package", sorted(ONLY))
def test_restricted_dependencies(package):
    violations = [f"{path} imports {m}" for path, m in _scan(package) if _outside_allowed(package, m)]
    assert not violations, f"{package} may import only the standard library and {ONLY[package]}:\n" + \
        "\n".join(violations)


def test_known_violations_are_still_needed():
    found = [(path, m) for folder in SCANNED for path, m in _scan(folder)]
    stale = [(file, module) for file, module in KNOWN_VIOLATIONS
             if not any(path == file and _is_banned(m, (module,)) for path, m in found)]
    assert not stale, f"remove these KNOWN_VIOLATIONS entries, the imports are gone: {stale}"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (any import in its code: top level, in a function,
    under ``TYPE_CHECKING``). A name imported from a module counts as that module; a module's own
    ancestor packages are left out, since Python imports them before the module anyway."""
    modules = {_module_name(p) for pkg in PROJECT[:4] for p in (ROOT / pkg).rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for pkg in PROJECT[:4]:
        for path, imported in _scan(pkg):
            source, target = _module_name(ROOT / path), owner(imported)
            if target and target != source and not source.startswith(target + "."):
                graph[source].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds an import cycle)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_cycles_finds_mutual_and_longer_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# Import cycles tolerated for now, each with why; each must still exist (so it goes away with the fix).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def test_no_import_cycles():
    found = _cycles(_import_graph())
    stale = [known for known in KNOWN_CYCLES if list(known) not in found]
    assert not stale, f"remove these KNOWN_CYCLES entries, the cycles are gone: {stale}"
    cycles = [c for c in found if tuple(c) not in KNOWN_CYCLES]
    assert not cycles, ("these modules import each other (directly or around a loop); move what both "
                        "need into a module both import, or pass it in:\n" + "\n".join(map(str, cycles)))


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


def test_known_matches_the_module_and_names_in_it_for_that_file_only():
    file, module = "checkpoint/_collect.py", "sharded_tensor._plan"
    known = {(file, module): "an example entry"}
    assert _known(file, module, known) and _known(file, module + ".some_name", known)
    assert not _known("checkpoint/_other.py", module, known)
    assert not _known(file, module + "_more", known)



ENGINE = "sharded_tensor._model.engine"


def test_the_engine_never_imports_shard_time_modules():
    """The compute engine (``sharded_tensor/_model/engine``) runs while a model computes; what decides at shard
    time (specs, layouts, zones, registrations) imports it, never the other way."""
    violations = [f"{path} imports {m}" for path, m in _scan("sharded_tensor/_model/engine")
                  if m.startswith("sharded_tensor") and not (m == ENGINE or m.startswith(ENGINE + "."))]
    assert not violations, "the engine imports shard-time modules:\n" + "\n".join(violations)


def _private_names_across_modules(folder: str) -> list[str]:
    """Uses, in ``folder``'s modules, of another project module's private names (``from .x import _y``,
    ``x._y``); a private module itself (``from .. import _random``) is a module, not a name."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        aliases = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = node.module or ""
            if node.level:
                base = package.split(".")[:max(len(package.split(".")) - node.level + 1, 0)]
                target = ".".join(p for p in (".".join(base), node.module) if p)
            if target.split(".")[0] not in PROJECT:
                continue
            for alias in node.names:
                name = alias.name
                is_module = (ROOT / Path(*target.split("."), f"{name}.py")).exists() or \
                    (ROOT / Path(*target.split("."), name)).is_dir()
                if is_module:
                    aliases.add(alias.asname or name)
                elif name.startswith("_") and not name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_the_model_sharding_modules():
    """Within ``sharded_tensor/_model`` (the engine and the shard-time modules around it), a module uses
    another's public names only: what is shared is named so."""
    found = _private_names_across_modules("sharded_tensor/_model")
    assert not found, "private names used across modules:\n" + "\n".join(found)
