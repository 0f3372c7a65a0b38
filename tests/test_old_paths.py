"""Old import paths still work, with a DeprecationWarning naming the new path and the release that removes
them (issue 48 item 6); nothing in the package, its tests or tools uses one."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (old module, name, where it lives now)
OLD = [
    ("diskreplay.padding", "collate", "diskreplay.batching.padded"),
    ("diskreplay.padding", "repad_stacked", "diskreplay.batching.padded"),
    ("diskreplay.padding", "PRESENT_SUFFIX", "diskreplay.batching.columns"),
    ("diskreplay.packing", "collate_packed", "diskreplay.batching.packed"),
    ("diskreplay.collator", "Collator", "diskreplay.batching.collator"),
    ("diskreplay.store.storage", "LocalStorage", "diskreplay.storage"),
    ("diskreplay.store.storage", "open_storage", "diskreplay.storage"),
    ("diskreplay.store", "LocalStorage", "diskreplay.storage"),
    ("diskreplay.store", "Storage", "diskreplay.storage"),
    ("diskreplay.schema", "normalize_batch", "diskreplay.ingest"),
    ("diskreplay.schema", "infer_schema", "diskreplay.ingest"),
    ("diskreplay.samplers", "_variance_ranking", "diskreplay.samplers"),
]


@pytest.mark.parametrize("old, name, new", OLD, ids=[f"{o}.{n}" for o, n, _ in OLD])
def test_an_old_path_warns_naming_the_new_one_and_the_removal(old, name, new):
    scope: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"from {old} import {name} as value", "user_code.py", "exec"), scope)
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and "diskreplay" in str(w.message)]
    # (from a package, importlib's hasattr asks once before the import does: one place, shown once)
    assert len({(str(w.message), w.filename, w.lineno) for w in ours}) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert f"{old}" in message and "removed in diskreplay 0.3.0" in message and new in message, message
    assert ours[0].filename == "user_code.py"  # it points at the import, not at diskreplay or importlib
    now = importlib.import_module(new)
    assert scope["value"] is getattr(now, name.lstrip("_"))


@pytest.mark.parametrize("old", sorted({old for old, _, _ in OLD if old.count(".") == 1 and "store" not in old}
                                       | {"diskreplay.store.storage"}))
def test_importing_an_old_module_alone_warns_only_when_a_name_is_taken(old):
    """pytest's --doctest-modules imports every module and looks up every name dir() gives (fixtures): that
    alone must not warn."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        for name in dir(module):
            getattr(module, name, None)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning) and "diskreplay" in str(w.message)]
    with pytest.raises(AttributeError):
        module.no_such_name


def _old_path_uses(path: Path):
    old_modules = {"diskreplay.padding", "diskreplay.packing", "diskreplay.collator", "diskreplay.store.storage"}
    old_names = {"diskreplay.store": {"LocalStorage", "Storage"},
                 "diskreplay.schema": {"normalize_batch", "infer_schema"},
                 "diskreplay.samplers": {"_variance_ranking"}}
    package = path.relative_to(ROOT).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                base = list(package[:-node.level])
                module = ".".join(base + ([module] if module else []))
            names = {alias.name for alias in node.names}
            if module in old_modules or names & old_names.get(module, set()) or \
                    {f"{module}.{n}" for n in names} & old_modules:
                yield f"{path.relative_to(ROOT)}:{node.lineno} from {module} import {sorted(names)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in old_modules:
                    yield f"{path.relative_to(ROOT)}:{node.lineno} import {alias.name}"
        elif isinstance(node, ast.Attribute) and node.attr in {"normalize_batch", "infer_schema"} and \
                isinstance(node.value, ast.Name) and node.value.id == "schema":
            yield f"{path.relative_to(ROOT)}:{node.lineno} schema.{node.attr}"


def test_nothing_in_the_package_tests_or_tools_uses_an_old_path():
    """The suite itself emits none of these warnings (the shims and this file aside)."""
    shims = {ROOT / "diskreplay" / f"{name}.py" for name in ("padding", "packing", "collator")}
    shims |= {ROOT / "diskreplay" / "store" / "storage.py", Path(__file__).resolve()}
    files = [p for folder in ("diskreplay", "tests", "tools") for p in sorted((ROOT / folder).rglob("*.py"))
             if p not in shims]
    assert len(files) > 100
    uses = [use for path in files for use in _old_path_uses(path)]
    assert uses == []
