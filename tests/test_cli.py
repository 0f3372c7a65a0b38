"""The ``diskreplay`` command: every subcommand, its --help, exit codes, and no partial outputs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from diskreplay import ReplayStore
from diskreplay.cli import build_parser, main

from .conftest import on_a_pty_of_no_size

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["info", "export", "import", "pairs", "best-of-n", "compact", "verify", "repair"]
HAS_VERIFY = importlib.util.find_spec("diskreplay.verify") is not None


def run(*args, ok=True):
    """``python -m diskreplay ARGS`` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "diskreplay", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def make_store(path, n_groups=6, per_group=4, seed=0):
    rng = np.random.default_rng(seed)
    n = n_groups * per_group
    with ReplayStore(path) as s:
        for half in (slice(0, n // 2), slice(n // 2, n)):
            idx = range(n)[half]
            s.extend({"prompt_id": [f"q{i // per_group}" for i in idx],
                      "prompt_ids": [[2 + i // per_group, 3] for i in idx],
                      "completion_ids": [rng.integers(2, 50, 1 + i % 3).astype(np.int32) for i in idx],
                      "old_per_token_logps": [None if i == 1 else -rng.random(1 + i % 3).astype(np.float32)
                                              for i in idx],
                      "rewards": rng.random(len(idx)).astype(np.float32),
                      "policy_version": [i // 8 for i in idx]})
    return str(path)


def make_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(100)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return str(directory)


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store")


def cli(capsys, *args):
    """``main(ARGS)`` in-process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


# --------------------------------------------------------------------------
# help
# --------------------------------------------------------------------------

def test_help_in_a_real_process():
    p = run("--help")
    for cmd in COMMANDS:
        assert cmd in p.stdout


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_explains_every_option(capsys, cmd):
    rc, out, _ = cli(capsys, cmd, "--help")
    assert rc == 0 and "examples:" in out and f"diskreplay {cmd} " in out.split("examples:")[1]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    for action in sub._actions:
        assert action.help, f"{cmd}: {action.option_strings or action.dest} has no help"


def test_usage_errors_exit_2(capsys):
    assert cli(capsys, "export")[0] == 2
    assert cli(capsys, "export", "a", "b", "--format", "csv")[0] == 2
    assert cli(capsys, "nope")[0] == 2
    assert cli(capsys)[0] == 2


@pytest.mark.parametrize("args, message", [
    (["export", "{store}", "{tmp}/o.parquet", "--compression", "brotli2"], "snappy, zstd, gzip"),
    (["export", "{store}", "{tmp}/o.parquet", "--chunk-mb", "0"], "positive number of MiB"),
    (["export", "{store}", "{tmp}/o.parquet", "--chunk-mb", "-1"], "positive number of MiB"),
    (["export", "{store}", "{tmp}/o.parquet", "--chunk-mb", "nan"], "positive number of MiB"),
    (["export", "{store}", "{tmp}/o.parquet", "--limit", "-3"], "non-negative"),
    (["best-of-n", "{store}", "{tmp}/b.jsonl", "--k", "0"], "positive integer"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "--capacity", "0"], "positive integer"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "--chunk-rows", "0"], "positive integer"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "--group-key", "a", "--no-group-key"], "not allowed with"),
    # (an empty name and a name given twice were dropped quietly)
    (["export", "{store}", "{tmp}/o.parquet", "--columns", "prompt_id,,rewards"], "has an empty name"),
    (["export", "{store}", "{tmp}/o.parquet", "--columns", "prompt_id,rewards,prompt_id"], "prompt_id twice"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "--columns", "a,"], "has an empty name"),
    # checked from the arguments alone, yet they exited 1 after opening the store (issue 52, item 13)
    (["export", "{store}", "{tmp}/x.csv"], "cannot tell the output format from the name x.csv"),
    (["export", "{store}", "{tmp}/y.jsonl", "-f", "parquet"], "y.jsonl ends in .jsonl"),
    (["export", "{store}", "{tmp}/a.zarr", "--tokenizer", "{tmp}"], "--tokenizer applies to parquet"),
    (["export", "{store}", "s3://bucket/o.parquet"], "written to a local path"),
    (["export", "{store}", "{tmp}/o.parquet", "--storage-option", "region=x"], "--storage-option is for s3://"),
    (["info", "{store}", "--storage-option", "region=x"], "--storage-option is for s3://"),
    (["pairs", "{store}", "{tmp}/p.zarr"], "writes jsonl, parquet, hf"),
    (["best-of-n", "{store}", "{tmp}/b.txt"], "cannot tell the output format"),
    (["import", "{store}", "{store}"], "SRC and PATH are the same path"),
    (["import", "{tmp}/d.jsonl", "{store}", "--append", "--overwrite"], "give one of them"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "--fill-missing"], "--fill-missing applies to --append"),
    (["import", "{tmp}/d.jsonl", "{tmp}/s", "-f", "jsonl", "--split", "train"], "--format jsonl has none"),
])
def test_bad_option_values_are_usage_errors_before_any_work(capsys, store, tmp_path, args, message):
    """Checked by the parser (exit 2, one message naming the option), so nothing is opened or written."""
    before = sorted(os.listdir(tmp_path))
    rc, out, err = cli(capsys, *[a.format(store=store, tmp=tmp_path) for a in args])
    assert rc == 2 and message in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before


def test_exit_codes_are_documented(capsys):
    for args in ([], ["export"], ["import"], ["repair"]):
        rc, out, _ = cli(capsys, *args, "--help")
        assert rc == 0 and "130 interrupted" in out, args
    readme = (ROOT / "README.md").read_text()
    assert "130" in readme.split("## The `diskreplay` command")[1].split("##")[0]


# --------------------------------------------------------------------------
# each subcommand in a real process
# --------------------------------------------------------------------------

def test_info(capsys, store):
    rc, text, _ = cli(capsys, "info", store)
    assert rc == 0 and "rows        24 live" in text and "groups      6" in text and "completion_ids" in text
    info = json.loads(run("info", store, "--json").stdout)
    assert info["rows"] == 24 and info["groups"] == 6 and info["segments"] == 2
    assert info["policy_version"] == {"min": 0, "max": 2} and info["stats"]["rewards"]["count"] == 24


def test_info_says_what_the_store_takes_on_disk_besides_its_live_rows(capsys, store):
    """After compactions "on disk" said 7.9 MiB where du said 32 MiB: it counted the live rows' files only
    (a multi-writer store: 1.8 MiB against 266 MiB of retained commits' files)."""
    for _ in range(3):
        assert cli(capsys, "compact", store)[0] == 0
    with ReplayStore(store) as s:  # one segment now: compacting again is no commit
        assert len(s.manifest.segments) == 1 and s.compact()["segments_after"] == 1
        generation = s.generation
    assert cli(capsys, "compact", store)[0] == 0
    with ReplayStore(store, readonly=True) as s:
        assert s.generation == generation
    info = json.loads(run("info", store, "--json").stdout)
    du = sum(os.lstat(os.path.join(r, f)).st_size for r, _, fs in os.walk(store) for f in fs)
    assert info["disk_bytes"] == du > info["bytes"]
    rc, text, _ = cli(capsys, "info", store)
    assert rc == 0 and " live, " in text and " in all " in text


def test_commands_say_how_many_excluded_rows_they_left_out(capsys, tmp_path):
    """A resumed TRL run's discarded rows went into export, pairs and best-of-n unannounced and info did not
    list them: each now leaves them out by default and says how many, --include-excluded uses them, and
    the help says what the option does."""
    from .test_export import resumed_store

    path = resumed_store(str(tmp_path / "s"))
    rc, text, _ = cli(capsys, "info", path)
    assert rc == 0 and "excluded    16 rows [16, 32): a resumed run's discarded timeline" in text
    assert "left out below" in text and "(n=32)" in text
    rc, text, _ = cli(capsys, "info", path, "--include-excluded")
    assert rc == 0 and "counted below" in text and "(n=48)" in text
    info = json.loads(cli(capsys, "info", path, "--json")[1])
    assert info["excluded"] == {"ranges": [[16, 32]], "rows": 16, "included": False}
    for cmd, out, counted in (("export", "o.parquet", "exported 32 rows"), ("pairs", "p.jsonl", "wrote 2 pairs"),
                              ("best-of-n", "b.jsonl", "wrote 2 completions")):
        rc, text, _ = cli(capsys, cmd, path, tmp_path / out)
        assert rc == 0 and counted in text, text
        assert "left out 16 rows the store records as excluded (rows [16, 32)" in text, text
        rc, text, _ = cli(capsys, cmd, path, tmp_path / out, "--include-excluded", "--overwrite")
        assert rc == 0 and "included the rows the store records as excluded" in text, text
        rc, text, _ = cli(capsys, cmd, "--help")
        assert "--include-excluded" in text and "resumed TRL run discarded" in " ".join(text.split())
    assert "excluded" not in cli(capsys, "export", make_store(tmp_path / "plain"), tmp_path / "plain.jsonl")[1]


def test_pairs_version_window_and_its_default_in_help(capsys, store, tmp_path):
    """pairs could set a row of one policy version against one of another; --version-window W pairs only
    within windows of W versions, and --help says the default (every version pooled)."""
    rc, text, _ = cli(capsys, "pairs", "--help")
    flat = " ".join(text.split())
    assert "--version-window W" in text and "default: none, a group's rows of every policy version are pooled" in flat
    rc, text, _ = cli(capsys, "pairs", store, tmp_path / "p.jsonl", "--version-window", "1")
    assert rc == 0 and "windows of 1 policy version)" in text, text
    rows = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert rows and all(r["chosen_policy_version"] == r["rejected_policy_version"] for r in rows)
    assert cli(capsys, "pairs", store, tmp_path / "q.jsonl", "--version-window", "0")[0] == 2


def test_export_then_import_round_trip(store, tmp_path):
    out = tmp_path / "o.parquet"
    assert "exported 24 rows" in run("export", store, out, "--quiet").stdout
    assert pq.read_table(str(out)).num_rows == 24
    run("import", out, tmp_path / "back")
    with ReplayStore(store, readonly=True) as a, ReplayStore(str(tmp_path / "back"), readonly=True) as b:
        assert a.schema == b.schema and len(b) == 24
        ra, rb = a.read(a.row_ids()), b.read(b.row_ids())
        assert ra["old_per_token_logps"].to_list() == rb["old_per_token_logps"].to_list()
        assert ra["prompt_id"] == rb["prompt_id"] and ra["rewards"].tobytes() == rb["rewards"].tobytes()


def test_pairs_and_best_of_n(store, tmp_path):
    p = run("pairs", store, tmp_path / "p.jsonl", "--json")
    assert json.loads(p.stdout)["pairs"] == 6
    rows = [json.loads(x) for x in open(tmp_path / "p.jsonl")]
    assert len(rows) == 6 and all(r["chosen_reward"] > r["rejected_reward"] for r in rows)
    assert set(rows[0]) >= {"prompt_ids", "chosen_ids", "rejected_ids", "margin", "prompt_id"}
    b = run("best-of-n", store, tmp_path / "b.parquet", "--format", "parquet", "--k", "2")
    assert "wrote 12 completions" in b.stdout
    assert pq.read_table(str(tmp_path / "b.parquet")).num_rows == 12


@pytest.mark.skipif(not hasattr(ReplayStore, "compact"), reason="ReplayStore.compact is not there yet")
def test_compact(store):
    p = run("compact", store, "--json")
    assert isinstance(json.loads(p.stdout), dict)
    with ReplayStore(store, readonly=True) as s:
        assert len(s) == 24


@pytest.mark.skipif(not HAS_VERIFY, reason="diskreplay.verify is not there yet")
def test_verify_and_repair(store):
    res = json.loads(run("verify", store, "--json").stdout)
    assert res["ok"] is True
    run("repair", store, "--dry-run")


@pytest.mark.skipif(not HAS_VERIFY, reason="diskreplay.verify is not there yet")
def test_repair_dry_run_wording(capsys, store):
    with ReplayStore(store, readonly=True) as s:
        sidecar = os.path.join(store, s.manifest.segments[0].groups_file)
    os.remove(sidecar)
    rc, out, _ = cli(capsys, "repair", store, "--dry-run")
    assert rc == 0 and "would do" not in out
    head, *actions = out.strip().splitlines()
    assert head == f"{store}: dry run, nothing was changed; 'diskreplay repair {store}' would report:"
    assert actions and actions[0].startswith("  - rebuilt ") and not os.path.exists(sidecar)
    rc, out, _ = cli(capsys, "repair", store)
    assert rc == 0 and out.startswith(f"{store}: repaired:\n  - rebuilt ") and os.path.exists(sidecar)


@pytest.mark.skipif(not HAS_VERIFY, reason="diskreplay.verify is not there yet")
def test_verify_finds_damage(capsys, store):
    with ReplayStore(store, readonly=True) as s:
        seg = os.path.join(store, s.manifest.segments[0].file)
    with open(seg, "r+b") as f:
        f.seek(200)
        f.write(b"\xff" * 8)
    rc, out, _ = cli(capsys, "verify", store)
    assert rc == 1 and "problem" in out


def test_bad_jsonl_in_a_real_process(tmp_path):
    src = tmp_path / "dump.jsonl"
    src.write_text('{"prompt_id": 1, "completion_ids": [1]}\n{"prompt_id": 2, "completion_ids": \n')
    p = run("import", src, tmp_path / "s", ok=False)
    assert p.returncode == 1 and "dump.jsonl:2" in p.stderr and "--skip-bad" in p.stderr
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------
# the rest in-process: formats, options, exit codes
# --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "hf", "zarr"])
def test_export_formats(capsys, store, tmp_path, fmt):
    pytest.importorskip({"jsonl": "json", "hf": "datasets", "zarr": "zarr"}[fmt])
    rc, out, _ = cli(capsys, "export", store, tmp_path / "o", "--format", fmt, "--policy-versions", "1:",
                     "--columns", "prompt_id,completion_ids,rewards,policy_version")
    assert rc == 0 and "exported 16 rows" in out
    rc, out, _ = cli(capsys, "import", tmp_path / "o", tmp_path / "s", "--format", fmt, "--json")
    assert rc == 0 and json.loads(out)["rows"] == 16


def test_export_with_tokenizer(capsys, store, tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    rc, _, _ = cli(capsys, "export", store, tmp_path / "o.jsonl", "-f", "jsonl", "--tokenizer", tok, "--limit", "3")
    rows = [json.loads(x) for x in open(tmp_path / "o.jsonl")]
    assert rc == 0 and len(rows) == 3 and rows[0]["prompt"] == "w0 w1"
    rc, _, _ = cli(capsys, "pairs", store, tmp_path / "p.jsonl", "--tokenizer", tok, "--min-margin", "0.1")
    first = json.loads(open(tmp_path / "p.jsonl").readline())
    assert rc == 0 and set(first) >= {"prompt", "chosen", "rejected"} and "prompt_ids" not in first


def test_import_with_mapping_and_skip_bad(capsys, tmp_path):
    src = tmp_path / "dump.jsonl"
    lines = [{"uid": f"q{i // 2}", "response_tokens": [5, i], "logprobs": [-0.1, -0.2], "reward": 1.0,
              "step": 7} for i in range(6)]
    text = "\n".join(json.dumps(x) for x in lines[:3]) + "\nnot json\n" + "\n".join(json.dumps(x) for x in lines[3:])
    src.write_text(text + "\n")
    args = ["import", src, tmp_path / "s", "--map", "completion_ids=response_tokens", "--map",
            "old_per_token_logps=logprobs", "--map", "rewards=reward", "--map", "policy_version=step",
            "--group-key", "uid"]
    rc, _, err = cli(capsys, *args)
    assert rc == 1 and "dump.jsonl:4: not valid JSON" in err
    rc, out, err = cli(capsys, *args, "--skip-bad")
    assert rc == 0 and "skipped 1 bad line" in out and "dump.jsonl:4" in err
    with ReplayStore(str(tmp_path / "s"), readonly=True) as s:
        assert s.group_key == "uid" and s.num_groups == 3
        assert s.columns == ["uid", "completion_ids", "old_per_token_logps", "rewards", "policy_version"]


@pytest.mark.parametrize("args, message", [
    (["export", "{store}", "{tmp}/exists.parquet"], "already exists"),
    (["export", "{store}", "{tmp}/o.parquet", "--columns", "nope"], "'nope' is not in the store"),
    (["export", "{tmp}/no_store", "{tmp}/o.parquet"], "no diskreplay store"),
    (["export", "{store}", "{tmp}/o.jsonl", "--tokenizer", "{tmp}/bad_tok"], "does not load"),
    (["export", "{store}", "{tmp}/missing_dir/o.parquet"], "does not exist"),
    (["import", "{tmp}/dump.jsonl", "{tmp}/s", "--map", "completion_ids=nope"], "'nope' named in the mapping"),
    (["import", "{tmp}/dump.jsonl", "{tmp}/s", "--columns", "nope"], "'nope' is not in"),
    (["import", "{tmp}/nothing.jsonl", "{tmp}/s"], "does not exist"),
    (["pairs", "{store}", "{tmp}/p.jsonl", "--reward-key", "nope"], "no reward column"),
    (["best-of-n", "{store}", "{tmp}/b.jsonl", "--group-key", "rewards_nope"], "cannot group by"),
    (["info", "{tmp}/no_store"], "no diskreplay store"),
])
def test_expected_errors_exit_1_without_traceback(capsys, store, tmp_path, args, message):
    (tmp_path / "exists.parquet").write_text("x")
    (tmp_path / "bad_tok").mkdir()
    (tmp_path / "bad_tok" / "tokenizer.json").write_text("{")
    (tmp_path / "dump.jsonl").write_text('{"prompt_id": 1, "completion_ids": [1]}\n')
    before = sorted(os.listdir(tmp_path))
    rc, _, err = cli(capsys, *[a.format(store=store, tmp=tmp_path) for a in args])
    assert rc == 1 and message in err and err.startswith("diskreplay ")
    assert sorted(os.listdir(tmp_path)) == before


def test_missing_extra_is_named(capsys, store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zarr", None)
    rc, _, err = cli(capsys, "export", store, tmp_path / "a.zarr", "--format", "zarr")
    assert rc == 1 and "pip install 'diskreplay[zarr]'" in err


@pytest.mark.parametrize("exc, code", [(OSError("disk went away"), 1), (KeyboardInterrupt(), 130)])
def test_interrupted_export_leaves_nothing(capsys, store, tmp_path, monkeypatch, exc, code):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = ReplayStore.read
    calls = {"n": 0}

    def failing(self, rows, columns=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise exc
        return real(self, rows, columns)

    monkeypatch.setattr(ReplayStore, "read", failing)
    for fmt in ("parquet", "jsonl"):
        calls["n"] = 0  # --chunk-mb: chunks of ~500 bytes, so the failure comes after a first write
        rc, _, err = cli(capsys, "export", store, out_dir / f"o.{fmt}", "--format", fmt, "--chunk-mb", "0.0005")
        assert rc == code and calls["n"] == 2, err
        assert os.listdir(out_dir) == []


# --------------------------------------------------------------------------
# no command but import creates a store
# --------------------------------------------------------------------------

STORE_COMMANDS = [["info"], ["compact"], ["verify"], ["repair"], ["repair", "--dry-run"],
                  ["export", "{tmp}/o.parquet"], ["pairs", "{tmp}/p.jsonl"], ["best-of-n", "{tmp}/b.jsonl"]]


@pytest.mark.parametrize("where", ["missing", "empty dir", "file", "other dir"])
@pytest.mark.parametrize("command", STORE_COMMANDS, ids=lambda c: " ".join(c).split(" {")[0])
def test_a_path_without_a_store_is_refused_and_left_alone(capsys, tmp_path, command, where):
    target = tmp_path / "target"
    if where == "empty dir":
        target.mkdir()
    elif where == "file":
        target.write_text("not a store")
    elif where == "other dir":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    args = [command[0], target] + [a.format(tmp=tmp_path) for a in command[1:]]
    rc, out, err = cli(capsys, *args)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"diskreplay {command[0]}: error: no diskreplay store at {target} (")
    assert "Errno" not in err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_compact_of_a_file_in_a_real_process(tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    p = run("compact", tmp_path / "afile.txt", ok=False)
    assert p.returncode == 1 and "Errno 17" not in p.stderr and "no diskreplay store at" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["afile.txt"]


def test_import_still_creates_a_store(capsys, store, tmp_path):
    assert cli(capsys, "export", store, tmp_path / "o.parquet")[0] == 0
    (tmp_path / "empty").mkdir()
    rc, _, err = cli(capsys, "import", tmp_path / "o.parquet", tmp_path / "empty", "--overwrite")
    assert rc == 0, err
    with ReplayStore(str(tmp_path / "empty"), readonly=True) as s:
        assert len(s) == 24


# --------------------------------------------------------------------------
# the output format follows the output's name
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name, fmt", [("y.jsonl", "jsonl"), ("y.JSON", "jsonl"), ("y.ndjson", "jsonl"),
                                       ("y.parquet", "parquet"), ("y.pq", "parquet"), ("y.zarr", "zarr"),
                                       ("y", "hf")])
def test_export_format_comes_from_the_name(capsys, store, tmp_path, name, fmt):
    pytest.importorskip({"zarr": "zarr", "hf": "datasets"}.get(fmt, "json"))
    rc, out, err = cli(capsys, "export", store, tmp_path / name, "--json")
    assert rc == 0, err
    assert json.loads(out)["format"] == fmt
    path = tmp_path / name
    if fmt == "jsonl":
        assert [json.loads(line)["prompt_id"] for line in open(path)][:2] == ["q0", "q0"]
    elif fmt == "parquet":
        assert pq.read_table(str(path)).num_rows == 24
    elif fmt == "zarr":
        assert (path / "zarr.json").exists()
    else:
        import datasets

        assert len(datasets.load_from_disk(str(path))) == 24


def test_export_name_and_format_must_agree(capsys, store, tmp_path):
    """Usage errors, found from the arguments before any work (they exited 1, not docs/cli.md's 2)."""
    rc, _, err = cli(capsys, "export", store, tmp_path / "y.jsonl", "-f", "parquet")
    assert rc == 2 and "y.jsonl ends in .jsonl" in err and "--force" in err
    rc, _, err = cli(capsys, "export", store, tmp_path / "y.csv")
    assert rc == 2 and "cannot tell the output format" in err and "--format" in err
    rc, _, err = cli(capsys, "export", store, tmp_path / "y.jsonl.gz")
    assert rc == 2 and "compress" in err
    rc, _, err = cli(capsys, "export", store, tmp_path / "y.jsonl.gz", "-f", "jsonl")
    assert rc == 2 and "--force" in err
    rc, _, err = cli(capsys, "export", store, tmp_path / "y.csv", "-f", "jsonl", "--compression", "zstd")
    assert rc == 2 and "applies to parquet" in err  # a usage error
    assert os.listdir(tmp_path) == ["store"]
    # an explicit format for a name without a known extension, and --force
    assert cli(capsys, "export", store, tmp_path / "y.csv", "-f", "jsonl")[0] == 0
    assert len(open(tmp_path / "y.csv").readlines()) == 24
    assert cli(capsys, "export", store, tmp_path / "y.jsonl", "-f", "parquet", "--force")[0] == 0
    assert pq.read_table(str(tmp_path / "y.jsonl")).num_rows == 24


def test_pairs_and_best_of_n_take_the_format_from_the_name(capsys, store, tmp_path):
    assert cli(capsys, "pairs", store, tmp_path / "dpo.parquet")[0] == 0
    assert pq.read_table(str(tmp_path / "dpo.parquet")).num_rows == 6
    assert cli(capsys, "best-of-n", store, tmp_path / "sft.parquet", "--k", "2")[0] == 0
    assert pq.read_table(str(tmp_path / "sft.parquet")).num_rows == 12
    rc, _, err = cli(capsys, "pairs", store, tmp_path / "dpo.zarr")
    assert rc == 2 and "writes jsonl, parquet, hf" in err
    rc, _, err = cli(capsys, "best-of-n", store, tmp_path / "sft.jsonl", "-f", "parquet")
    assert rc == 2 and "--force" in err


@pytest.mark.parametrize("fmt", ["hf", "zarr"])
def test_overwrite_never_replaces_a_directory_of_other_things(capsys, store, tmp_path, fmt):
    pytest.importorskip({"hf": "datasets", "zarr": "zarr"}[fmt])
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of it")
    rc, _, err = cli(capsys, "export", store, work, "-f", fmt, "--overwrite")
    assert rc == 1 and "refusing to replace" in err
    assert os.listdir(work) == ["thesis.tex"]
    rc, _, err = cli(capsys, "import", store, work, "--overwrite")
    assert rc == 1 and "refusing to replace" in err and os.listdir(work) == ["thesis.tex"]
    # an earlier export of the same kind is replaced
    assert cli(capsys, "export", store, tmp_path / "out", "-f", fmt)[0] == 0
    assert cli(capsys, "export", store, tmp_path / "out", "-f", fmt, "--overwrite", "--limit", "3")[0] == 0


def test_group_key_errors_are_said_once(capsys, store, tmp_path):
    rc, _, err = cli(capsys, "pairs", store, tmp_path / "p.jsonl", "--group-key", "nope")
    assert rc == 1 and err.count("cannot group by") == 1 and "prompt_id" in err
    rc, _, err = cli(capsys, "pairs", store, tmp_path / "p.jsonl", "--group-key", "completion_ids")
    assert rc == 1 and "a ragged column" in err
    # a float column is a valid (if odd) key: its values, not a cast to int, are written
    rc, _, err = cli(capsys, "best-of-n", store, tmp_path / "b.parquet", "--group-key", "rewards")
    assert rc == 0, err
    t = pq.read_table(str(tmp_path / "b.parquet"))
    with ReplayStore(store, readonly=True) as s:
        assert sorted(t["rewards"].to_pylist()) == sorted(s.read(s.row_ids())["rewards"].tolist())


# --------------------------------------------------------------------------
# import --append into a store with a capacity
# --------------------------------------------------------------------------

def capped_store(path, rows=1024, capacity=1024, capacity_bytes=None):
    with ReplayStore(path, capacity=capacity, capacity_bytes=capacity_bytes) as s:
        s.extend({"prompt_id": [f"c{i // 4}" for i in range(rows)], "completion_ids": [[1, 2, 3]] * rows,
                  "rewards": np.ones(rows, dtype=np.float32)})
    return str(path)


SAME_COLUMNS = ["--columns", "prompt_id,completion_ids,rewards"]


def test_append_that_would_evict_is_refused(capsys, store, tmp_path):
    target = capped_store(tmp_path / "capped")
    with ReplayStore(target, readonly=True) as s:
        gen = s.generation
    rc, _, err = cli(capsys, "import", store, target, "--append", *SAME_COLUMNS)
    assert rc == 1 and "would evict 24 of the 1,024 rows it holds" in err and "--allow-evict" in err
    assert err.count("\n") == 1
    with ReplayStore(target, readonly=True) as s:
        assert (len(s), s.head, s.generation) == (1024, 0, gen)
    rc, out, err = cli(capsys, "import", store, target, "--append", "--allow-evict", *SAME_COLUMNS)
    assert rc == 0, err
    with ReplayStore(target, readonly=True) as s:
        assert (len(s), s.head) == (1024, 24)


def test_append_below_capacity_needs_no_flag(capsys, store, tmp_path):
    target = capped_store(tmp_path / "capped", rows=1000)
    assert cli(capsys, "import", store, target, "--append", *SAME_COLUMNS)[0] == 0
    with ReplayStore(target, readonly=True) as s:
        assert (len(s), s.head) == (1024, 0)


def test_append_jsonl_counts_the_rows_that_would_really_be_appended(capsys, tmp_path):
    """A JSONL dump's rows are counted exactly before anything is written (bad lines skipped)."""
    target = capped_store(tmp_path / "capped", rows=1000)
    src = tmp_path / "d.jsonl"
    lines = [json.dumps({"prompt_id": f"j{i}", "completion_ids": [5], "rewards": 0.5}) for i in range(30)]
    lines[3] = "not json"
    src.write_text("\n".join(lines) + "\n")
    rc, _, err = cli(capsys, "import", src, target, "--append", "--skip-bad")
    assert rc == 1 and "appending 29 rows" in err and "would evict 5 of the 1,000" in err
    with ReplayStore(target, readonly=True) as s:
        assert len(s) == 1000
    rc, out, err = cli(capsys, "import", src, target, "--append", "--skip-bad", "--allow-evict")
    assert rc == 0 and "skipped 1 bad line" in out
    with ReplayStore(target, readonly=True) as s:
        assert (len(s), s.head) == (1024, 5)


def test_append_under_a_byte_capacity_is_refused(capsys, store, tmp_path):
    with ReplayStore(str(tmp_path / "big"), capacity=None) as s:
        s.extend({"prompt_id": [f"b{i // 4}" for i in range(2000)], "completion_ids": [np.arange(50)] * 2000,
                  "rewards": np.ones(2000, dtype=np.float32)})
        nbytes = s.nbytes
    target = capped_store(tmp_path / "capped", rows=300, capacity=None, capacity_bytes=nbytes)
    with ReplayStore(target, readonly=True) as s:
        assert s.head == 0
    rc, _, err = cli(capsys, "import", tmp_path / "big", target, "--append")
    assert rc == 1 and "would evict about 300 of the 300 rows" in err
    with ReplayStore(target, readonly=True) as s:
        assert (len(s), s.head) == (300, 0)
    # the estimate was right: appended anyway, the store drops every row it had
    assert cli(capsys, "import", tmp_path / "big", target, "--append", "--allow-evict")[0] == 0
    with ReplayStore(target, readonly=True) as s:
        assert s.head == 300 and len(s) == 2000


# --------------------------------------------------------------------------
# Ctrl-C: a real process, a real SIGINT in the middle of the write
# --------------------------------------------------------------------------

# Runs the command with a slowed-down step and touches READY when it is
# reached, so that the SIGINT lands in the middle of the write whatever the
# machine's speed, instead of racing a fast export:
# - "read": every store read after the second takes >= 20 ms (200 chunks to go);
# - "zarr": zarr's own file writes (on its worker threads while the main
#   thread waits for them) take 20 ms, the third one 1 s: the signal arrives
#   while the main thread waits inside zarr, where a KeyboardInterrupt used to
#   leave zarr's workers writing into the removed temporary directory (and
#   re-creating it) before the process exited.
SLOW_CHILD = """
import pathlib, sys, time
from diskreplay import ReplayStore
from diskreplay.cli import main
mode, ready, calls = sys.argv[1], pathlib.Path(sys.argv[2]), [0]
if mode == "read":
    real = ReplayStore.read
    def read(self, rows, columns=None):
        calls[0] += 1
        if calls[0] == 3:
            ready.touch()
        if calls[0] >= 3:
            time.sleep(0.02)
        return real(self, rows, columns)
    ReplayStore.read = read
else:
    import zarr.storage._local as local
    real = local._put
    def put(path, value, exclusive=False):
        calls[0] += 1
        if calls[0] == 3:
            ready.touch()
        time.sleep(1.0 if calls[0] == 3 else 0.02)
        return real(path, value, exclusive=exclusive)
    local._put = put
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """20,000 rows (10 MB): at --chunk-mb 0.05 an export writes 200 chunks."""
    path = tmp_path_factory.mktemp("big") / "store"
    rng = np.random.default_rng(0)
    with ReplayStore(str(path)) as s:
        s.extend({"prompt_id": np.arange(20_000) // 8,
                  "completion_ids": list(rng.integers(0, 30000, (20_000, 64)).astype(np.int32)),
                  "old_per_token_logps": list(-rng.random((20_000, 64)).astype(np.float32)),
                  "rewards": rng.random(20_000)})
    return str(path)


def interrupt(tmp_path, args, out_name, slow="read"):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ready = tmp_path / "ready"
    # a job started in the background by a non-interactive shell inherits SIGINT ignored (and so would
    # the command): the child gets the default, as a command started from a terminal has
    p = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, slow, str(ready), *map(str, args)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and (out_name is None or any(f.startswith(f".{out_name}.")
                                                               for f in os.listdir(tmp_path)))):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err


@pytest.mark.parametrize("fmt, slow", [("zarr", "zarr"), ("parquet", "read"), ("jsonl", "read"), ("hf", "read")])
def test_ctrl_c_during_export_leaves_nothing(big_store, tmp_path, fmt, slow):
    pytest.importorskip({"zarr": "zarr", "hf": "datasets"}.get(fmt, "json"))
    name = "out." + {"hf": "ds"}.get(fmt, fmt)
    rc, out, err = interrupt(tmp_path, ["export", big_store, tmp_path / name, "-f", fmt, "--chunk-mb", "0.05"],
                             name, slow)
    assert rc == 130, err
    assert err == "diskreplay export: interrupted; no partial output was left\n"
    time.sleep(0.5)  # nothing may appear later either (a library thread still writing)
    assert sorted(os.listdir(tmp_path)) == ["ready"]


def test_ctrl_c_during_import_leaves_nothing(big_store, tmp_path):
    rc, out, err = interrupt(tmp_path, ["import", big_store, tmp_path / "copy", "--chunk-rows", "50"], "copy")
    assert rc == 130 and err == "diskreplay import: interrupted; no partial output was left\n"
    assert sorted(os.listdir(tmp_path)) == ["ready"]


def test_ctrl_c_during_import_append_keeps_whole_chunks(big_store, tmp_path):
    target = tmp_path / "target"
    with ReplayStore(str(target)) as s:
        s.extend({"prompt_id": [0], "completion_ids": [[1]], "old_per_token_logps": [[-0.5]], "rewards": [1.0]})
    rc, out, err = interrupt(tmp_path, ["import", big_store, target, "--append", "--chunk-rows", "50"], None)
    assert rc == 130 and err.count("\n") == 1 and "committed before it stay" in err
    with ReplayStore(str(target), readonly=True) as s:
        assert 1 < len(s) < 20_001 and (len(s) - 1) % 50 == 0


def test_a_rerun_of_import_append_says_what_it_wrote_now(capsys, store, tmp_path, monkeypatch):
    """Run again after Ctrl-C, ``import --append`` appends the rest and says how many an earlier run had;
    run once more, it writes nothing and says so (it said "imported 24 rows ... 24 of them an earlier run
    had imported already": issue 52, item 15)."""
    import diskreplay.export.importer as importer

    src, target = tmp_path / "o.parquet", tmp_path / "t"
    assert cli(capsys, "export", store, src)[0] == 0
    assert cli(capsys, "import", src, target)[0] == 0
    calls, real = [0], importer.check_interrupt

    def interrupt():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(importer, "check_interrupt", interrupt)
    rc, _, err = cli(capsys, "import", src, target, "--append", "--chunk-rows", "5")
    assert rc == 130 and "committed before it stay" in err
    monkeypatch.undo()
    with ReplayStore(str(target), readonly=True) as t:
        earlier = len(t) - 24
    assert 0 < earlier < 24
    rc, out, _ = cli(capsys, "import", src, target, "--append", "--chunk-rows", "5")
    assert rc == 0 and out.startswith(f"imported {24 - earlier} rows from "), out
    assert f"the other {earlier} rows of its 24 an earlier run had imported already" in out, out
    rc, out, _ = cli(capsys, "import", src, target, "--append", "--chunk-rows", "5")
    assert rc == 0 and out.startswith("nothing to import: an earlier run of this import had imported all 24 rows of "), out
    assert "the store holds 48 rows" in out and "imported 24" not in out, out
    with ReplayStore(str(target), readonly=True) as t:
        assert len(t) == 48


def test_demo_refuses_a_dir_whose_store_is_not_a_store_and_too_few_groups(tmp_path, capsys):
    """``--dir DIR`` replaces DIR/store only when it holds a store (an earlier run's), never a user's files."""
    from diskreplay import demo

    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "notes.txt").write_text("precious")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--dir", str(tmp_path), "--groups", "64"])
    assert exc.value.code == 2 and "is not a diskreplay store" in capsys.readouterr().err
    assert (tmp_path / "store" / "notes.txt").read_text() == "precious"
    with pytest.raises(SystemExit) as exc:
        demo.main(["--groups", "8"])
    assert exc.value.code == 2 and "--groups must be at least 64" in capsys.readouterr().err


def test_demo_says_what_is_wrong_with_its_dir_in_one_line(tmp_path, capsys):
    """A newcomer's mistakes (a file for --dir, a directory where the export goes) are one line, no traceback."""
    from diskreplay import demo

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--dir", str(tmp_path / "afile"), "--groups", "64"])
    assert exc.value.code == 2 and "is not a directory" in capsys.readouterr().err
    (tmp_path / "d" / "rollouts.parquet").mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        demo.main(["--dir", str(tmp_path / "d"), "--groups", "64"])
    assert exc.value.code == 2 and "rollouts.parquet exists and is not a file" in capsys.readouterr().err
    assert not (tmp_path / "d" / "store").exists()  # refused before any work
    assert demo.main(["--dir", str(tmp_path / "afile" / "sub"), "--groups", "64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"{tmp_path / 'afile'} is a file" in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_bad_policy_version_range_is_a_usage_error_before_any_work(store, tmp_path, capsys):
    for bad in ("abc", "3:1"):
        rc, _, err = cli(capsys, "export", store, tmp_path / "o.parquet", "--policy-versions", bad)
        assert rc == 2 and "argument --policy-versions" in err
    assert not os.path.exists(tmp_path / "o.parquet")


def test_overwrite_never_replaces_a_file_with_a_directory_output(store, tmp_path, capsys):
    """``import SRC notastore.txt --overwrite`` deleted the user's file (arguments swapped, a typo)."""
    src = tmp_path / "rows.parquet"
    assert cli(capsys, "export", store, src)[0] == 0
    mine = tmp_path / "notastore.txt"
    mine.write_text("precious")
    for args in (["import", src, mine, "--overwrite"], ["export", store, mine, "-f", "hf", "--overwrite", "--force"]):
        rc, _, err = cli(capsys, *args)
        assert rc == 1 and "it is a file, and this output is a directory" in err, err
        assert mine.read_text() == "precious"
    empty = tmp_path / "e.parquet"
    empty.mkdir()
    rc, _, err = cli(capsys, "export", store, empty, "--overwrite")
    assert rc == 1 and "it is a directory, and this output is a file" in err and empty.is_dir()


def test_info_reward_stats_with_infinities_say_what_the_mean_is_without_warnings(tmp_path, capsys):
    path = tmp_path / "s"
    with ReplayStore(str(path)) as s:
        s.extend({"prompt_id": list(range(7)), "completion_ids": [[1]] * 7,
                  "rewards": np.array([np.nan, 3, -np.inf, 0, 1, 2, 1], dtype=np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc, out, err = cli(capsys, "info", path)
    line = next(x for x in out.splitlines() if x.startswith("rewards"))
    assert rc == 0 and "mean -inf" in line and "n=6" in line and not err
    with ReplayStore(str(path)) as s:  # inf and -inf in one row of a vector column too
        s.extend({"prompt_id": [7, 8], "completion_ids": [[1]] * 2, "rewards": np.float32([1, np.inf]),
                  "rewards_per_func": np.float32([[np.inf, -np.inf], [1, 2]])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc, out, err = cli(capsys, "info", path, "--json")
    assert rc == 0 and not err
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))  # jq refuses NaN/Infinity
    assert doc["stats"]["rewards"]["mean"] is None


DROP_ROOT_OVERRIDES = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner",
                       "--inh-caps", "-dac_override,-dac_read_search,-fowner"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to make a store this process may not write")
def test_repair_dry_run_works_on_a_store_it_may_not_write(tmp_path):
    """--dry-run reports without the lock, so read access suffices (it failed opening LOCK for writing)."""
    path = tmp_path / "s"
    with ReplayStore(str(path)) as s:
        s.extend({"prompt_id": [0], "completion_ids": [[1]]})
    subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    try:
        run = lambda *a: subprocess.run(DROP_ROOT_OVERRIDES + [sys.executable, "-m", "diskreplay", "repair",
                                                               str(path), *a], capture_output=True, text=True)
        dry = run("--dry-run")
        assert dry.returncode == 0 and "nothing to repair" in dry.stdout, dry.stderr
        real = run()
        assert real.returncode == 1 and "repair needs write access" in real.stderr
        assert "Traceback" not in real.stderr and "--dry-run" in real.stderr
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)


def test_options_that_mean_nothing_are_usage_errors_not_ignored(store, tmp_path, capsys):
    """A NaN threshold selected nothing; --split, --allow-evict, --compression and a malformed --map
    were ignored or failed after parsing (exit 1, not README's 2 for a bad option)."""
    src = tmp_path / "rows.parquet"
    assert cli(capsys, "export", store, src)[0] == 0
    for args, says in [
        (["export", store, tmp_path / "a.parquet", "--min-reward", "nan"], "--min-reward: must be a finite number"),
        (["best-of-n", store, tmp_path / "b.jsonl", "--min-reward", "inf"], "--min-reward: must be a finite number"),
        (["pairs", store, tmp_path / "c.jsonl", "--min-margin", "nan"], "--min-margin: must be a finite number"),
        (["import", src, tmp_path / "d", "--map", "foo"], "--map: a column mapping must look like NEW=OLD"),
        (["import", src, tmp_path / "e", "--allow-evict"], "--allow-evict applies to --append"),
        (["import", src, tmp_path / "e", "--append", "--capacity", "3"], "--append keeps the store's own"),
        (["export", store, tmp_path / "f.jsonl", "--compression", "zstd"], "--compression applies to parquet"),
    ]:
        rc, _, err = cli(capsys, *args)
        assert rc == 2 and says in err, (args, err)
    assert not any((tmp_path / n).exists() for n in ("a.parquet", "b.jsonl", "c.jsonl", "d", "e", "f.jsonl"))
    rc, _, err = cli(capsys, "import", src, tmp_path / "g", "--split", "train")
    assert rc == 1 and "--split train" in err and "parquet, which has none" in err
    assert not (tmp_path / "g").exists()


def test_messages_of_plain_mistakes(tmp_path):
    """--overwrite was suggested for a directory it then refused to replace; a one-line JSONL error said
    "lines 1-1" and pointed at "a row number below"; a Dataset or DataFrame batch had no fix named; collate
    of a list of rows and groups=[[k], ...] raised raw AttributeError/TypeError; bool ids were stored."""
    import subprocess
    import sys

    import numpy as np

    from diskreplay import BatchError, PromptGroupSampler, ReplayStore, SamplerError, collate

    store_path = str(tmp_path / "st")
    store = ReplayStore(store_path)
    store.extend({"prompt_id": [0, 0, 1], "completion_ids": [[1], [2], [3]]})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep").write_text("x")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "diskreplay", *args], capture_output=True, text=True,
                              cwd=str(tmp_path))

    out = cli("export", store_path, str(tmp_path / "other"))
    assert out.returncode != 0 and "--overwrite" in out.stderr and "even with --overwrite" in out.stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt_id":1,"completion_ids":[1,2],"old_per_token_logps":[0.1]}\n')
    out = cli("import", str(tmp_path / "bad.jsonl"), str(tmp_path / "b1"))
    assert "bad.jsonl:1: column 'old_per_token_logps' has" in out.stderr and "below" not in out.stderr
    with pytest.raises(BatchError, match="one mapping of column to values"):
        collate([store.read([0]), store.read([1])], 0)
    with pytest.raises(SamplerError, match="1-D list of group keys"):
        PromptGroupSampler(samples_per_group=1, seed=0).sample(store, 2, groups=np.array([[0], [1]]))
    with pytest.raises(BatchError, match="holds booleans"):
        store.extend({"prompt_id": [2], "completion_ids": [np.array([True, False])]})
    pd = pytest.importorskip("pandas")
    with pytest.raises(BatchError, match="Table.from_pandas"):
        store.extend(pd.DataFrame({"prompt_id": [2], "completion_ids": [[1, 2]]}))
    store.close()


def test_warnings_are_one_line_each_in_the_command_s_words(tmp_path):
    """A damaged newest manifest: export goes on from the newest intact commit, and says so once, in one
    line (it printed Python's RuntimeWarning twice, each with the source line that raised it)."""
    path = make_store(tmp_path / "store")
    newest = sorted(os.listdir(os.path.join(path, "manifests")))[-1]
    with open(os.path.join(path, "manifests", newest), "r+b") as fh:
        fh.truncate(20)
    p = run("export", path, tmp_path / "o.parquet")
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diskreplay export: warning: "), p.stderr
    assert "RuntimeWarning" not in p.stderr and newest in lines[0]


def test_filters_that_keep_nothing_say_so(capsys, store, tmp_path):
    """--policy-versions past the store's, --min-reward above every reward: an empty output and exit 0,
    without a word."""
    rc, out, _ = cli(capsys, "export", store, tmp_path / "o.parquet", "--policy-versions", "100:")
    assert rc == 0 and "exported 0 rows" in out and "nothing matched --policy-versions 100:" in out
    rc, out, _ = cli(capsys, "best-of-n", store, tmp_path / "b.jsonl", "--min-reward", "5")
    assert rc == 0 and "nothing matched --min-reward 5.0" in out
    rc, out, _ = cli(capsys, "export", store, tmp_path / "all.parquet")
    assert rc == 0 and "nothing matched" not in out


def test_outputs_that_cannot_be_written_where_asked_say_why(capsys, store, tmp_path):
    """An output inside the store (verify then reported it as foreign), under a file ("create FILE first"),
    or at an s3:// URL (it made a local directory named "s3:")."""
    (tmp_path / "afile.txt").write_text("x")
    for out, says, code in ((os.path.join(store, "x.parquet"), "inside the store", 1),
                            (os.path.join(store, "segments", "x.parquet"), "inside the store", 1),
                            (tmp_path / "afile.txt" / "x.parquet", "is a file", 1),
                            (tmp_path / "afile.txt" / "sub" / "x.parquet", "afile.txt is a file", 1),
                            ("s3://bucket/out.parquet", "written to a local path", 2)):  # (a bad value: usage)
        before = sorted(os.listdir(tmp_path)), sorted(os.listdir(store))
        rc, _, err = cli(capsys, "export", store, out)
        assert rc == code and says in err, (out, err)
        assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(store))) == before
    assert not os.path.exists("s3:")


# --------------------------------------------------------------------------
# issue 52: a full disk, docs/cli.md's block, merging stores, a parent that is a file, a 0x0 terminal
# --------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs (a real filesystem that fills up: ENOSPC from the kernel, whatever library writes);
    skips where mounting is not allowed (not root, or a container without CAP_SYS_ADMIN)."""
    where = tmp_path / "full"
    where.mkdir()
    if not shutil.which("mount"):
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("fmt, name", [("parquet", "o.parquet"), ("jsonl", "o.jsonl"), ("hf", "o_ds"),
                                       ("zarr", "o.zarr")])
def test_an_export_to_a_full_disk_names_the_file_and_the_format(capsys, big_store, full_disk, fmt, name):
    """It said "[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device" (parquet;
    the same bare message for jsonl, hf and zarr), naming neither the output nor its format. (4,000 rows:
    about 2 MB of token ids and log-probs, twice the disk.)"""
    pytest.importorskip({"zarr": "zarr", "hf": "datasets"}.get(fmt, "json"))
    out = full_disk / name
    rc, stdout, err = cli(capsys, "export", big_store, out, "--limit", "4000")
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith(f"diskreplay export: error: cannot write the {fmt} export {out}: No space left on "
                          "device (errno 28); nothing was left behind: free space"), err
    assert os.listdir(full_disk) == []
    from diskreplay import OutputIOError
    from diskreplay.export import export

    with pytest.raises(OutputIOError) as info:
        export(big_store, out, limit=4000)
    assert info.value.errno == 28 and isinstance(info.value, OSError) and os.listdir(full_disk) == []


def test_curated_outputs_on_a_full_disk_name_the_file_too(capsys, big_store, full_disk):
    rc, _, err = cli(capsys, "best-of-n", big_store, full_disk / "sft.jsonl", "--k", "8")
    assert rc == 1 and f"cannot write the jsonl output {full_disk / 'sft.jsonl'}: No space left" in err, err
    assert os.listdir(full_disk) == []


def _cli_md_commands():
    """The ``diskreplay`` lines of docs/cli.md's command block, continuation lines joined, comments and the
    ``[--json]`` notation (an option shown as optional) left out."""
    import re

    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0].replace("\\\n", " ")
    lines = [re.sub(r"\s\[[^\]]*\]", "", line.split("#")[0]).strip() for line in block.splitlines()]
    return [line for line in lines if line.startswith("diskreplay ")]


def _merge_inputs(root):
    """What docs/cli.md's block supposes a user has: a run's store, another run's (without ``advantages``,
    with a column the first lacks), a capped store, a JSONL dump in other names, more rows, a tokenizer."""
    pytest.importorskip("transformers")
    from diskreplay.export import export_parquet
    from diskreplay.synthetic import char_tokenizer

    tok = char_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    rng = np.random.default_rng(5)

    def rows(n, first_group, version):
        ids = [rng.integers(3, len(tok), 3 + i % 5).astype(np.int32) for i in range(n)]
        return {"prompt_id": np.arange(first_group * 4, first_group * 4 + n) // 4,
                "prompt_ids": [rng.integers(3, len(tok), 4).astype(np.int32) for _ in range(n)],
                "completion_ids": ids, "old_per_token_logps": [-rng.random(len(a)).astype(np.float32) for a in ids],
                "rewards": rng.integers(0, 3, n).astype(np.float64), "advantages": rng.standard_normal(n),
                "policy_version": np.full(n, version)}

    with ReplayStore(root / "runs" / "grpo" / "replay") as s:
        for v in (99, 100, 101):
            s.extend(rows(32, v * 8, v))
    other = rows(24, 0, 7)
    del other["advantages"]
    other["ref_per_token_logps"] = [a.copy() for a in other["old_per_token_logps"]]
    with ReplayStore(root / "runs" / "other" / "replay") as s:
        s.extend(other)
    with ReplayStore(root / "runs" / "capped", capacity=64) as s:
        s.extend(rows(64, 0, 1))
    with ReplayStore(root / "more") as s:
        s.extend(rows(16, 50, 2))
    export_parquet(str(root / "more"), str(root / "more.parquet"))
    with open(root / "dump.jsonl", "w") as fh:
        for i in range(12):
            ids = rng.integers(3, 90, 2 + i % 3).tolist()
            fh.write(json.dumps({"prompt_id": i // 4, "response_tokens": ids, "logprobs": [-0.5] * len(ids),
                                 "reward": float(i % 2), "step": 3}) + "\n")


BLOCK_CHILD = """
import contextlib, io, json, shlex, sys
from diskreplay.cli import main
results = []
for command in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(shlex.split(command)[1:])
    results.append([command, rc, err.getvalue()])
    if rc:
        break
print(json.dumps(results))
"""


def test_the_command_block_of_docs_cli_md_runs_as_written(tmp_path):
    """Its merge line failed as written ("--append needs an existing store"), the --aliases line wrote to the
    store the line before had made, and stores with different columns could not be merged (issue 52, item 8).
    The lines run in order, in one process of their own (one start-up, not one per line), in a directory
    holding what the block supposes."""
    for extra in ("datasets", "zarr", "tokenizers"):  # the hf and zarr lines, the tokenizer
        pytest.importorskip(extra)
    _merge_inputs(tmp_path)
    commands = _cli_md_commands()
    assert len(commands) >= 15 and any("--append --fill-missing" in c for c in commands)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", BLOCK_CHILD, json.dumps(commands)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for command, rc, err in results:
        assert rc == 0 and "Traceback" not in err, (command, err)
    assert len(results) == len(commands)
    with ReplayStore(tmp_path / "runs" / "merged", readonly=True) as merged, \
            ReplayStore(tmp_path / "runs" / "grpo" / "replay", readonly=True) as grpo:
        assert len(merged) == len(grpo) + 24
        data = merged.read(merged.row_ids(), ["advantages", "ref_per_token_logps", "rewards"])
        assert np.isfinite(data["advantages"][:len(grpo)]).all() and np.isnan(data["advantages"][len(grpo):]).all()
        assert data["ref_per_token_logps"][0] is None and data["ref_per_token_logps"][len(grpo)] is not None


def test_merging_stores_with_different_columns(capsys, tmp_path):
    """The store's float per-row columns that the source lacks: refused by default (naming them), NaN with
    --fill-missing; a source's string column the store lacks: refused, naming --columns; an int column the
    source lacks cannot be filled. Every refusal leaves the store as it was."""
    a, b = tmp_path / "a", tmp_path / "b"
    with ReplayStore(a) as s:
        s.extend({"prompt_id": [0, 0], "completion_ids": [[1, 2], [3]], "rewards": [1.0, 0.0],
                  "advantages": [0.5, -0.5], "old_per_token_logps": [[-0.1, -0.2], [-0.3]]})
    with ReplayStore(b) as s:
        s.extend({"prompt_id": [1, 1, 1], "completion_ids": [[4], [5, 6], [7]], "rewards": [1.0, 0.0, 1.0],
                  "ref_per_token_logps": [[-0.1], [-0.3, -0.2], [-0.4]], "tag": ["x", "y", "z"],
                  "score": [3.0, 4.0, 5.0]})
    manifests = sorted(os.listdir(a / "manifests"))
    rc, _, err = cli(capsys, "import", b, a, "--append", "--columns", "prompt_id,completion_ids,rewards")
    assert rc == 1 and "has no column 'advantages'" in err and "--fill-missing" in err, err
    rc, _, err = cli(capsys, "import", b, a, "--append", "--fill-missing")
    assert rc == 1 and "'tag' (scalar string)" in err, err
    assert "--columns prompt_id,completion_ids,rewards,ref_per_token_logps,score" in err, err
    assert sorted(os.listdir(a / "manifests")) == manifests
    rc, out, err = cli(capsys, "import", b, a, "--append", "--fill-missing", "--columns",
                       "prompt_id,completion_ids,rewards,ref_per_token_logps,score")
    assert rc == 0 and "imported 3 rows" in out and "has no column(s) advantages" in out, (out, err)
    with ReplayStore(a, readonly=True) as s:
        got = s.read(s.row_ids())
        assert s.columns == ["prompt_id", "completion_ids", "rewards", "advantages", "old_per_token_logps",
                             "ref_per_token_logps", "score"]
        np.testing.assert_array_equal(got["advantages"], [0.5, -0.5, np.nan, np.nan, np.nan])
        np.testing.assert_array_equal(got["score"], [np.nan, np.nan, 3.0, 4.0, 5.0])
        assert got["old_per_token_logps"][2] is None and got["ref_per_token_logps"][0] is None
        assert got["completion_ids"].to_list() == [[1, 2], [3], [4], [5, 6], [7]]
    # an int column the source lacks has no "not computed" value, with or without --fill-missing
    c = tmp_path / "c"
    with ReplayStore(c) as s:
        s.extend({"prompt_id": [9], "completion_ids": [[1]], "policy_version": [3]})
    rc, _, err = cli(capsys, "import", b, c, "--append", "--fill-missing", "--columns", "prompt_id,completion_ids")
    assert rc == 1 and "no column 'policy_version' (scalar int64)" in err and "--map" in err, err
    with ReplayStore(c, readonly=True) as s:
        assert len(s) == 1
    from diskreplay import ExportError
    from diskreplay.export import import_rollouts

    with pytest.raises(ExportError, match="fill_missing"):
        import_rollouts(b, tmp_path / "new", fill_missing=True)


def test_a_store_under_a_file_is_refused_in_one_line(capsys, tmp_path):
    """``ReplayStore("a_file/store")`` (and so every writer, the buffer and the stream) raised a bare
    NotADirectoryError from os.makedirs; import said to "create a_file/new first", which cannot be done."""
    from diskreplay import OutputExistsError

    (tmp_path / "a_file").write_text("x")
    src = make_store(tmp_path / "src")
    for path in (tmp_path / "a_file" / "store", tmp_path / "a_file" / "deeper" / "store"):
        with pytest.raises(OutputExistsError, match=f"{tmp_path / 'a_file'} is a file, so the store"):
            ReplayStore(path)
        rc, _, err = cli(capsys, "import", src, path)
        assert rc == 1 and f"{tmp_path / 'a_file'} is a file" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a_file", "src"] and (tmp_path / "a_file").read_text() == "x"


def test_the_progress_bar_shows_on_a_terminal_that_reports_no_size(big_store, tmp_path):
    """On a pty nobody sized (0x0: ``docker exec -t``, some CI runners) tqdm's own resizing hid the bar
    entirely: a long export showed nothing until it ended."""
    pytest.importorskip("tqdm")
    code, text = on_a_pty_of_no_size(["export", big_store, str(tmp_path / "o.jsonl"), "--limit", "4000",
                                      "--chunk-mb", "0.05"])
    assert code == 0, text
    assert "export jsonl:" in text and "%|" in text and "rows/s" in text, text
    assert "exported 4,000 rows" in text


def test_s3_clients_tool_explains_its_options():
    """``python tools/s3_clients.py --help`` listed --rounds, --objects and --ranges without a word."""
    import re

    p = subprocess.run([sys.executable, str(ROOT / "tools" / "s3_clients.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for option in ("--rounds", "--objects", "--ranges"):
        line = re.search(rf"^\s+{option} N\s+(\S.*)$", p.stdout, flags=re.M)
        assert line is not None and "default" in p.stdout.split(option)[2][:300], (option, p.stdout)
