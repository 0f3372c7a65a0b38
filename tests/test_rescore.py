"""``diskreplay rescore``: a user's scoring function over a store, committed as a named version of a
column chunk by chunk, exactly once across a SIGKILL; ``info`` lists the versions; exports and samplers
pick one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from diskreplay import PromptGroupSampler, ReplayStore
from diskreplay.cli import build_parser, main
from diskreplay.errors import ExportError, SamplerError
from diskreplay.export import export, store_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The scoring module the tests write: a reward from a row's content (so the test has a model of every
# value), each call that returns recorded as one line of row ids in CALLS; with the file BLOCK present,
# the call whose chunk starts at row BLOCK_AT stops its own process (SIGSTOP) before returning, so the
# test kills it at that moment from outside.
SCORER = '''
import json, os, signal
import numpy as np

def score(batch):
    rows = batch["rows"]
    block = os.environ.get("BLOCK")
    if block and os.path.exists(block) and int(rows[0]) == int(os.environ["BLOCK_AT"]):
        with open(block + ".reached", "w") as f:
            f.write("1")
        os.kill(os.getpid(), signal.SIGSTOP)
    out = [float(np.sum(batch["completion_ids"][i])) / 8 + float(batch["prompt_id"][i]) for i in range(len(rows))]
    if os.environ.get("SLOW"):
        import time
        time.sleep(float(os.environ["SLOW"]))
    with open(os.environ["CALLS"], "a") as f:
        f.write(json.dumps([int(r) for r in rows]) + "\\n")
    return out

def short(batch):
    return [0.0] * (len(batch["rows"]) - 1)

def wide(batch):
    return np.zeros((len(batch["rows"]), 2))

def boom(batch):
    raise ZeroDivisionError("no judge")
'''


def model(completion_ids, prompt_id):
    return float(np.sum(completion_ids)) / 8 + float(prompt_id)


def make_store(path, n=40, multi_writer=False):
    rng = np.random.default_rng(0)
    with ReplayStore(path, multi_writer=multi_writer) as s:
        for lo in range(0, n, 10):
            ids = range(lo, min(lo + 10, n))
            s.extend({"prompt_id": [i // 4 for i in ids],
                      "completion_ids": [rng.integers(1, 50, 1 + i % 3).astype(np.int32) for i in ids],
                      "rewards": np.zeros(len(ids))})
    return str(path)


def expected(path):
    with ReplayStore(path, readonly=True) as s:
        rows = s.row_ids()
        data = s.read(rows, ["completion_ids", "prompt_id"])
        return rows, np.array([model(data["completion_ids"][i], data["prompt_id"][i]) for i in range(len(rows))])


@pytest.fixture
def scorer(tmp_path, monkeypatch):
    """The scoring module on sys.path (and PYTHONPATH, for child processes); CALLS records its calls."""
    d = tmp_path / "scorers"
    d.mkdir()
    (d / "tscore.py").write_text(SCORER)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, str(d), os.environ.get("PYTHONPATH", "")]))
    sys.modules.pop("tscore", None)
    return calls


def called(calls):
    return [row for line in calls.read_text().splitlines() for row in json.loads(line)] if calls.exists() else []


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def test_rescore_end_to_end_then_info_and_a_resume_after_appends(tmp_path, scorer, capsys):
    path = make_store(tmp_path / "s")
    rc, out, err = cli(capsys, "rescore", path, "--column", "rewards", "--version", "len-v1", "--python",
                       "tscore:score", "--chunk", "8", "--meta", '{"by": "test"}')
    assert rc == 0, err
    assert "rescored 40 of 40" in out
    rows, want = expected(path)
    with ReplayStore(path, readonly=True) as s:
        np.testing.assert_array_equal(s.read(rows, ["rewards@len-v1"])["rewards@len-v1"], want)
        np.testing.assert_array_equal(s.read(rows, ["rewards"])["rewards"], want)  # the newest values
        v = s.versions("rewards")["len-v1"]
        assert v["rows"] == 40 and v["patches"] == 5
        assert v["meta"]["by"] == "test" and v["meta"]["scorer"] == "tscore:score" and "started" in v["meta"]
    assert sorted(called(scorer)) == list(range(40))

    # info lists the version and the patches a compact would fold
    rc, out, _ = cli(capsys, "info", path)
    assert rc == 0
    assert "version rewards@len-v1: 40 rows in 5 patches" in out and '"by": "test"' in out
    assert "5 patches not yet folded" in out
    rc, out, _ = cli(capsys, "info", path, "--json")
    col = next(c for c in json.loads(out)["columns"] if c["name"] == "rewards")
    assert col["patches"] == 5 and col["versions"]["len-v1"]["rows"] == 40

    # rows appended since are scored by a run again; the rows scored are not, even in a grown chunk
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [10, 10, 10], "completion_ids": [[1, 2], [3], [4, 5, 6]], "rewards": [0.0] * 3})
    rc, out, _ = cli(capsys, "rescore", path, "--column", "rewards", "--version", "len-v1", "--python",
                     "tscore:score", "--chunk", "8", "--json")
    res = json.loads(out)
    assert (res["scored"], res["skipped"], res["chunks"]) == (3, 40, 1)
    assert sorted(called(scorer)) == list(range(43))
    rows, want = expected(path)
    with ReplayStore(path, readonly=True) as s:
        np.testing.assert_array_equal(s.read(rows, ["rewards@len-v1"])["rewards@len-v1"], want)

    # after compact the version stays readable and no patch waits to be folded
    assert cli(capsys, "compact", path)[0] == 0
    info = store_info(path)
    col = next(c for c in info["columns"] if c["name"] == "rewards")
    assert col["patches"] == 0 and col["versions"]["len-v1"]["rows"] == 43


def _rescore_process(path, block_at=None, block=None, slow=None):
    env = dict(os.environ)
    if block is not None:
        env.update(BLOCK=str(block), BLOCK_AT=str(block_at))
    if slow is not None:
        env.update(SLOW=str(slow))
    return subprocess.Popen([sys.executable, "-m", "diskreplay", "rescore", path, "--column", "rewards", "--version",
                             "judge", "--python", "tscore:score", "--chunk", "8", "-q"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_mid_run_then_rerun_scores_every_row_once(tmp_path, scorer):
    path = make_store(tmp_path / "s", n=64)
    block = tmp_path / "block"
    block.write_text("1")
    # the 4th chunk's call stops its process: chunks 0-2 are committed, the 4th is in the function
    p = _rescore_process(path, block_at=24, block=block)
    deadline = time.monotonic() + 60
    while not (tmp_path / "block.reached").exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert sorted(called(scorer)) == list(range(24))
    with ReplayStore(path, readonly=True) as s:
        assert s.versions("rewards")["judge"]["rows"] == 24

    block.unlink()
    p = _rescore_process(path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "rescored 40 of 64" in out and "24 rows an earlier run scored were skipped" in out
    got = called(scorer)
    assert sorted(got) == list(range(64))  # each row's call returned once: no chunk was done again
    rows, want = expected(path)
    with ReplayStore(path, readonly=True) as s:
        np.testing.assert_array_equal(s.read(rows, ["rewards@judge"])["rewards@judge"], want)
        v = s.versions("rewards")["judge"]
        assert (v["rows"], v["patches"]) == (64, 8)  # each chunk committed once


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path, scorer):
    """Killed at random moments (in the function, in a commit, between): every row is committed once,
    the values equal the model, and only a chunk in flight at a kill is scored again."""
    path = make_store(tmp_path / "s", n=80, multi_writer=True)
    rng = np.random.default_rng(1)
    kills = 0
    for _ in range(4):
        before = len(called(scorer))
        p = _rescore_process(path, slow=0.01)
        deadline = time.monotonic() + 60
        while len(called(scorer)) == before and p.poll() is None:  # once it has made progress ...
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(float(rng.uniform(0.0, 0.04)))  # ... at a random point: in a call, a commit, between
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        kills += p.returncode == -signal.SIGKILL
    assert kills >= 2
    p = _rescore_process(path)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    got = np.array(called(scorer))
    counts = np.bincount(got, minlength=80)
    assert counts.min() == 1 and counts.max() <= 5
    assert int((counts > 1).sum()) <= 4 * 8  # at most one chunk per kill
    rows, want = expected(path)
    with ReplayStore(path, readonly=True) as s:
        np.testing.assert_array_equal(s.read(rows, ["rewards@judge"])["rewards@judge"], want)
        assert s.versions("rewards")["judge"]["rows"] == 80  # no row committed twice


@pytest.mark.parametrize("function, message", [
    ("tscore:short", "returned 7 values for rows 0..7 (8 rows) of column 'rewards'"),
    ("tscore:wide", "returned values of shape (8, 2) for rows 0..7 (8 rows) of column 'rewards'"),
    ("tscore:boom", "raised ZeroDivisionError: no judge on rows 0..7 of column 'rewards'"),
    ("tscore:nothing", "has no function 'nothing'"),
    ("nomodule_here:score", "cannot import 'nomodule_here'"),
    ("./missing.py:score", "cannot import './missing.py' (FileNotFoundError"),
])
def test_a_bad_function_is_refused_naming_rows_and_column_and_writes_nothing(tmp_path, scorer, capsys, function,
                                                                               message):
    path = make_store(tmp_path / "s")
    with ReplayStore(path, readonly=True) as s:
        before = s.generation
    rc, _, err = cli(capsys, "rescore", path, "--column", "rewards", "--version", "v", "--python", function,
                     "--chunk", "8")
    assert rc == 1 and message in err, err
    with ReplayStore(path, readonly=True) as s:
        assert s.generation == before and s.versions("rewards") == {}


def test_usage_errors_and_help(capsys, tmp_path):
    rc, out, _ = cli(capsys, "rescore", "--help")
    assert rc == 0 and "batch['rows']" in out and "diskreplay rescore " in out.split("examples:")[1]
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "rescore" in a.choices)
    assert all(a.help for a in sub.choices["rescore"]._actions)
    path = make_store(tmp_path / "s", n=10)
    for args, message in [(["--meta", "[1]"], "must be a JSON object"), (["--chunk", "0"], "positive integer"),
                          (["--version", "a b"], "a version name has 1 to 64 letters")]:
        rc, _, err = cli(capsys, "rescore", path, "--column", "rewards", "--version", "v", "--python", "m:f", *args)
        assert rc == 2 and message in err
    rc, _, err = cli(capsys, "rescore", str(tmp_path / "none"), "--column", "rewards", "--version", "v",
                     "--python", "json:dumps")
    assert rc == 1 and "no diskreplay store" in err and not (tmp_path / "none").exists()


@pytest.fixture
def versioned(tmp_path):
    """A store whose rewards have a version 'judge' (rows 0-11; rows 12-15 never judged) and newer
    unnamed values on every row."""
    path = make_store(tmp_path / "s", n=16)
    with ReplayStore(path) as s:
        s.update(np.arange(12), {"rewards": np.arange(12, dtype=np.float64)[::-1]}, version="judge",
                 meta={"scorer": "j"})
        s.update(np.arange(16), {"rewards": np.arange(16, dtype=np.float64) + 100})
    return path


def test_export_picks_a_version(versioned, tmp_path, capsys):
    with ReplayStore(versioned, readonly=True) as s:
        want = s.read(np.arange(16), ["rewards@judge"])["rewards@judge"]
    assert np.isnan(want[12:]).all()
    res = export(versioned, tmp_path / "v.parquet", versions={"rewards": "judge"})
    assert res["versions"] == {"rewards": "judge"}
    np.testing.assert_array_equal(pq.read_table(tmp_path / "v.parquet")["rewards"].to_numpy(), want)
    export(versioned, tmp_path / "new.parquet")  # the default: the newest values
    np.testing.assert_array_equal(pq.read_table(tmp_path / "new.parquet")["rewards"].to_numpy(), np.arange(16) + 100)
    # a filter on the reward filters on the version exported
    export(versioned, tmp_path / "hi.parquet", versions={"rewards": "judge"}, min_reward=6)
    assert pq.read_table(tmp_path / "hi.parquet")["rewards"].to_pylist() == [11.0, 10, 9, 8, 7, 6]

    rc, out, err = cli(capsys, "export", versioned, tmp_path / "v.jsonl", "--version", "rewards=judge")
    assert rc == 0, err
    got = [json.loads(line)["rewards"] for line in open(tmp_path / "v.jsonl")]
    assert got == [float(x) for x in want[:12]] + [None] * 4
    pytest.importorskip("zarr")
    import zarr

    rc, _, err = cli(capsys, "export", versioned, tmp_path / "v.zarr", "--version", "rewards=judge")
    assert rc == 0, err
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "v.zarr"), mode="r")["columns/rewards"][:], want)


def test_export_refuses_an_unknown_version(versioned, tmp_path, capsys):
    with pytest.raises(ExportError, match=r"column 'rewards' has no version 'nope' \(its versions: \['judge'\]\)"):
        export(versioned, tmp_path / "x.parquet", versions={"rewards": "nope"})
    with pytest.raises(ExportError, match="'score' is not a column"):
        export(versioned, tmp_path / "x.parquet", versions={"score": "judge"})
    rc, _, err = cli(capsys, "export", versioned, tmp_path / "x.parquet", "--version", "rewards=nope")
    assert rc == 1 and "has no version 'nope'" in err
    assert cli(capsys, "export", versioned, tmp_path / "x.parquet", "--version", "rewards")[0] == 2
    assert not os.path.exists(tmp_path / "x.parquet")


def test_samplers_draw_by_a_version(versioned):
    with ReplayStore(versioned, readonly=True) as s:
        judge = s.read(np.arange(16), ["rewards@judge"])["rewards@judge"]
        newest = s.read(np.arange(16), ["rewards"])["rewards"]
        # by the judge's values the best row of each group is its first (rewards 11, 10, ... descend);
        # by the newest ones its last; group 3 (rows 12-15) was never judged: NaN ranks lowest, ties newest
        by_judge = PromptGroupSampler(samples_per_group=1, strategy="reward", reward_key="rewards@judge", seed=0)
        rows = by_judge.sample(s, 4, groups=[0, 1, 2, 3])
        assert rows.tolist() == [0, 4, 8, 15]
        assert judge[rows[:3]].tolist() == [11, 7, 3]
        by_newest = PromptGroupSampler(samples_per_group=1, strategy="reward", seed=0)
        assert by_newest.sample(s, 4, groups=[0, 1, 2, 3]).tolist() == [3, 7, 11, 15]
        assert newest[[3, 7, 11, 15]].tolist() == [103, 107, 111, 115]
        # the group spread filter reads the version too: group 3 has no judged reward, so never qualifies
        spread = PromptGroupSampler(num_groups=1, min_reward_std=0.0, reward_key="rewards@judge", seed=0)
        for _ in range(10):
            assert max(spread.sample(s, 4).tolist()) < 12
        with pytest.raises(SamplerError, match=r"has no version 'nope' \(its versions: \['judge'\]\)"):
            PromptGroupSampler(samples_per_group=1, strategy="reward", reward_key="rewards@nope").sample(s, 4)
        with pytest.raises(SamplerError, match="is not a column"):
            PromptGroupSampler(samples_per_group=1, strategy="reward", reward_key="score@judge").sample(s, 4)


def test_prioritized_sampler_takes_a_version_as_priority(versioned):
    from diskreplay.samplers import PrioritizedSampler

    with ReplayStore(versioned, readonly=True) as s:
        sampler = PrioritizedSampler(priority_key="rewards@judge", alpha=1.0, eps=1e-6, new_priority="column", seed=0)
        rows = sampler.sample(s, 4000)
        counts = np.bincount(rows, minlength=16)
        # priorities |judge|: 11..0 then NaN (never judged) read as eps: row 11 (judge 0) and 12-15 ~never
        assert counts[12:].sum() == 0 and counts[11] == 0
        assert counts[0] > counts[5] > counts[10] > 0


def test_a_sampler_sees_version_values_committed_after_its_first_draw(tmp_path):
    from diskreplay.samplers import live_column

    path = make_store(tmp_path / "s", n=8)
    with ReplayStore(path) as s:
        s.update([0, 1, 2, 3], {"rewards": [1.0, 0.0, 0.0, 0.0]}, version="j")
        sampler = PromptGroupSampler(samples_per_group=1, strategy="reward", reward_key="rewards@j", seed=0)
        cached = live_column("rewards@j", "reward_key")  # the per-row cache reward-based draws keep
        assert sampler.sample(s, 1, groups=[0]).tolist() == [0]
        np.testing.assert_array_equal(cached.live(s), [1, 0, 0, 0] + [np.nan] * 4)
        s.update([4, 5, 6, 7], {"rewards": [0.0, 0.0, 5.0, 0.0]}, version="j")
        assert sampler.sample(s, 1, groups=[1]).tolist() == [6]
        np.testing.assert_array_equal(cached.live(s), [1, 0, 0, 0, 0, 0, 5, 0])


def _cli_md():
    import re

    text = open(os.path.join(ROOT, "docs", "cli.md")).read()
    section = text[text.index("## Re-scoring a store"):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S), re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_the_docs_recipe_and_commands_run_as_written(tmp_path, capsys, monkeypatch):
    """docs/cli.md, "Re-scoring a store": its scorer module, its commands on a store (the second run
    skips every chunk), and its Python recipe."""
    (scorers, recipe), (commands,) = _cli_md()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scorers.py").write_text(scorers)
    sys.modules.pop("scorers", None)
    path = make_store(tmp_path / "runs" / "grpo" / "replay", n=20)
    outs = []
    for line in commands.splitlines():
        argv = line.split("#")[0].split()
        rc, out, err = cli(capsys, *argv[1:])
        assert rc == 0, (line, err)
        outs.append(out)
    assert "rescored 20 of 20" in outs[0] and "rescored 0 of 20" in outs[1]
    assert "version rewards@judge-v2: 20 rows in 1 patch" in outs[2]
    with ReplayStore(path, readonly=True) as s:
        lengths = [len(c) for c in s.read(np.arange(20), ["completion_ids"])["completion_ids"]]
    assert pq.read_table(tmp_path / "judged.parquet")["rewards"].to_pylist() == [float(n <= 4) for n in lengths]
    exec(compile(recipe, "docs/cli.md recipe", "exec"), {})


def test_pairs_and_best_of_n_pick_a_version(versioned, tmp_path, capsys):
    # judge: rows 0-11 get 11..0 (the first row of each group is best); newest: 100..115 (the last is)
    rc, _, err = cli(capsys, "best-of-n", versioned, tmp_path / "b.jsonl", "--k", "1", "--version", "rewards=judge")
    assert rc == 0, err
    best = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    assert [(b["row"], b["reward"]) for b in best] == [(0, 11.0), (4, 7.0), (8, 3.0)]  # group 3: no judged reward
    rc, _, err = cli(capsys, "best-of-n", versioned, tmp_path / "n.jsonl", "--k", "1")
    assert [json.loads(line)["row"] for line in open(tmp_path / "n.jsonl")] == [3, 7, 11, 15]
    rc, _, err = cli(capsys, "pairs", versioned, tmp_path / "p.jsonl", "--version", "rewards=judge")
    assert rc == 0, err
    pairs = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert [(p["chosen_row"], p["rejected_row"], p["margin"]) for p in pairs] == [(0, 3, 3.0), (4, 7, 3.0), (8, 11, 3.0)]
    rc, _, err = cli(capsys, "pairs", versioned, tmp_path / "x.jsonl", "--version", "rewards=nope")
    assert rc == 1 and "has no version 'nope'" in err and not os.path.exists(tmp_path / "x.jsonl")
    # the same from Python: a VersionView wherever a store goes
    from diskreplay.export import VersionView, best_of_n

    with ReplayStore(versioned, readonly=True) as s:
        res = best_of_n(VersionView(s, {"rewards": "judge"}), tmp_path / "py.jsonl", k=1)
    assert res["rows"] == 3
    assert [json.loads(line)["row"] for line in open(tmp_path / "py.jsonl")] == [0, 4, 8]


def test_the_function_may_be_named_by_its_file(tmp_path, scorer, capsys):
    path = make_store(tmp_path / "s", n=10)
    rc, out, err = cli(capsys, "rescore", path, "--column", "rewards", "--version", "v", "--python",
                       f"{tmp_path / 'scorers' / 'tscore.py'}:score")
    assert rc == 0 and "rescored 10 of 10" in out, err
    rows, want = expected(path)
    with ReplayStore(path, readonly=True) as s:
        np.testing.assert_array_equal(s.read(rows, ["rewards@v"])["rewards@v"], want)
