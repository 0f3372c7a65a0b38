"""numba's kernels across processes: compiled once, then loaded from numba's cache by every later
process (the cache does not grow), and a new process's first batch does not wait for numba."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from diskreplay import ReplayStore, _jit
from diskreplay.store.compaction import MergePolicy
from diskreplay.synthetic import make_rollouts

pytestmark = pytest.mark.skipif(_jit.kernels() is None or _jit.crc32c_function() is None,
                                reason="needs numba and google_crc32c's C library")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a page check of a fresh read and a packed batch, with the kernels loaded first (waiting for them)
CHILD = textwrap.dedent("""
    import json, sys
    from diskreplay import Collator, ReplayStore, _jit
    from diskreplay.segment import COMPILED_CHECK_ROWS
    assert _jit.kernels() is not None
    with ReplayStore(sys.argv[1], readonly=True) as store:
        rows = store.row_ids()
        assert len(rows) >= COMPILED_CHECK_ROWS
        store.read(rows, ["prompt_ids", "completion_ids"])  # every page checked, in the compiled pass
        Collator(layout="packed").read(store, rows)
    print(json.dumps({name: [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]
                      for name, d in _jit.dispatchers().items()}))
""")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kernels") / "store")
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        for k in range(2):
            store.extend(make_rollouts(16, 4, seed=k, first_group=16 * k, prompt_mean=60, completion_mean=100))
    return path


def _run(code, *args, cache_dir, env=None):
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "DISKREPLAY_JIT": "1",
                                         **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_files(cache_dir):
    return sorted(os.path.relpath(os.path.join(d, f), cache_dir) for d, _, files in os.walk(cache_dir) for f in files)


@pytest.fixture(scope="module")
def filled_cache(store_path, tmp_path_factory):
    """A numba cache that one process filled: ``(directory, that process's cache statistics)``."""
    cache = tmp_path_factory.mktemp("numba-cache")
    return cache, _run(CHILD, store_path, cache_dir=cache)


@pytest.mark.slow
def test_a_second_process_loads_every_kernel_from_the_cache_and_adds_no_file(store_path, filled_cache):
    cache, first = filled_cache
    assert first["check_pages"][1] == 1 and first["pair"][1] >= 1  # compiled there, written to the cache
    files = _cache_files(cache)
    assert files
    for _ in range(2):
        again = _run(CHILD, store_path, cache_dir=cache)
        assert all(misses == 0 for _, misses in again.values()), again  # nothing compiled
        assert again["check_pages"][0] == 1 and again["pair"][0] >= 1 and again["positions_and_mask"][0] == 1
        assert _cache_files(cache) == files


def test_files_of_kernels_built_inside_a_function_or_at_other_lines_are_removed(tmp_path):
    """Older versions built the kernels in a closure: one new file per process, never read again; and
    numba names a kernel's files by its line, so another version's would stay."""
    cache = tmp_path / "numba-cache"
    from numba.core.caching import _CacheLocator

    stale = cache / _CacheLocator.get_suitable_cache_subpath(os.path.join(ROOT, "diskreplay", "_jit.py"))
    stale.mkdir(parents=True)
    for name in ("_jit._build.locals.check_pages-110.py311.1.nbc", "_jit._build.locals.check_pages-110.py311.nbi"):
        (stale / name).write_bytes(b"x")
    (stale / "other.nbi").write_bytes(b"x")
    from diskreplay._jit import compiled

    line = compiled.check_pages.py_func.__code__.co_firstlineno
    here = cache / _CacheLocator.get_suitable_cache_subpath(compiled.__file__)
    here.mkdir(parents=True)
    kept = [f"compiled.check_pages-{line}.py311.nbi", f"compiled.check_pages-{line}.py311.1.nbc"]
    for name in kept + [f"compiled.check_pages-{line + 3}.py311.nbi", f"compiled.check_pages-{line + 3}.py311.1.nbc"]:
        (here / name).write_bytes(b"x")
    code = "import json; from diskreplay import _jit; print(json.dumps(_jit.drop_stale_cache()))"
    assert _run(code, cache_dir=cache) == 4
    assert sorted(os.listdir(stale)) == ["other.nbi"]
    assert sorted(os.listdir(here)) == sorted(kept)


# a restarted trainer: the first batch of a new process, the kernels in numba's cache already
FIRST_BATCH = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    from diskreplay import Collator, ReplayStore, _jit
    with ReplayStore(sys.argv[1], readonly=True) as store:
        rows = store.row_ids()
        collator = Collator(0)
        first = {k: v.clone() for k, v in collator.read(store, rows).items() if hasattr(v, "clone")}
        waited = _jit.loaded()  # the first batch took the numpy path, numba starting after it
        loading = _jit._loading is not None
        if _jit._loading is not None:
            _jit._loading.join()
        again = collator.read(store, rows[::-1].copy())
        same = all(np.array_equal(first[k].numpy()[::-1], again[k].numpy()) for k in first
                   if k.startswith("completion"))
    print(json.dumps({"waited": waited, "loading": loading, "loaded_later": _jit.loaded(), "same": same,
                      "threads": [t.name for t in threading.enumerate()]}))
""")


@pytest.mark.slow
def test_a_new_process_first_batch_does_not_wait_for_numba(store_path, filled_cache):
    got = _run(FIRST_BATCH, store_path, cache_dir=filled_cache[0])  # the kernels are in the cache: a restart
    assert got["waited"] is False and got["loading"] is True
    assert got["loaded_later"] is True and got["same"] is True
    assert "diskreplay-jit" not in got["threads"]
