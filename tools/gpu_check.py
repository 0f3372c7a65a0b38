"""The GPU path, checked and measured in one run: a few minutes on one GPU.

    python tools/gpu_check.py [--groups 1024] [--batch-groups 64] [--batches 20] [--step-ms 30] [--dir DIR]

1. **Bit for bit**: ``pad_on_device`` and ``pack_on_device`` on CUDA against
   the host's ``collate`` / ``collate_packed`` of the same rows (every
   strategy of ``PromptGroupSampler``; floats compared as their bit
   patterns), and ``ReplayLoader(device="cuda")`` in every layout against a
   plain sample + read + collate loop on the host.
2. **Host to device**: GB/s of the loader's transfer (its pinned host
   buffers, one ``non_blocking`` copy per tensor on a side stream) against
   one plain pinned ``copy_`` of the same number of bytes, for the padded
   batch and for the unpadded payload that ``pad_on_device`` ships.
3. **Loader throughput** with a simulated training step on the GPU (a chain
   of bf16 matmuls sized to ``--step-ms``, which reads the batch): ms per
   step with the loader against the step alone, per layout.
4. **TRL's AsyncGRPOTrainer through the durable rollout buffer**: a few real
   steps (tree attention: TRL loads its flash-attn kernel from the Hub, or
   its cache) of a tiny model on samples a worker process put into a
   ``DurableRolloutQueue``; the trainer stops after a checkpoint, a second
   one resumes from it, and every sample reached a step once.

Prints a table; exits 1 on any mismatch. Without CUDA the CPU halves of the
checks still run (``device="cpu"``), every CUDA row says it was skipped, and
the exit status reflects the CPU checks only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from diskreplay import (Collator, PromptGroupSampler, ReplayLoader, ReplayStore, collate,  # noqa: E402
                        collate_packed, collate_unpadded, pack_on_device, pad_on_device)
from diskreplay.batching.packed import packed_sizes  # noqa: E402
from diskreplay.batching.padded import padded_widths  # noqa: E402
from diskreplay.samplers import STRATEGIES  # noqa: E402
from diskreplay.synthetic import rollout_stream  # noqa: E402

PAD = 0
LAYOUTS = (("padded", False), ("padded", True), ("packed", False), ("packed", True))


class Report:
    def __init__(self) -> None:
        self.failures: List[str] = []

    def row(self, check: str, result: str, detail: str = "") -> None:
        print(f"  {check:<58} {result:<10} {detail}", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.row(name, "ok" if ok else "MISMATCH", detail)
        if not ok:
            self.failures.append(name)

    def skip(self, name: str, why: str) -> None:
        self.row(name, "skipped", why)


def same_bits(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    """'' when both batches hold the same names, dtypes, shapes and bits; else what differs."""
    if set(a) != set(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor):
            x, y = x.detach().cpu(), y.detach().cpu()
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            if x.is_floating_point():  # bit patterns: -0.0 vs 0.0 or NaN payloads count
                bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
                x, y = x.view(bits), y.view(bits)
            if not torch.equal(x, y):
                return f"{name}: values differ"
        elif x != y:
            return f"{name}: {x!r} vs {y!r}"
    return ""


def make_store(path: str, groups: int) -> ReplayStore:
    if not os.path.exists(os.path.join(path, "FORMAT.json")):
        with ReplayStore(path) as store:
            for b in rollout_stream(groups, 64, 8, seed=0):
                store.extend(b)
    return ReplayStore(path, readonly=True)


def on(device: torch.device, batch: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# --------------------------------------------------------------------------- 1. bit for bit


def check_kernels(store: ReplayStore, devices: List[torch.device], B: int, report: Report) -> None:
    for strategy in STRATEGIES:
        sampler = PromptGroupSampler(num_groups=B // 8, strategy=strategy, seed=1)
        rows = sampler.sample(store, B)
        batch = store.read(rows)
        host_padded, host_packed = collate(batch, PAD), collate_packed(batch)
        unpadded = collate_unpadded(batch)
        widths, sizes = padded_widths(unpadded), packed_sizes(unpadded)
        for device in devices:
            moved = on(device, unpadded)
            diff = same_bits(pad_on_device(moved, PAD, widths=widths), host_padded)
            report.check(f"pad_on_device on {device} == collate ({strategy})", not diff, diff)
            diff = same_bits(pack_on_device(moved, sizes=sizes), host_packed)
            report.check(f"pack_on_device on {device} == collate_packed ({strategy})", not diff, diff)


def reference_stream(store: ReplayStore, layout: str, B: int, n: int) -> List[Dict[str, Any]]:
    sampler = PromptGroupSampler(num_groups=B // 8, seed=7)
    out = []
    for _ in range(n):
        rows = sampler.sample(store, B)
        batch = store.read(rows)
        b = collate_packed(batch) if layout == "packed" else collate(batch, PAD)
        b["rows"] = torch.from_numpy(rows)
        out.append(b)
    return out


def check_loader(store: ReplayStore, devices: List[torch.device], B: int, report: Report) -> None:
    n = 6
    for layout in ("padded", "packed"):
        want = reference_stream(store, layout, B, n)
        for device in devices:
            for on_device in (False, True):
                with ReplayLoader(store, PromptGroupSampler(num_groups=B // 8, seed=7), B, PAD, device=device,
                                  layout=layout, pad_on_device=on_device, num_batches=n) as loader:
                    got = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                           for b in loader]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                diffs = [same_bits(g, w) for g, w in zip(got, want)]
                bad = [f"batch {i}: {d}" for i, d in enumerate(diffs) if d]
                ok = len(got) == n and not bad
                report.check(f"ReplayLoader({layout}, {device}, pad_on_device={on_device}) == host loop",
                             ok, bad[0] if bad else f"{n} batches")


# --------------------------------------------------------------------------- 2. host to device


def _median_s(fn: Callable[[], Any], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_h2d(store: ReplayStore, device: torch.device, B: int, report: Report, n: int) -> None:
    rows = PromptGroupSampler(num_groups=B // 8, seed=3).sample(store, B)
    batch = store.read(rows)
    stream = torch.cuda.Stream(device)
    for label, build in (("padded batch", lambda c: c(batch)), ("unpadded payload", lambda c: c.unpadded(batch))):
        host = build(Collator(PAD, pin_memory=True))  # the loader's pinned host buffers
        tensors = [v for v in host.values() if isinstance(v, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flat_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def loader_copy():
            with torch.cuda.stream(stream):
                out = [t.to(device, non_blocking=True) for t in tensors]
            stream.synchronize()
            return out

        def plain_copy():
            flat_dst.copy_(flat_src, non_blocking=True)
            torch.cuda.synchronize(device)

        for _ in range(3):
            loader_copy(), plain_copy()
        ours, plain = [], []
        for _ in range(n):  # alternate, so that both meet the same bus and clocks
            ours.append(_median_s(loader_copy, 1))
            plain.append(_median_s(plain_copy, 1))
        o, p = statistics.median(ours), statistics.median(plain)
        report.row(f"H2D {label} ({nbytes / 1e6:.1f} MB, {len(tensors)} tensors)",
                   f"{nbytes / o / 1e9:.1f} GB/s", f"plain pinned copy_ {nbytes / p / 1e9:.1f} GB/s "
                   f"(loader at {p / o:.2f}x of it)")


# --------------------------------------------------------------------------- 3. throughput


def training_step(device: torch.device, step_ms: float) -> Callable[[Dict[str, Any]], None]:
    """A chain of bf16 matmuls of about ``step_ms`` that also reads the batch (as a loss would)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def chain(k: int) -> torch.Tensor:
        x = a
        for _ in range(k):
            x = x @ a
        return x

    chain(2)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    chain(20)
    torch.cuda.synchronize(device)
    per = (time.perf_counter() - t) / 20
    k = max(1, round(step_ms / 1e3 / per))

    def step(batch: Dict[str, Any]) -> None:
        x = chain(k)
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.is_cuda and v.is_floating_point():
                x = x + v.sum().to(x.dtype)  # consume the batch on the consumer's stream
        x.sum().item()  # a sync per step, as logging a loss does

    return step


def measure_throughput(store: ReplayStore, device: torch.device, B: int, step_ms: float, n: int,
                       report: Report) -> None:
    step = training_step(device, step_ms)
    empty: Dict[str, Any] = {}
    for _ in range(3):
        step(empty)
    alone = _median_s(lambda: step(empty), n)
    report.row("simulated training step alone", f"{alone * 1e3:.1f} ms", "")
    for layout, on_device in LAYOUTS:
        with ReplayLoader(store, PromptGroupSampler(num_groups=B // 8, seed=5), B, PAD, device=device,
                          layout=layout, pad_on_device=on_device) as loader:
            for _ in range(3):
                step(next(loader))
            waits, totals = [], []
            for _ in range(n):
                t0 = time.perf_counter()
                batch = next(loader)
                t1 = time.perf_counter()
                step(batch)
                totals.append(time.perf_counter() - t0)
                waits.append(t1 - t0)
        total = statistics.median(totals)
        report.row(f"loader {layout}, pad_on_device={on_device}: ms per step",
                   f"{total * 1e3:.1f} ms", f"{total / alone:.3f}x the step alone; next() waits "
                   f"{statistics.median(waits) * 1e3:.2f} ms; {B / total:,.0f} rows/s")
    # the loader alone, no step: how fast it can feed at all
    for layout, on_device in LAYOUTS:
        with ReplayLoader(store, PromptGroupSampler(num_groups=B // 8, seed=5), B, PAD, device=device,
                          layout=layout, pad_on_device=on_device) as loader:
            for _ in range(3):
                next(loader)
            per = _median_s(lambda: next(loader), n)
        report.row(f"loader {layout}, pad_on_device={on_device}, no step", f"{per * 1e3:.1f} ms",
                   f"{B / per:,.0f} rows/s")


ASYNC_MARK = 10  # a sample's first token is ASYNC_MARK + its serial: TRL's prefix tree never merges two samples

ASYNC_WORKER = """
import sys
from types import SimpleNamespace
import numpy as np
from diskreplay.integrations.trl import DurableRolloutQueue
path, n, mark = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
q = DurableRolloutQueue(path)
for i in range(n):
    rng = np.random.default_rng(i)
    ids = np.r_[mark + i, rng.integers(3, mark, 24)].astype(np.int64)
    q.put_nowait(SimpleNamespace(prompt="q", completion="a", input_ids=ids,
                                 completion_mask=np.r_[np.zeros(8, np.int64), np.ones(17, np.int64)],
                                 old_log_probs=-rng.random(25, dtype=np.float32), advantage=float(i % 3) - 1.0,
                                 model_version=0, group_id=i // 4, metrics={"reward": float(i % 2)},
                                 enqueued_at=None))
"""


def check_async_grpo(work: str, report: Report, steps: int = 4) -> None:
    """Real AsyncGRPOTrainer steps (CUDA) on samples a worker process committed to a durable buffer,
    stopped after the checkpoint at step 2 and resumed from it: each sample trained once."""
    import subprocess

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from diskreplay.integrations.trl import DurableRolloutQueue
    from diskreplay.synthetic import char_tokenizer

    batch, n = 4, 4 * (steps + 4)
    model_dir, path = os.path.join(work, "async-model"), os.path.join(work, "async-store")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=256, max_position_embeddings=128,
                                 pad_token_id=0, eos_token_id=1, bos_token_id=2)).save_pretrained(model_dir)
    DurableRolloutQueue(path).close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", ASYNC_WORKER, path, str(n), str(ASYNC_MARK)], check=True, env=env)
    trained: Dict[int, List[int]] = {}

    class Worker:
        def __init__(self, q: Any) -> None:
            self.rollout_buffer, self.metrics_queue = q, __import__("queue").Queue()

        def start(self) -> None: pass
        def stop(self) -> None: pass
        def update_model_version(self, v: int) -> None: pass
        def check_health(self, s: float) -> None: pass

    class NoWeights:
        def init_weight_transfer(self) -> None: pass
        def pause(self) -> None: pass
        def send_weights(self, it: Any) -> None: pass
        def resume(self) -> None: pass
        def destroy(self) -> None: pass

    class Recording(AsyncGRPOTrainer):
        def training_step(self, model: Any, inputs: Dict[str, Any], num_items_in_batch: Any = None) -> Any:
            ids = inputs["input_ids"][inputs["attention_mask"].bool()]
            self.now.extend((ids[ids >= ASYNC_MARK] - ASYNC_MARK).tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    class Stop(TrainerCallback):
        def __init__(self, trainer: Any, at: int) -> None:
            self.trainer, self.at = trainer, at

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trained[state.global_step] = self.trainer.now
            self.trainer.now = []
            control.should_training_stop = state.global_step >= self.at

    def life(stop_at: int, resume: Any) -> None:
        q = DurableRolloutQueue(path)
        args = AsyncGRPOConfig(output_dir=os.path.join(work, "async-out"), per_device_train_batch_size=batch,
                               max_steps=steps, save_strategy="steps", save_steps=2, token_budget=0, report_to=[],
                               learning_rate=1e-4, disable_tqdm=True, max_staleness=100,
                               use_cpu=not torch.cuda.is_available())  # (a CPU run stops at the kernel)
        trainer = Recording(model=model_dir, args=args, processing_class=char_tokenizer(),
                            train_dataset=Dataset.from_dict({"prompt": ["unused"]}), rollout_worker=Worker(q),
                            weight_transfer=NoWeights())
        trainer.now = []
        q.attach(trainer)
        trainer.add_callback(Stop(trainer, stop_at))
        trainer.train(resume_from_checkpoint=resume)
        q.close()

    name = f"AsyncGRPOTrainer {steps} steps, stopped at 3, resumed from 2"
    t = time.perf_counter()
    try:
        life(3, None)                      # steps 1-3; checkpoint-2 holds the cursor; step 3 is not saved
        life(steps, os.path.join(work, "async-out", "checkpoint-2"))
    except Exception as exc:  # the kernel comes from the Hub: a machine that cannot reach it has no step to run
        if "kernel" in f"{type(exc).__name__} {exc}".lower() or isinstance(exc, (OSError, ImportError)):
            report.skip(name, f"TRL's attention kernel did not load ({type(exc).__name__}: {str(exc)[:100]}); "
                              "without the Hub: fetch kernels-community/flash-attn3 into the HF cache and set "
                              "HF_HUB_OFFLINE=1")
            return
        raise
    lineage = [s for step in range(1, steps + 1) for s in trained[step]]
    report.check(name, sorted(lineage) == list(range(steps * batch)),  # none twice, none lost
                 f"{len(lineage)} samples trained, {len(set(lineage))} distinct, in "
                 f"{time.perf_counter() - t:.0f} s")


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a positive ``kind`` (a usage error, exit status 2, otherwise)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive {'integer' if kind is int else 'number'}, "
                                             f"got {text!r}")
        return value
    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=_positive(int), default=1024, metavar="N",
                   help="prompt groups of 8 rows in the synthetic store (default: %(default)s)")
    p.add_argument("--batch-groups", type=_positive(int), default=64, metavar="N",
                   help="groups per batch, 8 rows each (default: %(default)s)")
    p.add_argument("--batches", type=_positive(int), default=20, metavar="N",
                   help="timed batches per measurement (default: %(default)s)")
    p.add_argument("--step-ms", type=_positive(float), default=30.0, metavar="MS",
                   help="milliseconds of the simulated training step on the GPU (default: %(default)s)")
    p.add_argument("--dir", metavar="DIR",
                   help="work directory, the store made in DIR/store and kept (default: a temporary one, removed "
                        "at the end)")
    args = p.parse_args(argv)
    B = args.batch_groups * 8
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-gpu-check-")
    report = Report()
    cuda = torch.cuda.is_available()
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if cuda else [])
    print(f"diskreplay GPU check: torch {torch.__version__}, "
          + (f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if cuda else "no CUDA")
          + f"; {args.groups * 8} rows, batches of {B}", flush=True)
    try:
        t = time.perf_counter()
        store = make_store(os.path.join(work, "store"), args.groups)
        print(f"  store ready in {time.perf_counter() - t:.1f} s ({store.nbytes / 1e6:.0f} MB)\n", flush=True)
        print("1. results on the device, bit for bit against the host")
        check_kernels(store, devices, B, report)
        check_loader(store, devices, B, report)
        print("\n2. host to device")
        if cuda:
            measure_h2d(store, devices[-1], B, report, args.batches)
        else:
            report.skip("H2D GB/s, pinned ring vs plain pinned copy_", "no CUDA on this machine")
        print("\n3. loader throughput with a simulated training step")
        if cuda:
            measure_throughput(store, devices[-1], B, args.step_ms, args.batches, report)
        else:
            report.skip("loader + simulated GPU training step", "no CUDA on this machine")
        store.close()
        print("\n4. TRL's AsyncGRPOTrainer through the durable rollout buffer")
        if cuda:
            check_async_grpo(work, report)
        else:
            report.skip("AsyncGRPOTrainer steps with DurableRolloutQueue", "no CUDA on this machine (its tree "
                        "attention's kernel needs it; tests/test_trl_async_buffer.py runs the rest on CPU)")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if report.failures:
        print(f"\nFAILED: {len(report.failures)} mismatch(es): {report.failures}")
        return 1
    print("\nall checks passed" + ("" if cuda else " (CPU only: the CUDA checks were skipped, see above)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
