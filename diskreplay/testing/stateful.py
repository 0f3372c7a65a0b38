"""A hypothesis state machine: writers of one store against a plain in-memory model.

Two or three writers (separate ``ReplayStore`` objects of one multi-writer
store, as separate processes would hold) interleave ``extend`` with and
without tokens (and retries of the same token), ``compact``, the merges of
small segments that follow appends, and reopens. After every step a fresh
reader must see exactly the model's live rows, bit-exact, and every token
must map to the rows it first got. Run it from a test module::

    from diskreplay.testing.stateful import WritersMachine
    TestWriters = WritersMachine.TestCase

Subclass and set ``MULTI_WRITER = False`` / ``WRITERS = 1`` to run the same
machine on a single-writer store. The store lives in a fresh temporary directory; another backend
overrides :meth:`WritersMachine.new_location`, :meth:`~WritersMachine.store_options` and
:meth:`~WritersMachine.remove_location` (:class:`InMemory` does, for ``memory://``)::

    class MemoryWriters(InMemory, WritersMachine):
        pass
    TestMemoryWriters = MemoryWriters.TestCase
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from typing import Any, Dict, List, Optional

from ..errors import MissingDependencyError

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ImportError as exc:  # pragma: no cover - the suite runs with hypothesis
    raise MissingDependencyError("diskreplay.testing.stateful is a hypothesis state machine and needs hypothesis, "
                                 f"which is not installed ({exc}); install it with pip install hypothesis") from None

from ..storage import MemoryStorage
from ..store import MergePolicy, ReplayStore
from .workload import batch_for, check_rows, token_for

_MEMORY_NAMES = itertools.count()


class WritersMachine(RuleBasedStateMachine):
    """Many writers of one store against a list of row tags and a dict of tokens."""

    MULTI_WRITER = True
    WRITERS = 3

    def __init__(self) -> None:
        super().__init__()
        self.dir: Optional[str] = None
        self.writers: List[ReplayStore] = []

    @initialize(capacity=st.sampled_from([None, 25]), writers=st.integers(2, 3))
    def setup(self, capacity: Optional[int], writers: int) -> None:
        self.dir = self.new_location()
        self.capacity = capacity
        n = min(writers, self.WRITERS) if self.MULTI_WRITER else 1
        # merges after every third small append: the machine meets them (and their conflicts) constantly
        self.policy = MergePolicy(fanin=3, ratio=2)
        self.writers = [self._open(multi_writer=self.MULTI_WRITER)] + [self._open() for _ in range(n - 1)]
        self.model: List[str] = []  # tag of every row ever appended, by row id
        self.tokens: Dict[str, List[int]] = {}
        self.sent: Dict[str, int] = {}  # token -> step of the batch it names
        self.steps = [0] * n

    def new_location(self) -> str:
        """Where each run's store lives: a fresh temporary directory (override for another backend,
        e.g. a fresh ``s3://`` prefix)."""
        return tempfile.mkdtemp(prefix="diskreplay-machine-")

    def store_options(self) -> Dict[str, Any]:
        """Keyword arguments every ``ReplayStore`` of the run gets besides its options (an object
        store's ``storage_options`` and ``cache_dir``)."""
        return {}

    def remove_location(self, location: str) -> None:
        """Remove a run's store once it is checked."""
        shutil.rmtree(location, ignore_errors=True)

    def _open(self, **kw) -> ReplayStore:
        return ReplayStore(self.dir, capacity=self.capacity, merge_policy=self.policy, **kw, **self.store_options())

    @property
    def head(self) -> int:
        return 0 if self.capacity is None else max(0, len(self.model) - self.capacity)

    @rule(data=st.data(), rows=st.integers(1, 6), with_token=st.booleans())
    def extend(self, data, rows: int, with_token: bool) -> None:
        w = data.draw(st.integers(0, len(self.writers) - 1), label="writer")
        step = self.steps[w]
        self.steps[w] += 1
        batch = batch_for(w, step, rows)
        token = token_for(w, step) if with_token else None
        got = self.writers[w].extend(batch, token=token)
        assert got.tolist() == list(range(len(self.model), len(self.model) + rows)), got
        self.model += batch["tag"]
        if token is not None:
            self.tokens[token] = got.tolist()
            self.sent[token] = step

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def retry(self, data) -> None:
        """A worker re-sends a batch it already committed (after a crash, say), from any writer."""
        token = data.draw(st.sampled_from(sorted(self.tokens)), label="token")
        w = int(token[1:token.index(":")])
        rows = len(self.tokens[token])
        by = data.draw(st.integers(0, len(self.writers) - 1), label="by")
        before = len(self.model)
        got = self.writers[by].extend(batch_for(w, self.sent[token], rows), token=token)
        assert got.tolist() == self.tokens[token]
        assert self.writers[by].next_row == before

    @rule(data=st.data())
    def compact(self, data) -> None:
        w = data.draw(st.integers(0, len(self.writers) - 1), label="writer")
        self.writers[w].compact()

    @rule(data=st.data())
    def reopen(self, data) -> None:
        w = data.draw(st.integers(0, len(self.writers) - 1), label="writer")
        self.writers[w].close()
        self.writers[w] = self._open()

    @invariant()
    def readers_see_the_model(self) -> None:
        if self.dir is None:
            return
        with ReplayStore(self.dir, readonly=True, **self.store_options()) as reader:
            assert (reader.head, reader.next_row) == (self.head, len(self.model))
            rows = reader.row_ids()
            if rows.size:
                assert reader.read(rows, ["tag"])["tag"] == self.model[self.head:]
                assert check_rows(reader, rows) is None
            keys = reader.group_index()
            assert sum(len(keys.group(g)) for g in range(len(keys))) == len(rows)

    def teardown(self) -> None:
        for s in self.writers:
            s.close()
        if self.dir is not None:
            from ..verify import verify_store

            report = verify_store(self.dir, storage_options=self.store_options().get("storage_options"))
            self.remove_location(self.dir)
            assert report["ok"], report["problems"]


class SingleWriterMachine(WritersMachine):
    """The same machine on a single-writer store (one writer)."""

    MULTI_WRITER = False
    WRITERS = 1


class InMemory:
    """Mixed in before a machine: each run's store is a fresh ``memory://`` name (its writers are
    handles of one name in this process, as processes of one directory), dropped after the run."""

    def new_location(self) -> str:
        return f"memory://diskreplay-machine-{next(_MEMORY_NAMES)}"

    def remove_location(self, location: str) -> None:
        MemoryStorage(location).destroy()


__all__ = ["InMemory", "SingleWriterMachine", "WritersMachine"]
