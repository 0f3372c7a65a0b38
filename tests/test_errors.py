"""One error tree (issue 12 item 19): every error diskreplay raises is one of the classes of
``diskreplay.errors``, derives from ``DiskReplayError`` and is exported from ``diskreplay``."""

import ast
import pathlib

import diskreplay
import diskreplay.errors as errors

PACKAGE = pathlib.Path(diskreplay.__file__).parent


def test_every_error_class_is_in_the_tree_and_exported():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, (errors.DiskReplayError, Warning)), name
        assert getattr(diskreplay, name) is cls and name in diskreplay.__all__, name
    defined_elsewhere = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                         for path in PACKAGE.rglob("*.py") if path.name != "errors.py"
                         for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Warning"))]
    assert defined_elsewhere == []


def test_no_bare_builtin_errors_are_raised_anywhere_in_the_package():
    """A ``raise`` names one of our classes, re-raises, or raises a variable holding a caught error."""
    ours = set(errors.__all__) | {"KeyboardInterrupt", "ArgumentTypeError", "StopIteration", "SystemExit",
                                  "NotImplementedError"}
    # internal signals caught a few lines below their raise, never seen by a caller
    caught_inside = {("states.py", "TypeError")}
    # protocols a caller already catches: a storage's missing file is the OS's FileNotFoundError on every
    # backend (docs/ARCHITECTURE.md, the storage contract), and a queue's Full/Empty are queue.Queue's
    protocol = {("storage", "FileNotFoundError"), ("async_buffer.py", "Full"), ("async_buffer.py", "Empty")}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        # a module's __getattr__ must raise AttributeError: that is Python's protocol for a missing name
        in_getattr = {id(raise_) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"
                      for raise_ in ast.walk(fn) if isinstance(raise_, ast.Raise)}
        # and a sequence's __getitem__ IndexError: the protocol that ends iteration and reports a bad index
        in_getitem = {id(raise_) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == "__getitem__"
                      for raise_ in ast.walk(fn) if isinstance(raise_, ast.Raise)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", None)
            # lower case or a leading underscore: a caught error re-raised, a helper that builds one of
            # ours, or a private control-flow signal; Conflict is ops.py's alias of CommitConflictError,
            # CacheEvicted the store's signal to map an evicted cache file again (never seen by callers),
            # MissingBase discovery's FileNotFoundError for a delta whose base manifest is gone
            if (name is None or name in ours or name[:1].islower() or name.startswith("_")
                    or name in ("Conflict", "CacheEvicted", "MissingBase", "SchemaRace")
                    or (path.name, name) in caught_inside or (path.parent.name, name) in protocol
                    or (path.name, name) in protocol or (id(node) in in_getattr and name == "AttributeError")
                    or (id(node) in in_getitem and name == "IndexError")):
                continue
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raises {name}")
    assert bad == []


def test_every_error_extend_raises_for_a_bad_batch_is_a_batch_error():
    """docs/batches.md: a bad batch raises BatchError. ingest.py (extend's validation, before anything is
    written) raised SchemaError for a wrong-typed column; a batch error that disagrees with the schema
    is a BatchSchemaError, both a BatchError and (as before) a SchemaError."""
    assert issubclass(errors.BatchSchemaError, errors.BatchError)
    assert issubclass(errors.BatchSchemaError, errors.SchemaError)
    for module in ("ingest.py", "schema.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or (module == "schema.py" and fn.name != "check_late_column"):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    name = node.exc.func.id
                    assert issubclass(getattr(errors, name), errors.BatchError), f"{module}:{node.lineno} {name}"
