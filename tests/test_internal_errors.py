"""Exceptions defined outside diskreplay/errors.py are internal control flow (a leading underscore,
caught inside the library); anything a caller can meet is a DiskReplayError from errors.py."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from diskreplay import DiskReplayError, ReplayStore
from diskreplay import format as fmt
from diskreplay.errors import ManifestBaseMissingError
from diskreplay.testing.workload import batch_for

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "diskreplay"


def test_exceptions_defined_outside_errors_py_are_internal():
    public = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if any(b.endswith(("Error", "Exception")) or b in ("FileNotFoundError", "Exception") for b in bases) \
                    and not bases & {"Warning", "UserWarning"}:
                public.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(sorted(bases))})")
    assert public == [], public


def test_a_delta_whose_base_is_gone_is_our_error(tmp_path):
    """Reading a delta generation whose full manifest was collected (or lost) raised discovery's own
    FileNotFoundError subclass, which no caller could import from diskreplay.errors."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        for step in range(3):
            store.extend(batch_for(1, step))
    os.remove(os.path.join(path, fmt.manifest_file(1)))
    with pytest.raises(ManifestBaseMissingError, match="open a newer generation") as info:
        fmt.read_manifest(path, 3)
    assert isinstance(info.value, (DiskReplayError, FileNotFoundError))
    with pytest.raises(DiskReplayError):
        ReplayStore(path, readonly=True)


def test_a_schema_race_never_leaves_extend(tmp_path, monkeypatch):
    """Two writers of a new multi-writer store: the second's first append finds the schema fixed by the
    first right before it creates SCHEMA.json (the internal _SchemaRace), validates its batch against it
    and commits; nothing escapes."""
    from diskreplay.storage import LocalStorage
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    a, b = ReplayStore(path), ReplayStore(path)
    real, first = LocalStorage.put_if_absent, []

    def put_if_absent(self, rel, data, **kw):
        if self is b._committer.storage and rel == fmt.SCHEMA_FILE and not first:
            first.append(a.extend(batch_for(1, 0)))  # a fixes the schema first
        return real(self, rel, data, **kw)

    monkeypatch.setattr(LocalStorage, "put_if_absent", put_if_absent)
    second = b.extend(batch_for(2, 0))
    monkeypatch.undo()
    assert first and second[0] == first[0][-1] + 1
    a.close(), b.close()
