"""segment: pure helpers of the page hints."""

import numpy as np
from hypothesis import given, settings, strategies as st

from diskreplay.segment import coalesce


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 500)), max_size=40), st.integers(0, 300))
def test_coalesce_covers_every_range_with_disjoint_spans_further_apart_than_the_gap(ranges, gap):
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    ends = np.array([a + n for a, n in ranges], dtype=np.int64)
    lo, hi = coalesce(starts, ends, gap)
    assert np.all(np.diff(lo) > 0) and np.all(lo[1:] > hi[:-1] + gap)   # sorted, disjoint, apart
    for a, b in zip(starts, ends):
        i = np.searchsorted(lo, a, side="right") - 1
        assert i >= 0 and lo[i] <= a and b <= hi[i]                       # each range lies in one span
    covered = sum(int(b - a) for a, b in zip(lo, hi))
    union = len(set().union(*[range(a, b) for a, b in zip(starts, ends)])) if ranges else 0
    assert covered <= union + gap * max(len(lo) and len(ranges) - 1, 0)  # only gaps are added
