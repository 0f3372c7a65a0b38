import itertools
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay
from diskreplay import DiskReplayError, ReplayStore
from diskreplay.samplers import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplacementWarning,
                                 SamplerError, _variance_ranking)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(diskreplay.__file__)))


def put(store, keys, rewards=None, versions=None, advantages=None, **extra):
    """Append one row per key; returns the new row ids."""
    n = len(keys)
    batch = {"prompt_id": list(keys), "completion_ids": [[1, 2]] * n,
             "rewards": np.asarray(rewards if rewards is not None else np.zeros(n), dtype=np.float32),
             "advantages": np.asarray(advantages if advantages is not None else np.ones(n), dtype=np.float32),
             "policy_version": list(versions) if versions is not None else [0] * n}
    batch.update(extra)
    return store.extend(batch)


@pytest.fixture
def store(tmp_path):
    with ReplayStore(tmp_path / "s", group_key="prompt_id") as s:
        yield s


def groups_of(rows, k):
    return [r.tolist() for r in np.asarray(rows).reshape(-1, k)]


# --------------------------------------------------------------------------- within-group strategies


def test_recency_takes_newest_rows_newest_first(store):
    put(store, ["a", "b", "a", "b", "a"])   # rows 0..4
    put(store, ["a", "b", "b"])             # rows 5..7
    s = PromptGroupSampler.recency(samples_per_group=2, seed=0)
    assert groups_of(s.sample(store, 4, groups=["a", "b"]), 2) == [[5, 4], [7, 6]]
    assert groups_of(s.sample(store, 4, groups=["b", "a"]), 2) == [[7, 6], [5, 4]]


def test_reward_highest_first_ties_by_recency_nan_lowest(store):
    put(store, ["g"] * 6, rewards=[0.5, np.nan, 2.0, 0.5, -1.0, 2.0])
    s = PromptGroupSampler.reward(num_groups=1, seed=0)
    assert s.sample(store, 4, groups=["g"]).tolist() == [5, 2, 3, 0]
    assert s.sample(store, 6, groups=["g"]).tolist() == [5, 2, 3, 0, 4, 1]


def test_variance_hand_made(store):
    put(store, ["g"] * 6, rewards=[0.0, 0.2, 1.0, 0.9, 0.0, 0.5])
    s = PromptGroupSampler.variance(num_groups=1, seed=0)
    # 2 rows: a 0 and the 1.0; 4 rows: two 0s with 1.0 and 0.9 (var .2025) beats 0, .2, .9, 1 (.1725)
    assert s.sample(store, 2, groups=["g"]).tolist() == [2, 0]
    assert s.sample(store, 4, groups=["g"]).tolist() == [2, 3, 4, 0]


def test_variance_tie_prefers_larger_total(store):
    # binary rewards: {0,0,1} and {0,1,1} have the same variance; the larger total wins
    put(store, ["g"] * 6, rewards=[0, 0, 0, 1, 1, 1])
    assert PromptGroupSampler.variance(num_groups=1).sample(store, 3, groups=["g"]).tolist() == [5, 4, 0]


def test_variance_all_equal_rewards_takes_newest(store):
    put(store, ["g"] * 5, rewards=[1.0] * 5)
    assert PromptGroupSampler.variance(num_groups=1).sample(store, 3, groups=["g"]).tolist() == [4, 3, 2]


def brute_force(values, k):
    """Best (variance, total) over all k-subsets: max variance, then max total within rounding."""
    best = None
    for c in itertools.combinations(values, k):
        v, t = np.var(np.array(c, dtype=np.float64)), float(np.sum(c, dtype=np.float64))
        best = (v, t) if best is None else best
        if v > best[0] + 1e-9:
            best = (v, t)
        elif abs(v - best[0]) <= 1e-9 and t > best[1]:
            best = (max(v, best[0]), t)
    return best


group_rewards = st.lists(st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]),
                                   st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 2)),
                                   st.just(float("nan"))), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(group_rewards, min_size=1, max_size=4), k=st.integers(1, 6))
def test_variance_matches_brute_force(groups, k):
    cand = np.arange(sum(len(g) for g in groups), dtype=np.int64) + 100
    seg = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    r = np.concatenate([np.array(g, dtype=np.float64) for g in groups])
    n = np.array([len(g) for g in groups])
    first = np.concatenate([[0], np.cumsum(n)])
    ranked, pos = _variance_ranking(cand, seg, r, n, first, k)
    assert pos.shape == (len(groups), k)
    for j, g in enumerate(groups):
        rows = ranked[pos[j]]
        own = cand[first[j]:first[j + 1]]
        assert np.isin(rows, own).all()
        vals = r[rows - 100]
        finite = [x for x in g if np.isfinite(x)]
        if len(finite) >= k:
            assert len(set(rows.tolist())) == k and np.isfinite(vals).all()
            best_var, best_total = brute_force(finite, k)
            assert np.var(vals) == pytest.approx(best_var, abs=1e-7)
            assert vals.sum() == pytest.approx(best_total, abs=1e-7)
            assert (np.diff(vals) <= 0).all()  # highest reward first
        else:
            # every finite reward is used before any non-finite one, none before all are used once
            got = rows[:min(k, len(g))]
            assert len(set(got.tolist())) == len(got)
            assert np.isfinite(r[got[:len(finite)] - 100]).all()


def test_random_strategy_no_repeats_and_uniform(store):
    put(store, ["g"] * 8 + ["h"] * 8)
    s = PromptGroupSampler(samples_per_group=4, seed=3)
    counts = np.zeros(16)
    for _ in range(400):
        out = groups_of(s.sample(store, 8), 4)
        for grp in out:
            assert len(set(grp)) == 4
            assert all(r < 8 for r in grp) or all(r >= 8 for r in grp)
            counts[grp] += 1
    assert counts.min() > 140 and counts.max() < 260  # expected 200 each
    assert s.sample_counts(np.arange(16)).tolist() == counts.astype(int).tolist()


# --------------------------------------------------------------------------- sizes, groups, errors


def test_infers_other_size_and_validates(store):
    put(store, [i // 4 for i in range(32)])
    rows = PromptGroupSampler(num_groups=4, seed=0).sample(store, 16)
    assert rows.dtype == np.int64 and rows.shape == (16,)
    assert all(len({r // 4 for r in g}) == 1 for g in groups_of(rows, 4))   # 4 groups of 4
    assert len({r // 4 for r in rows.tolist()}) == 4                        # distinct groups
    rows = PromptGroupSampler(samples_per_group=2, seed=0).sample(store, 16)
    assert len({r // 4 for r in rows.tolist()}) == 8

    with pytest.raises(SamplerError, match="exactly one"):
        PromptGroupSampler(num_groups=2, samples_per_group=2)
    with pytest.raises(SamplerError, match="exactly one"):
        PromptGroupSampler()
    with pytest.raises(SamplerError, match="num_groups"):
        PromptGroupSampler(num_groups=0)
    with pytest.raises(SamplerError, match="strategy"):
        PromptGroupSampler(num_groups=2, strategy="best")
    with pytest.raises(SamplerError, match="not divisible"):
        PromptGroupSampler(num_groups=3).sample(store, 16)
    with pytest.raises(SamplerError, match="batch_size"):
        PromptGroupSampler(num_groups=2).sample(store, 0)
    err = pytest.raises(ValueError, PromptGroupSampler(num_groups=3).sample, store, 16)
    assert isinstance(err.value, DiskReplayError)


def test_named_groups_repo(store):
    put(store, ["p1", "p2", "p1", "p3", "p2", "p1"], versions=[0, 0, 1, 1, 2, 2])
    s = PromptGroupSampler(num_groups=2, seed=0)
    rows = s.sample(store, 4, groups=["p2", "p1"])
    g = groups_of(rows, 2)
    assert set(g[0]) == {1, 4} and set(g[1]) <= {0, 2, 5} and len(set(g[1])) == 2
    with pytest.raises(SamplerError, match="num_groups=2"):
        s.sample(store, 6, groups=["p1", "p2", "p3"])
    with pytest.raises(SamplerError, match="'nope'"):
        s.sample(store, 4, groups=["p1", "nope"])
    with pytest.raises(SamplerError, match="list"):
        s.sample(store, 4, groups="p1")
    per = PromptGroupSampler(samples_per_group=2, seed=0)
    assert per.sample(store, 6, groups=np.array(["p1", "p2", "p1"])).shape == (6,)
    with pytest.raises(SamplerError, match="len\\(groups\\)"):
        per.sample(store, 8, groups=["p1", "p2", "p1"])
    with pytest.raises(SamplerError, match="policy_version >= 2"):
        s.sample(store, 4, groups=["p1", "p3"], min_policy_version=2)


def test_int_keys_and_numpy_or_torch_group_names(store):
    import torch
    put(store, [10, 11, 10, 11])
    s = PromptGroupSampler.recency(num_groups=2)
    assert s.sample(store, 2, groups=torch.tensor([11, 10])).tolist() == [3, 2]
    assert s.sample(store, 2, groups=np.array([10, 11])).tolist() == [2, 3]


def test_group_by_other_column(store):
    put(store, ["a", "b", "c", "d"], task=["x", "y", "x", "y"])
    s = PromptGroupSampler.recency(num_groups=1, group_key="task")
    assert s.sample(store, 2, groups=["x"]).tolist() == [2, 0]
    assert s.sample(store, 2, groups=["y"]).tolist() == [3, 1]
    rows = PromptGroupSampler(num_groups=2, group_key="task", seed=1).sample(store, 4)
    assert sorted(rows.tolist()) == [0, 1, 2, 3]


def test_store_without_group_key(tmp_path):
    with ReplayStore(tmp_path / "s", group_key=None) as st_:
        st_.extend({"completion_ids": [[1]] * 4, "q": [1, 2, 1, 2]})
        with pytest.raises(SamplerError, match="group_key"):
            PromptGroupSampler(num_groups=1).sample(st_, 2)
        assert PromptGroupSampler.recency(num_groups=1, group_key="q").sample(st_, 2, groups=[2]).tolist() == [3, 1]


def test_warns_once_when_completing_with_replacement(store):
    put(store, ["a"] * 3 + ["b"] * 5)
    s = PromptGroupSampler.recency(num_groups=1)
    with pytest.warns(ReplacementWarning):
        rows = s.sample(store, 5, groups=["a"])
    assert rows.tolist() == [2, 1, 0, 2, 1]  # all rows, then the ranking again
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s.sample(store, 5, groups=["a"])
        s.sample(store, 8, groups=["a"])
    assert not [w for w in rec if issubclass(w.category, ReplacementWarning)]

    fresh = PromptGroupSampler(num_groups=4, seed=0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            rows = fresh.sample(store, 8)   # only 2 groups for 4 -> groups repeat
            assert len(groups_of(rows, 2)) == 4
        fresh.sample(store, 8, groups=["a", "a", "b", "b"])
    assert len([w for w in rec if issubclass(w.category, ReplacementWarning)]) == 1
    assert fresh.state_dict()["position"]["warned"] is True


def test_staleness_bound(store):
    put(store, ["a", "a", "a", "b", "b", "c"], versions=[0, 3, 5, 1, 2, 4])
    s = PromptGroupSampler(samples_per_group=1, seed=0)
    for _ in range(30):
        rows = s.sample(store, 2, min_policy_version=3)
        assert set(rows.tolist()) <= {1, 2, 5}
        assert len(set(rows.tolist())) == 2  # groups a and c, b is not eligible
    assert PromptGroupSampler.recency(num_groups=1).sample(store, 2, groups=["a"], min_policy_version=3).tolist() \
        == [2, 1]
    with pytest.raises(SamplerError, match="no group"):
        s.sample(store, 1, min_policy_version=9)
    r = RandomSampler(seed=0)
    assert sorted(r.sample(store, 3, min_policy_version=3).tolist()) == [1, 2, 5]
    with pytest.raises(SamplerError, match="exceeds"):
        r.sample(store, 4, min_policy_version=3)
    p = PrioritizedSampler(seed=0)
    assert set(p.sample(store, 200, min_policy_version=4).tolist()) == {2, 5}


def test_staleness_needs_the_version_column(tmp_path):
    with ReplayStore(tmp_path / "s") as st_:
        st_.extend({"prompt_id": [1, 1], "completion_ids": [[1], [2]]})
        with pytest.raises(SamplerError, match="policy_version"):
            RandomSampler().sample(st_, 1, min_policy_version=1)


def test_vector_rewards_are_averaged(store):
    vec = np.array([[1, 0, 0], [0.2, 0.2, 0.2], [1, 1, -1], [0, 0, 0]], dtype=np.float32)  # means .33 .2 .33 0
    put(store, ["g"] * 4, vec_reward=vec)
    assert PromptGroupSampler.reward(num_groups=1, reward_key="vec_reward").sample(
        store, 4, groups=["g"]).tolist() == [2, 0, 1, 3]
    with pytest.raises(SamplerError, match="reward_key='prompt_id'"):
        PromptGroupSampler.reward(num_groups=1, reward_key="prompt_id").sample(store, 1)
    with pytest.raises(SamplerError, match="missing"):
        PromptGroupSampler.reward(num_groups=1, reward_key="missing").sample(store, 1)


def test_sampling_does_not_modify_the_store(store):
    put(store, ["a", "b"] * 8, rewards=np.arange(16))
    before = (store.generation, sorted(os.listdir(store.path)), sorted(os.listdir(os.path.join(store.path,
                                                                                               "segments"))))
    for strat in ("random", "recency", "reward", "variance"):
        PromptGroupSampler(num_groups=2, strategy=strat, seed=0).sample(store, 8)
    RandomSampler(seed=0).sample(store, 4)
    PrioritizedSampler(seed=0).sample(store, 4)
    after = (store.generation, sorted(os.listdir(store.path)), sorted(os.listdir(os.path.join(store.path,
                                                                                              "segments"))))
    assert before == after and len(store) == 16


# --------------------------------------------------------------------------- RandomSampler


def test_random_sampler_passes(store):
    put(store, list(range(10)))
    s = RandomSampler(seed=0)
    first = np.concatenate([s.sample(store, 5), s.sample(store, 5)])
    assert sorted(first.tolist()) == list(range(10))
    second = np.concatenate([s.sample(store, 4) for _ in range(5)])  # 20 rows: two full passes
    assert sorted(second[:10].tolist()) == list(range(10)) and sorted(second[10:].tolist()) == list(range(10))
    assert (s.sample_counts(range(10)) == 3).all()
    # a batch crossing a pass boundary never repeats a row
    for _ in range(50):
        assert len(set(s.sample(store, 7).tolist())) == 7
    with pytest.raises(SamplerError, match="batch_size=11"):
        s.sample(store, 11)


def test_random_sampler_restarts_when_store_changes(store):
    put(store, list(range(6)))
    s = RandomSampler(seed=1)
    a = s.sample(store, 3)
    put(store, [6, 7])
    b = np.concatenate([s.sample(store, 4), s.sample(store, 4)])  # a fresh pass over all 8 rows
    assert sorted(b.tolist()) == list(range(8))
    assert len(a) == 3
    store.save_state("other", {"x": 1})  # a saved state is not a data change
    c = np.concatenate([s.sample(store, 4), s.sample(store, 4)])
    assert sorted(c.tolist()) == list(range(8))


def test_random_sampler_with_replacement(store):
    put(store, list(range(4)))
    rows = RandomSampler(replacement=True, seed=0).sample(store, 4000)
    counts = np.bincount(rows, minlength=4)
    assert counts.sum() == 4000 and counts.min() > 900
    with pytest.raises(SamplerError, match="replacement"):
        RandomSampler(replacement=1)


def test_empty_store_errors(store):
    with pytest.raises(SamplerError):
        RandomSampler().sample(store, 1)
    with pytest.raises(SamplerError):
        RandomSampler(replacement=True).sample(store, 1)
    with pytest.raises(SamplerError):
        PromptGroupSampler(num_groups=1).sample(store, 1)
    with pytest.raises(SamplerError):
        PrioritizedSampler().sample(store, 1)


# --------------------------------------------------------------------------- PrioritizedSampler


def test_ssr_probabilities_chi_square(store):
    adv = np.array([0.0, 0.5, -1.0, 2.0, 0.0, -3.0])
    put(store, ["a"] * 6, advantages=adv)
    s = PrioritizedSampler(alpha=0.7, eps=0.1, seed=1234)
    w = (np.abs(adv) + 0.1) ** 0.7
    p = w / w.sum()
    np.testing.assert_allclose(s.probabilities(store, np.arange(6)), p, rtol=1e-12)
    n = 20000
    obs = np.bincount(s.sample(store, n), minlength=6)
    chi2 = float(((obs - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001; the seed is fixed so this cannot flake


def test_ssr_eps_always_applied_zero_advantages_uniform(store):
    put(store, ["a"] * 5, advantages=np.zeros(5))
    s = PrioritizedSampler(alpha=1.0, eps=1e-4, seed=0)
    np.testing.assert_allclose(s.probabilities(store, np.arange(5)), 0.2)
    obs = np.bincount(s.sample(store, 10000), minlength=5)
    assert obs.min() > 1800


def test_ssr_update_priorities_and_new_rows(store):
    put(store, ["a"] * 4, advantages=[1, 1, 1, 1])
    s = PrioritizedSampler(eps=0.0, seed=0)
    s.update_priorities([0, 1, 2, 3], [0, 0, 0, -5.0])
    assert set(s.sample(store, 100).tolist()) == {3}
    s.update_priorities([3, 3], [9.0, 0.0])  # last value wins
    s.update_priorities([4], [2.0])          # a row not read yet keeps the override until it is
    with pytest.raises(SamplerError):
        s.sample(store, 10)                  # every live priority is 0 and eps=0
    put(store, ["a", "a"], advantages=[0, 3.0])  # rows 4, 5
    np.testing.assert_allclose(s.probabilities(store, [4, 5]), [0.4, 0.6])
    with pytest.raises(SamplerError, match="2 rows but 1"):
        s.update_priorities([0, 1], [1.0])
    with pytest.raises(SamplerError, match="finite"):
        s.update_priorities([0], [np.nan])


def test_ssr_evicted_rows_drop_out(tmp_path):
    with ReplayStore(tmp_path / "s", capacity=4) as st_:
        put(st_, ["a"] * 4, advantages=[5, 5, 0, 0])
        s = PrioritizedSampler(eps=0.0, seed=0)
        assert set(s.sample(st_, 100).tolist()) == {0, 1}
        put(st_, ["b"] * 2, advantages=[0, 1])  # rows 0, 1 evicted
        assert set(s.sample(st_, 100).tolist()) == {5}
        assert s.state_dict()["data"]["prio_base"] == 2


# --------------------------------------------------------------------------- state and resume


def make_samplers():
    return {"group_random": PromptGroupSampler(num_groups=3, seed=5),
            "group_variance": PromptGroupSampler.variance(samples_per_group=2, seed=5),
            "pass": RandomSampler(seed=5),
            "uniform": RandomSampler(replacement=True, seed=5),
            "ssr": PrioritizedSampler(alpha=0.5, seed=5)}


def fill(store):
    rng = np.random.default_rng(0)
    for b in range(6):  # capacity evicts: reopened group codes differ from the writer's
        keys = [f"p{(b * 3 + i) % 11}" for i in range(8)]
        put(store, keys, rewards=rng.random(8), advantages=rng.standard_normal(8), versions=[b] * 8)
        store.group_index()  # the writer's group codes then span its whole history, the reader's do not


def draw(samplers, store, n):
    out = {}
    for name, s in samplers.items():
        kw = {"min_policy_version": 2} if name in ("group_random", "ssr") else {}
        out[name] = [s.sample(store, 6, **kw).tolist() for _ in range(n)]
    return out


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from diskreplay import ReplayStore
    from test_samplers import make_samplers, draw
    with ReplayStore(sys.argv[3], readonly=True) as store:
        samplers = make_samplers()
        for name, s in samplers.items():
            s.load_state_dict(store.load_state(name))
        print(json.dumps(draw(samplers, store, 5)))
""")


def test_resume_gives_identical_stream(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path, capacity=40) as store:
        fill(store)
        assert store.head > 0
        samplers = make_samplers()
        draw(samplers, store, 3)
        samplers["ssr"].update_priorities([store.head + 1, store.next_row - 1], [7.0, 0.0])
        for name, s in samplers.items():
            store.save_state(name, s.state_dict())
        expected = draw(samplers, store, 5)
        writer_keys = store.group_index().keys
    with ReplayStore(path) as again:
        assert sorted(again.group_index().keys) == sorted(writer_keys)
        restored = make_samplers()
        for name, s in restored.items():
            s.load_state_dict(again.load_state(name))
        assert draw(restored, again, 5) == expected
    proc = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, REPO, os.path.dirname(__file__), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == expected


def test_state_dict_is_plain_and_checked(store):
    put(store, ["a", "b"] * 4)
    s = PromptGroupSampler(num_groups=2, seed=0)
    s.sample(store, 4)
    d = s.state_dict()

    def plain(x):  # JSON values, with numpy arrays where the store keeps Arrow arrays
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        assert isinstance(x, (np.ndarray, int, float, str, bool, type(None))), x
        return x.tolist() if isinstance(x, np.ndarray) else x

    json.dumps(plain(d))
    assert set(d) == {"format", "version", "type", "config", "position", "data"}
    with pytest.raises(SamplerError, match="strategy"):
        PromptGroupSampler.recency(num_groups=2).load_state_dict(d)
    with pytest.raises(SamplerError, match="PromptGroupSampler"):
        RandomSampler().load_state_dict(d)
    with pytest.raises(diskreplay.FormatError, match="Unsupported"):
        PromptGroupSampler(num_groups=2).load_state_dict({**d, "version": 99})
    other = PromptGroupSampler(num_groups=2, seed=123)
    other.load_state_dict(d)
    assert other.sample(store, 4).tolist() == s.sample(store, 4).tolist()
