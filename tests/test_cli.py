"""The ``diskreplay`` command: every subcommand, its --help, exit codes, and no partial outputs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from diskreplay import ReplayStore
from diskreplay.cli import build_parser, main

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


# --------------------------------------------------------------------------
# each subcommand in a real process
# --------------------------------------------------------------------------

def test_info(capsys, store):
    rc, text, _ = cli(capsys, "info", store)
    assert rc == 0 and "rows        24 live" in text and "groups      6" in text and "completion_ids" in text
    info = json.loads(run("info", store, "--json").stdout)
    assert info["rows"] == 24 and info["groups"] == 6 and info["segments"] == 2
    assert info["policy_version"] == {"min": 0, "max": 2} and info["stats"]["rewards"]["count"] == 24


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
    (["export", "{store}", "{tmp}/o.parquet", "--policy-versions", "x:y"], "policy-version range"),
    (["export", "{tmp}/no_store", "{tmp}/o.parquet"], "no diskreplay store"),
    (["export", "{store}", "{tmp}/o.jsonl", "--tokenizer", "{tmp}/bad_tok"], "does not load"),
    (["export", "{store}", "{tmp}/missing_dir/o.parquet"], "does not exist"),
    (["import", "{tmp}/dump.jsonl", "{tmp}/s", "--map", "completion_ids=nope"], "'nope' named in the mapping"),
    (["import", "{tmp}/dump.jsonl", "{tmp}/s", "--map", "completion_ids"], "NEW=OLD"),
    (["import", "{tmp}/dump.jsonl", "{tmp}/s", "--columns", "nope"], "'nope' is not in"),
    (["import", "{tmp}/nothing.jsonl", "{tmp}/s"], "does not exist"),
    (["pairs", "{store}", "{tmp}/p.jsonl", "--reward-key", "nope"], "no reward column"),
    (["best-of-n", "{store}", "{tmp}/b.jsonl", "--k", "0"], "positive"),
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
