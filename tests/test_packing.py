"""collate_packed / pack_on_device: against a per-row reference, against each other, and against
a real model: a tiny Qwen2 gives the same per-token log-probs from a packed batch as from a padded one."""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given

import diskreplay.batching.packed as packing_module
from diskreplay import (BatchError, Collator, RaggedColumn, ReplayStore, collate, collate_packed, collate_unpadded,
                        pack_on_device)
from diskreplay.batching.packed import packed_sizes

from .test_padding import FAST, batches, ragged

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: the ways collate_packed can build a batch: numba's compiled kernels (when installed: the dev
#: extra installs it) and the numpy joins; every layout test runs both
PATHS = ("compiled", "numpy") if importlib.util.find_spec("numba") else ("numpy",)


@contextlib.contextmanager
def packing_path(path):
    """Run collate_packed on one path (DISKREPLAY_JIT is read on every call)."""
    old = os.environ.get("DISKREPLAY_JIT")
    os.environ["DISKREPLAY_JIT"] = "1" if path == "compiled" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DISKREPLAY_JIT"]
        else:
            os.environ["DISKREPLAY_JIT"] = old


def reference_packed(batch, batch_dim=True):
    """Row by row with Python lists: obviously right, and slow."""
    def rows(name):
        col = batch.get(name)
        if col is None:
            return None
        return [[] if r is None else r.tolist() for r in col]

    B = next(len(v) for v in batch.values() if v is not None)
    prompts = rows("prompt_ids") or [[] for _ in range(B)]
    completions = rows("completion_ids") or [[] for _ in range(B)]
    ids, pos, mask, cu = [], [], [], [0]
    for p, c in zip(prompts, completions):
        ids += p + c
        pos += list(range(len(p) + len(c)))
        mask += [0] * len(p) + [1] * len(c)
        cu.append(cu[-1] + len(p) + len(c))
    T = len(ids)
    shape = (1, T) if batch_dim else (T,)
    seqs = [len(p) + len(c) for p, c in zip(prompts, completions)]
    out = {"input_ids": torch.tensor(ids, dtype=torch.int64).reshape(shape),
           "position_ids": torch.tensor(pos, dtype=torch.int64).reshape(shape),
           "completion_mask": torch.tensor(mask, dtype=torch.int64),
           "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "max_seqlen": max(seqs, default=0),
           "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
           "completion_lengths": torch.tensor([len(c) for c in completions], dtype=torch.int64)}
    out.update(cu_seq_lens_q=out["cu_seqlens"], cu_seq_lens_k=out["cu_seqlens"],
               max_length_q=out["max_seqlen"], max_length_k=out["max_seqlen"])
    for name, col in batch.items():
        if name in ("prompt_ids", "completion_ids"):
            continue
        if col is None or isinstance(col, list):
            out[name] = col
        elif isinstance(col, RaggedColumn):
            stream = []
            for p, c, r in zip(prompts, completions, rows(name)):
                own = p if name.startswith("prompt_") else c
                vals = r if r else [0] * len(own)
                stream += vals + [0] * len(c) if name.startswith("prompt_") else [0] * len(p) + vals
            dtype = torch.float32 if col.values.dtype.kind == "f" else torch.int64
            out[name] = torch.tensor(stream, dtype=dtype)
            if col.validity is not None and not all(col.validity):  # rows "not computed" are flagged
                out[name + "_present"] = torch.tensor([bool(v) for v in col.validity])
        else:
            dtype = {"b": torch.bool, "i": torch.int64, "u": torch.int64}.get(col.dtype.kind)
            out[name] = torch.tensor(col.tolist(), dtype=dtype or getattr(torch, str(col.dtype)))
    return out


def assert_same(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), name
            assert (g.dtype, g.shape) == (w.dtype, w.shape), (name, g.dtype, w.dtype, g.shape, w.shape)
            assert torch.equal(g.cpu(), w.cpu()), name
        else:
            assert g == w, name


def has_tokens(batch):
    return any(batch.get(n) is not None for n in ("prompt_ids", "completion_ids"))


def aligned(batch):
    """``batch`` without the per-token columns whose side has no ids (they cannot be placed in a
    packed stream: collate_packed refuses them, tested below)."""
    out = {}
    for name, col in batch.items():
        side = "prompt_ids" if name.startswith("prompt_") else "completion_ids"
        if isinstance(col, RaggedColumn) and name != side and batch.get(side) is None:
            continue
        out[name] = col
    return out


# --------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------

@FAST
@given(batches())
def test_collate_packed_matches_reference(batch):
    batch = aligned(batch)
    if not has_tokens(batch):
        with pytest.raises(BatchError, match="prompt_ids"):
            collate_packed(batch)
        return
    for path in PATHS:
        with packing_path(path):
            for batch_dim in (True, False):
                assert_same(collate_packed(batch, batch_dim=batch_dim), reference_packed(batch, batch_dim))


@FAST
@given(batches())
def test_pack_on_device_equals_collate_packed(batch):
    batch = aligned(batch)
    if not has_tokens(batch):
        return
    unpadded = collate_unpadded(batch)
    want = collate_packed(batch)
    assert_same(pack_on_device(unpadded), want)
    assert_same(pack_on_device(unpadded, sizes=packed_sizes(unpadded)), want)


@FAST
@given(batches())
def test_packed_collator_reuses_its_buffers(batch):
    batch = aligned(batch)
    if not has_tokens(batch):
        return
    for path in PATHS:
        with packing_path(path):
            collator = Collator(layout="packed")
            first = collator(batch)
            assert_same(first, collate_packed(batch))
            again = collator(batch)
            assert_same(again, collate_packed(batch))
            for name, value in again.items():
                if isinstance(value, torch.Tensor) and value.numel():
                    assert value.data_ptr() == first[name].data_ptr(), name


@pytest.mark.skipif("compiled" not in PATHS, reason="numba is not installed")
def test_compiled_path_is_switched_by_the_environment_and_falls_back_per_column():
    from diskreplay import _jit

    with packing_path("compiled"):
        assert _jit.kernels() is not None
    with packing_path("numpy"):
        assert _jit.kernels() is None
    # dtypes the kernel does not handle (float16), strided values and int64 ids: the compiled
    # path hands those columns to the numpy joins, the others it writes itself
    wide = RaggedColumn.from_arrays([[1, 2, 3], [4]], dtype=np.float64)
    batch = {"prompt_ids": RaggedColumn(np.arange(20, dtype=np.int64)[::2], np.array([1, 3, 4])),
             "completion_ids": RaggedColumn.from_arrays([[7, 8, 9], [5]], dtype=np.int32),
             "old_per_token_logps": RaggedColumn.from_arrays([[-1, -2, -3], [-4]], dtype=np.float16),
             "completion_weights": RaggedColumn(wide.values, wide.offsets, np.array([True, False]))}
    with packing_path("compiled"):
        got = collate_packed(batch)
    with packing_path("numpy"):
        assert_same(got, collate_packed(batch))
    assert got["input_ids"].tolist() == [[2, 4, 7, 8, 9, 6, 5]]
    assert got["old_per_token_logps"].dtype == torch.float16
    assert got["completion_weights"].tolist() == [0, 0, 1, 2, 3, 0, 0]


def test_cu_seqlens_names_and_shapes_match_transformers_flattening_collator():
    from transformers import DataCollatorWithFlattening

    rows = [([5, 6], [1]), ([7], [2, 3, 4]), ([8, 9, 10], [])]
    batch = {"prompt_ids": RaggedColumn.from_arrays([p for p, _ in rows], dtype=np.int32),
             "completion_ids": RaggedColumn.from_arrays([c for _, c in rows], dtype=np.int32)}
    ours = collate_packed(batch)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": p + c} for p, c in rows], return_tensors="pt")
    for name in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        t = theirs[name]
        if isinstance(t, torch.Tensor):
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
        else:
            assert ours[name] == t, name


def test_rejects_misaligned_and_reserved_columns():
    base = {"prompt_ids": ragged([[1, 2], [3]], np.int32), "completion_ids": ragged([[4], [5, 6]], np.int32)}
    bad = dict(base, old_per_token_logps=ragged([[0.5], [0.5]], np.float32))
    with pytest.raises(BatchError, match=r"old_per_token_logps.*row 1.*1 values for 2 completion"):
        collate_packed(bad)
    with pytest.raises(BatchError, match=r"old_per_token_logps.*row 1"):
        packed_sizes(collate_unpadded(bad))
    # a per-token column without its side's ids: the error says which column to read with it
    with pytest.raises(BatchError, match=r"'prompt_token_weights' along the prompt tokens.*no 'prompt_ids'"):
        collate_packed({"completion_ids": base["completion_ids"],
                        "prompt_token_weights": ragged([[1, 1], [1]], np.float32)})
    with pytest.raises(BatchError, match=r"'old_per_token_logps' along the completion.*read 'completion_ids'"):
        collate_packed({"prompt_ids": base["prompt_ids"], "old_per_token_logps": ragged([[0.5], [0.5, 1]], np.float32)})
    with pytest.raises(BatchError, match="position_ids"):
        collate_packed(dict(base, position_ids=ragged([[0], [1]], np.int32)))
    with pytest.raises(BatchError, match="prompt_ids"):
        collate_packed({"advantages": np.zeros(2, np.float32)})


def test_rows_without_a_completion_or_a_prompt():
    batch = {"prompt_ids": ragged([[], [1, 2], [3], []], np.int32),
             "completion_ids": ragged([[4], [], [5, 6], []], np.int32),
             "old_per_token_logps": ragged([[0.5], [], [0.25, 0.75], []], np.float32)}
    got = collate_packed(batch, batch_dim=False)
    assert got["input_ids"].tolist() == [4, 1, 2, 3, 5, 6]
    assert got["position_ids"].tolist() == [0, 0, 1, 0, 1, 2]
    assert got["completion_mask"].tolist() == [1, 0, 0, 0, 1, 1]
    assert got["cu_seqlens"].tolist() == [0, 1, 3, 6, 6]
    assert got["old_per_token_logps"].tolist() == [0.5, 0, 0, 0, 0.25, 0.75]


# --------------------------------------------------------------------------
# a real model: packed log-probs equal padded log-probs
# --------------------------------------------------------------------------

def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _padded_logps(model, batch):
    """TRL's way: prompt left-padded + completion right-padded, one row per sequence."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    P = batch["prompt_ids"].shape[1]
    logits = logits[:, P - 1:-1]  # the logits that predict each completion token
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"][..., None])[..., 0]


def _packed_logps(model, packed):
    """One sequence of T tokens, rows kept apart by a block-diagonal causal mask built from cu_seqlens."""
    T = packed["input_ids"].shape[1]
    row = torch.repeat_interleave(torch.arange(len(packed["cu_seqlens"]) - 1), packed["cu_seqlens"].diff().long())
    pos = torch.arange(T)
    allowed = (row[:, None] == row[None, :]) & (pos[:, None] >= pos[None, :])
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       attention_mask=allowed[None, None]).logits[0]
    # token t is predicted by the logits at t - 1 (same row: every row has a prompt here)
    pred = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, packed["input_ids"][0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), pred])


@pytest.mark.parametrize("seed", [0, 1])
def test_tiny_qwen2_packed_logps_equal_padded_logps(seed):
    rng = np.random.default_rng(seed)
    B = 6
    plen, clen = rng.integers(1, 12, B), rng.integers(0, 15, B)
    clen[0] = 14  # a long one, so the others are padded
    batch = {"prompt_ids": ragged([rng.integers(1, 97, n) for n in plen], np.int32),
             "completion_ids": ragged([rng.integers(1, 97, n) for n in clen], np.int32)}
    model = _tiny_qwen2()
    padded = _padded_logps(model, collate(batch, pad_token_id=0))
    packed = collate_packed(batch)
    stream = _packed_logps(model, packed)
    cu, P = packed["cu_seqlens"].long(), packed["prompt_lengths"]
    for i in range(B):
        got = stream[cu[i] + P[i]:cu[i + 1]]  # row i's completion, scattered back by its boundaries
        want = padded[i, :clen[i]]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(stream[packed["completion_mask"] == 1],
                       torch.cat([stream[cu[i] + P[i]:cu[i + 1]] for i in range(B)]))


# --------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------

@cuda
def test_pack_on_device_on_cuda_is_bit_identical():
    rng = np.random.default_rng(0)
    n = rng.integers(0, 50, 64)
    batch = {"prompt_ids": ragged([rng.integers(0, 1000, k) for k in n], np.int32),
             "completion_ids": ragged([rng.integers(0, 1000, k) for k in n[::-1]], np.int32),
             "old_per_token_logps": ragged([rng.standard_normal(k) for k in n[::-1]], np.float32),
             "advantages": rng.standard_normal(64).astype(np.float32)}
    host = collate_unpadded(batch)
    sizes = packed_sizes(host)
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    got = pack_on_device(dev, sizes=sizes)
    assert all(v.is_cuda for v in got.values() if isinstance(v, torch.Tensor))
    assert_same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}, collate_packed(batch))


def test_doctests():
    result = doctest.testmod(packing_module, extraglobs={"np": np})
    assert result.attempted > 0 and result.failed == 0


def test_packed_host_and_device_paths_say_which_rows_hold_their_ids():
    """collate_packed left out prompt_ids_present / completion_ids_present, which pack_on_device (and
    the padded layout) give: a prompt never computed looked like an empty one on the host path."""
    store = ReplayStore(tempfile.mkdtemp())
    store.extend({"prompt_id": [1, 2], "prompt_ids": [[1, 2], None], "completion_ids": [[3], [4, 5]]})
    b = store.read([0, 1])
    host, device = collate_packed(b), pack_on_device(collate_unpadded(b))
    assert set(host) == set(device)
    assert host["prompt_ids_present"].tolist() == device["prompt_ids_present"].tolist() == [True, False]
    assert "completion_ids_present" not in host  # every row has its completion
    store.close()
