"""tools/gpu_check.py runs here (its CPU half; the CUDA rows say they were skipped) and can fail."""

from __future__ import annotations

import importlib.util
import os

import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu_check.py")
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_runs_and_passes(tmp_path, capsys):
    rc = gpu_check.main(["--groups", "24", "--batch-groups", "4", "--batches", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "pack_on_device on cpu == collate_packed (variance)" in out
    assert "ReplayLoader(packed, cpu, pad_on_device=True) == host loop ok" in out
    if not torch.cuda.is_available():
        assert out.count("no CUDA on this machine") == 3
        assert "AsyncGRPOTrainer steps with DurableRolloutQueue" in out


def test_bit_comparison_sees_what_equality_would_not():
    same_bits = gpu_check.same_bits
    assert same_bits({"x": torch.tensor([0.0, 1.0])}, {"x": torch.tensor([0.0, 1.0])}) == ""
    assert "values differ" in same_bits({"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])})
    assert "int32" in same_bits({"x": torch.tensor([1], dtype=torch.int32)}, {"x": torch.tensor([1])})
    assert "names differ" in same_bits({"x": None}, {"y": None})
    assert "3 vs 4" in same_bits({"max_seqlen": 3}, {"max_seqlen": 4})


def test_a_mismatch_fails_the_run(tmp_path, monkeypatch, capsys):
    real = gpu_check.pack_on_device

    def off_by_one(unpadded, **kw):
        out = real(unpadded, **kw)
        out["input_ids"] = out["input_ids"] + 1
        return out

    monkeypatch.setattr(gpu_check, "pack_on_device", off_by_one)
    rc = gpu_check.main(["--groups", "24", "--batch-groups", "4", "--batches", "2", "--dir", str(tmp_path)])
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().out
