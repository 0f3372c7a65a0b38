"""RolloutStream(require=[...]): rows (whole groups) go out only once the named columns have values
for them, in the order they became ready, exactly once across a saved and resumed cursor."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay.errors import ArgumentError
from diskreplay.stream import RolloutStream


def _rows(prompts, rewards=None, ref=None):
    n = len(prompts)
    batch = {"prompt_id": list(prompts), "completion_ids": [[7, 8]] * n}
    if rewards is not None:
        batch["rewards"] = list(rewards)
    if ref is not None:
        batch["ref_per_token_logps"] = ref
    return batch


@pytest.fixture
def store(tmp_path):
    with ReplayStore(str(tmp_path / "s"), multi_writer=True) as s:
        yield s


def test_a_row_without_a_value_in_a_required_column_is_not_handed_out(store):
    store.extend(_rows([1, 2]))                                   # before the column existed: NaN
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert stream.next(1, timeout=0) is None                      # the store has no rewards column yet
    store.extend(_rows([3, 4, 5], rewards=[1.0, np.nan, 0.5]))    # row 3 has no value
    assert stream.next(2, timeout=0).tolist() == [2, 4]
    assert stream.next(1, timeout=0) is None
    waiting = stream.incomplete_groups()
    assert sorted(int(g["rows"][0]) for g in waiting) == [0, 1, 3]
    assert all(g["key"] is None and g["missing"]["rewards"].tolist() == g["rows"].tolist() for g in waiting)
    assert stream.stats()["waiting"] == 3 and stream.stats()["handed_out"] == 2


def test_a_group_waits_for_every_row_and_every_required_column(store):
    stream = RolloutStream(store, "t", group_size=2, require=["rewards", "ref_per_token_logps"])
    store.extend(_rows([1, 1, 2, 2, 3], rewards=[1.0, 2.0, 3.0, 4.0, 5.0],
                       ref=[[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], None, [0.1, 0.1]]))
    assert stream.next(2, timeout=0).tolist() == [0, 1]
    assert stream.next(2, timeout=0) is None                      # row 3 has no reference log-probs
    by_key = {g["key"]: g for g in stream.incomplete_groups()}
    assert by_key[2]["rows"].tolist() == [2, 3]
    assert by_key[2]["missing"]["ref_per_token_logps"].tolist() == [3]
    assert by_key[2]["missing"]["rewards"].tolist() == []
    assert by_key[3]["rows"].tolist() == [4]                      # short of rows; its one row is complete
    assert {k: v.tolist() for k, v in by_key[3]["missing"].items()} == {"rewards": [], "ref_per_token_logps": []}
    # "position" (what the writers' back-pressure reads) counts the waiting group like an incomplete one
    assert stream.state_dict()["position"] == 5 and sorted(stream.state_dict()["incomplete"].tolist()) == [2, 3, 4]
    assert stream.drop_incomplete(0) == 3 and stream.stats()["dropped_incomplete"] == 3


def test_a_required_column_only_ever_missing_per_row(store):
    # a per-token column's null rows (validity False), next to rows that carry it
    store.extend(_rows([1, 2, 3], rewards=[1.0, 2.0, 3.0], ref=[None, [0.1, 0.2], None]))
    stream = RolloutStream(store, "t", group_size=1, require="ref_per_token_logps")
    assert stream.require == ("ref_per_token_logps",)
    assert stream.next(1, timeout=0).tolist() == [1]
    assert stream.next(1, timeout=0) is None


@pytest.mark.parametrize("bad", [[""], [3], ["x" * 300], 5, [None]])
def test_a_name_that_cannot_be_a_column_is_refused(store, bad):
    with pytest.raises(ArgumentError, match="require"):
        RolloutStream(store, "t", group_size=1, require=bad)
    assert "stream.t" not in store.manifest.states                # nothing committed


def test_the_cursor_keeps_the_waiting_rows_and_their_order_across_a_resume(store):
    store.extend(_rows([1, 2, 3]))
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    store.extend(_rows([4, 5, 6], rewards=[1.0, 2.0, 3.0]))
    assert stream.next(1, timeout=0).tolist() == [3]
    stream.save()
    again = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert again.next(2, timeout=0).tolist() == [4, 5]
    assert again.next(1, timeout=0) is None
    assert sorted(int(g["rows"][0]) for g in again.incomplete_groups()) == [0, 1, 2]
    # the same cursor without require: the waiting rows go out (nothing was lost)
    plain = RolloutStream(store, "plain", group_size=1)
    plain.load_state_dict(again.state_dict())
    assert plain.next(3, timeout=0).tolist() == [0, 1, 2]


def test_a_poll_reads_nothing_until_a_commit_and_never_rereads_ready_rows(store):
    reads = []
    read = store.read

    def counting(rows, columns=None, **kw):
        reads.append((np.asarray(rows).tolist(), columns))
        return read(rows, columns=columns, **kw)

    store.extend(_rows([1, 2]))
    store.extend(_rows([3, 4], rewards=[1.0, 2.0]))
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    store.read = counting
    assert stream.next(1, timeout=0).tolist() == [2]
    assert reads == [([0, 1, 2, 3], ["rewards"])]
    reads.clear()
    assert stream.next(1, timeout=0).tolist() == [3]              # known ready: no read
    assert stream.next(1, timeout=0) is None
    assert reads == []                                            # no commit since: no read
    store.extend(_rows([5], rewards=[3.0]))
    assert stream.next(1, timeout=0).tolist() == [4]
    assert reads == [([0, 1, 4], ["rewards"])]                    # only the rows not known ready


def test_the_docs_example_runs(tmp_path, capsys):
    """docs/streams.md's example of require=, run as written (given ``path``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "streams.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "require=" in b]
    exec(compile(textwrap.dedent(code), "docs/streams.md require block", "exec"), {"path": str(tmp_path / "s")})
    assert capsys.readouterr().out.splitlines()[:2] == ["[0 1]", "{'rewards': array([2])}"]
