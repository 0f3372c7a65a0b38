"""The documents cannot drift from the code: README's blocks run, docs/ links resolve, and the
package's imports keep the direction docs/ARCHITECTURE.md draws."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(text: str, language: str):
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 150
    first = _blocks(README, "bash")[0].splitlines()
    assert first[0].startswith('pip install torch==2.13.0 -e ".[dev]" && python -m diskreplay.demo')
    assert first[1].startswith("python -m pytest -q -n 2 --dist loadfile")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 --dist loadfile" in ci


def test_readme_python_blocks_run(tmp_path, capsys):
    """Each block runs as the user would paste it, given what the text says the user supplies:
    ``path``, a place for the store."""
    blocks = _blocks(README, "python")
    assert blocks
    for i, code in enumerate(blocks):
        scope = {"path": str(tmp_path / f"store-{i}")}
        exec(compile(code, f"README.md python block {i}", "exec"), scope)
    out = capsys.readouterr().out
    assert "torch.Size([32," in out and "torch.float32" in out


def test_readme_cli_block_runs(tmp_path):
    """The command block, run line by line in a directory holding the store (and the tokenizer) that
    its lines name."""
    pytest.importorskip("transformers")
    from diskreplay import ReplayStore
    from diskreplay.synthetic import char_tokenizer, make_rollouts

    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    batch = make_rollouts(8, seed=3)
    for name in ("prompt_ids", "completion_ids"):  # ids the char tokenizer can decode
        batch[name] = [ids % len(tokenizer) for ids in batch[name]]
    with ReplayStore(tmp_path / "runs" / "grpo" / "replay", group_key="prompt_id") as store:
        store.extend(batch)
    lines = [line.split("#")[0].strip() for line in _blocks(README, "bash")[1].splitlines()]
    commands = [line for line in lines if line.startswith("diskreplay ")]
    assert len(commands) >= 5
    bin_dir = Path(sys.executable).parent
    for command in commands:
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, "-m", "diskreplay.cli", *argv[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
        assert done.returncode == 0, (command, done.stderr)
    from diskreplay import ReplayStore as Reopened
    with Reopened(tmp_path / "runs" / "restored", readonly=True) as restored:
        assert len(restored) == 64


def test_the_conformance_example_runs(tmp_path):
    """docs/ARCHITECTURE.md's module that runs the storage contract against a backend, saved as a test
    module and run by pytest as that backend's author would: every contract test passes."""
    import textwrap

    (code,) = _blocks((ROOT / "docs" / "ARCHITECTURE.md").read_text(), "python")
    (tmp_path / "test_my_storage.py").write_text(textwrap.dedent(code))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_storage.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    from diskreplay.testing import StorageTests

    contract = sum(1 for n in dir(StorageTests) if n.startswith("test_"))
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= contract > 20, done.stdout[-2000:]


def test_links_between_documents_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


# --------------------------------------------------------------------------
# the direction of imports (docs/ARCHITECTURE.md)
# --------------------------------------------------------------------------

#: layer of each module, by the longest matching prefix (docs/ARCHITECTURE.md's table, bottom up)
LAYERS = {
    "errors": 1, "_fileio": 1, "_ranges": 1, "_moved": 1, "ragged": 1, "_jit": 1, "synthetic": 1,
    "schema": 2, "ingest": 2, "groups": 2, "storage": 2,
    "format": 3, "segment": 3,
    "store": 4,
    "samplers": 5, "batching": 5, "padding": 5, "packing": 5, "collator": 5, "following": 5, "loader": 5, "buffer": 5, "stream": 5,
    "verify": 5,
    "cli": 6, "demo": 6, "export": 6, "integrations": 6, "testing": 6, "__main__": 6, "": 6,
}


def _modules():
    package = ROOT / "diskreplay"
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield ".".join(parts), is_package, path


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), -1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"diskreplay.{module} has no layer in LAYERS (add it, and to docs/ARCHITECTURE.md)")


def _imports(module: str, is_package: bool, path: Path):
    """(imported module, names, line) for every import of a diskreplay module in ``path``."""
    import ast

    known = {name for name, _, _ in _modules()}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "diskreplay":
                target = node.module[len("diskreplay."):] if "." in node.module else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in known:  # `from . import errors`: the module itself
                    yield sub, [], node.lineno
                else:
                    yield target, [alias.name], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "diskreplay":
                    yield alias.name[len("diskreplay."):] if "." in alias.name else "", [], node.lineno


def test_imports_run_one_way():
    """No module imports one of a higher layer (function-level imports included); inside store/, no
    part imports the facade (``store.replay_store``): the facade delegates to the parts."""
    wrong = []
    for module, is_package, path in _modules():
        for target, _, line in _imports(module, is_package, path):
            if _layer(target) > _layer(module):
                wrong.append(f"diskreplay.{module} (layer {_layer(module)}) imports diskreplay.{target} "
                             f"(layer {_layer(target)}) at {path.name}:{line}")
            if module.startswith("store.") and target == "store.replay_store":
                wrong.append(f"diskreplay.{module}, a part of store/, imports the facade diskreplay.{target} "
                             f"at {path.name}:{line}")
    assert not wrong, "\n".join(wrong)


#: the most lines the facade may have, docstrings with their examples included: it delegates to the parts
FACADE_MAX_LINES = 600


def test_the_facade_delegates_in_a_few_hundred_lines():
    """``store/replay_store.py`` holds the public methods and their examples, and each delegates to a part of
    ``store/``; the bodies live in the parts, so the facade stays within ``FACADE_MAX_LINES``."""
    facade = ROOT / "diskreplay" / "store" / "replay_store.py"
    lines = facade.read_text().count("\n")
    assert lines <= FACADE_MAX_LINES, (f"{facade} has {lines} lines (at most {FACADE_MAX_LINES}): move the body of "
                                       "a method into a part of store/ and delegate to it")


def test_no_module_imports_another_modules_private_names():
    wrong = []
    for module, is_package, path in _modules():
        for target, names, line in _imports(module, is_package, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                wrong.append(f"diskreplay.{module} imports {private} from diskreplay.{target} at {path.name}:{line}")
    assert not wrong, "\n".join(wrong)


#: the store's modules repair commits through ("it commits through the same committer as the store", docs/FORMAT.md)
VERIFY_COMMITS_THROUGH = {"store.committer", "store.ops"}


def test_verify_reads_through_format():
    """``verify`` reads a store's files through ``format/`` (and ``segment``, ``storage``), never through the
    store's parts, so that what it checks is the format a reader knows; only ``repair`` imports the store's
    commit path, to commit as a writer does."""
    wrong = []
    for module, is_package, path in _modules():
        if module.split(".")[0] != "verify":
            continue
        for target, names, line in _imports(module, is_package, path):
            allowed = module == "verify.repair" and target in VERIFY_COMMITS_THROUGH
            if target.split(".")[0] == "store" and not allowed:
                wrong.append(f"diskreplay.{module} imports diskreplay.{target} {names or ''} at {path.name}:{line}")
    assert not wrong, "\n".join(wrong)


def test_long_modules_say_why_they_are_one():
    """A module over about 600 lines states in its docstring why its job is one ("One module: ...")."""
    import ast

    long = []
    for module, _, path in _modules():
        text = path.read_text()
        if text.count("\n") > 620 and "One module:" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path} has {text.count(chr(10))} lines and no 'One module:' reason in its docstring")
    assert not long, "\n".join(long)
