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
                                 SamplerError, variance_ranking)

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
    ranked, pos = variance_ranking(cand, seg, r, n, first, k)
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
    assert sorted(r.sample(store, 4, min_policy_version=3).tolist()) == [1, 2, 5]  # a pass of 3: a short batch
    with pytest.raises(SamplerError, match="exceeds the 3 live rows with policy_version >= 3"):
        RandomSampler(drop_last=True).sample(store, 4, min_policy_version=3)
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
    second = [s.sample(store, 4) for _ in range(6)]  # two passes, each 4 + 4 + the 2 rows left (TorchRL's)
    assert [len(b) for b in second] == [4, 4, 2, 4, 4, 2]
    assert sorted(np.concatenate(second[:3]).tolist()) == list(range(10)) == sorted(np.concatenate(second[3:]).tolist())
    assert (s.sample_counts(range(10)) == 3).all()
    for _ in range(50):  # a batch never crosses the end of its pass, so never repeats a row
        batch = s.sample(store, 7)
        assert len(set(batch.tolist())) == len(batch) and len(batch) in (7, 3)
    assert sorted(RandomSampler(seed=0).sample(store, 11).tolist()) == list(range(10))  # TorchRL: the whole pass
    with pytest.raises(SamplerError, match="batch_size=11"):
        RandomSampler(drop_last=True).sample(store, 11)


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


# --------------------------------------------------------------------------- pickling (issue 11 item 2)


def _continue_in_worker(name, sampler, path, n):
    """Runs in a spawned process: the unpickled sampler continues its stream on a read-only store."""
    with ReplayStore(path, readonly=True) as st_:
        return draw({name: sampler}, st_, n)[name]


def test_samplers_pickle_and_deepcopy_mid_stream(tmp_path):
    import copy
    import multiprocessing
    import pickle

    path = tmp_path / "s"
    with ReplayStore(path, capacity=40) as store:
        fill(store)
        samplers = make_samplers()
        draw(samplers, store, 3)  # mid-stream: RNG moved, a pass half used, counts and priorities set
        samplers["ssr"].update_priorities([store.head + 1], [9.0])
        copies = {name: pickle.loads(pickle.dumps(s)) for name, s in samplers.items()}
        deep = {name: copy.deepcopy(s) for name, s in samplers.items()}
        for name, s in samplers.items():
            assert type(copies[name]) is type(s) and copies[name].config() == s.config()
            np.testing.assert_array_equal(copies[name].sample_counts(np.arange(store.head, store.next_row)),
                                          s.sample_counts(np.arange(store.head, store.next_row)))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            remote = {name: pool.apply(_continue_in_worker, (name, s, str(path), 4)) for name, s in samplers.items()}
        want = draw(samplers, store, 4)
        assert draw(copies, store, 4) == want
        assert draw(deep, store, 4) == want
    for name in samplers:
        assert remote[name] == want[name], name


# --------------------------------------------------------------------------- settings (item 3)


def test_mutable_settings_take_effect_and_fixed_ones_refuse(store):
    put(store, ["a"] * 4, advantages=[0.0, 1.0, 2.0, 4.0])
    s = PrioritizedSampler(alpha=1.0, eps=0.0, seed=0)
    np.testing.assert_allclose(s.probabilities(store, [1, 2, 3]), [1 / 7, 2 / 7, 4 / 7])
    s.sample(store, 4)
    s.alpha = 0.0  # every live row equally likely (0 ** 0 == 1)
    np.testing.assert_allclose(s.probabilities(store, range(4)), 0.25)
    s.alpha, s.eps = 1.0, 1.0
    np.testing.assert_allclose(s.probabilities(store, range(4)), np.array([1, 2, 3, 5]) / 11)
    assert s.state_dict()["config"]["eps"] == 1.0
    obs = np.bincount(s.sample(store, 11000), minlength=4)
    assert abs(obs[3] - 5000) < 300  # the draws use the new weights, not a cache of the old ones
    with pytest.raises(SamplerError, match="alpha"):
        s.alpha = -1
    for sampler, name, value in [(s, "priority_key", "rewards"), (s, "seed", 3), (s, "rank", 1),
                                 (PromptGroupSampler(num_groups=2), "num_groups", 3),
                                 (PromptGroupSampler(num_groups=2), "group_key", "x"),
                                 (RandomSampler(), "world_size", 2)]:
        with pytest.raises(diskreplay.SettingError, match=name):
            setattr(sampler, name, value)
        with pytest.raises(AttributeError):
            setattr(sampler, name, value)
    g = PromptGroupSampler(num_groups=1, seed=0)
    g.strategy = "recency"
    assert g.sample(store, 2).tolist() == [3, 2]
    with pytest.raises(SamplerError, match="strategy"):
        g.strategy = "best"
    r = RandomSampler(seed=0)
    r.replacement = True
    assert len(r.sample(store, 9)) == 9  # more rows than live: only possible with replacement


# --------------------------------------------------------------------------- prioritized (item 4)


def cumsum_reference(prio, eps, alpha, u):
    """Today's algorithm before the sum tree: a cumulative sum and a binary search."""
    w = (prio + eps) ** alpha
    cdf = np.cumsum(w)
    return np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(w)[-1])


def test_ssr_same_distribution_as_the_cumsum(tmp_path):
    rng = np.random.default_rng(3)
    with ReplayStore(tmp_path / "s", capacity=300) as st_:
        for _ in range(5):  # 500 rows through capacity 300: eviction, and the tree's ring wraps
            put(st_, ["a"] * 100, advantages=rng.standard_normal(100) * (rng.random(100) < 0.7))
        s = PrioritizedSampler(alpha=0.6, eps=0.01, seed=11)
        s.sample(st_, 1)
        upd = np.arange(st_.head, st_.next_row, 7)
        s.update_priorities(upd, rng.standard_normal(len(upd)))
        prio = np.abs(st_.read(np.arange(st_.head, st_.next_row), ["advantages"])["advantages"].astype(np.float64))
        prio[upd - st_.head] = np.abs(s.state_dict()["data"]["priorities"][upd - st_.head])
        w = (prio + 0.01) ** 0.6
        p = w / w.sum()
        np.testing.assert_allclose(s.probabilities(st_, np.arange(st_.head, st_.next_row)), p, rtol=1e-10)
        n = 300_000
        obs = np.bincount(s.sample(st_, n) - st_.head, minlength=len(p))
        ref = np.bincount(cumsum_reference(prio, 0.01, 0.6, np.random.default_rng(5).random(n)), minlength=len(p))
        for counts in (obs, ref):
            chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
            assert chi2 < 299 + 4.5 * np.sqrt(2 * 299)  # 0.999 quantile, 299 degrees of freedom; fixed seeds


def test_ssr_new_priority_max_and_importance_weights(store):
    put(store, ["a"] * 3, advantages=[5.0, 5.0, 5.0])  # the column is ignored with new_priority="max"
    s = PrioritizedSampler(eps=0.0, new_priority="max", seed=0, beta=0.5)
    np.testing.assert_allclose(s.probabilities(store, range(3)), 1 / 3)  # 1.0 each before any update
    s.update_priorities([0, 1], [4.0, -2.0])
    put(store, ["a", "a"])  # rows 3, 4 enter at the running maximum, 4.0
    np.testing.assert_allclose(s.probabilities(store, range(5)), np.array([4, 2, 1, 4, 4]) / 15)
    # w_i = (N * P(i)) ** -beta / max_j w_j, by brute force over the live rows
    p = np.array([4, 2, 1, 4, 4]) / 15
    for beta in (0.5, 1.0, 0.0):
        w = (5 * p) ** -beta
        np.testing.assert_allclose(s.importance_weights(store, [0, 2, 4], beta=beta), w[[0, 2, 4]] / w.max())
    np.testing.assert_allclose(s.importance_weights(store, [2]), [1.0])  # the sampler's beta; the rarest row
    s.update_priorities([2], [0.0])
    with pytest.raises(SamplerError, match="probability 0"):
        s.importance_weights(store, [2])
    np.testing.assert_allclose(s.importance_weights(store, [1], beta=1.0), [1.0])  # row 1 is now the rarest
    with pytest.raises(SamplerError, match="new_priority"):
        PrioritizedSampler(new_priority="min")
    with pytest.raises(SamplerError, match="live rows"):
        s.importance_weights(store, [99])


def test_ssr_state_has_no_tree_and_restores_it(tmp_path):
    with ReplayStore(tmp_path / "s", capacity=10) as st_:
        put(st_, ["a"] * 8, advantages=np.arange(8.0))
        s = PrioritizedSampler(seed=1)
        s.sample(st_, 3)
        s.update_priorities([2, 20], [50.0, 7.0])  # 20: not written yet, kept pending
        state = s.state_dict()
        assert set(state["data"]) == {"counts_base", "counts", "prio_base", "priorities", "pending_rows",
                                      "pending_values", "max_priority"}
        assert all(not isinstance(v, np.ndarray) or v.size <= 2 for v in
                   _flat(s.position()))  # the position holds no per-row array
        st_.save_state("ssr", state)
        put(st_, ["a"] * 5, advantages=np.zeros(5))  # evicts rows 0..2
        t = PrioritizedSampler(seed=99)
        t.load_state_dict(st_.load_state("ssr"))
        assert t.sample(st_, 50).tolist() == s.sample(st_, 50).tolist()


def _flat(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _flat(v)
        else:
            yield v


# --------------------------------------------------------------------------- RandomSampler (item 5)


def test_random_sampler_drop_last_and_shuffle(store):
    put(store, list(range(10)))
    ordered = RandomSampler(shuffle=False)
    assert [ordered.sample(store, 4).tolist() for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    dropping = RandomSampler(shuffle=False, drop_last=True)
    assert [dropping.sample(store, 4).tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    s = RandomSampler(seed=3, drop_last=True)
    first = np.concatenate([s.sample(store, 3) for _ in range(3)])
    assert len(set(first.tolist())) == 9
    nxt = s.sample(store, 3)  # the one row left is dropped: a new pass
    assert len(set(nxt.tolist())) == 3 and s.pass_remaining(store) == 7
    with pytest.raises(SamplerError, match="drop_last"):
        RandomSampler(drop_last="yes")


# --------------------------------------------------------------------------- PromptGroupSampler (item 5)


def test_random_strategy_completes_short_group_uniformly_with_replacement(store):
    put(store, ["s"] * 3 + ["big"] * 8)
    s = PromptGroupSampler(samples_per_group=8, seed=0)
    with pytest.warns(ReplacementWarning, match="with replacement"):
        rows = s.sample(store, 8, groups=["s"])
    assert rows.tolist() == sorted(rows.tolist())  # laid out in row-id order
    assert set(rows.tolist()) == {0, 1, 2}  # every row of the short group, then 5 draws with replacement

    def extras(rows):  # the 5 rows drawn with replacement: the draw less one of each row
        return np.bincount(rows, minlength=3) - 1

    counts = sum(extras(s.sample(store, 8, groups=["s"])) for _ in range(600))
    assert counts.sum() == 3000 and counts.min() > 900  # 3000 uniform draws over 3 rows: 1000 each
    drawn = {tuple(extras(s.sample(store, 8, groups=["s"]))) for _ in range(200)}
    assert len(drawn) > 5  # not the ranking repeated


def test_min_reward_std_only_groups_with_signal(store):
    put(store, ["flat"] * 4 + ["nan"] * 3 + ["signal"] * 4 + ["one"] * 2 + ["small"] * 3,
        rewards=[1, 1, 1, 1] + [np.nan, 0, np.nan] + [0, 1, 0, 1] + [np.nan, 3] + [0.0, 0.1, 0.0])
    s = PromptGroupSampler(samples_per_group=2, min_reward_std=0.0, seed=0)
    seen = set()
    for _ in range(50):
        seen.update(store.read(s.sample(store, 4), ["prompt_id"])["prompt_id"])
    # "flat" has no spread, "nan" and "one" a single finite reward (NaN rewards are left out, like nanstd)
    assert seen == {"signal", "small"}
    s.min_reward_std = 0.1  # small's std is 0.0577: at or below the bound from now on
    with pytest.warns(ReplacementWarning):
        rows = s.sample(store, 4)
    assert set(store.read(rows, ["prompt_id"])["prompt_id"]) == {"signal"}
    with pytest.raises(SamplerError, match="min_reward_std"):
        s.sample(store, 2, groups=["flat"])
    with pytest.raises(SamplerError, match="min_reward_std"):
        PromptGroupSampler(num_groups=1, min_reward_std=-1.0)
    with pytest.raises(SamplerError, match="no group"):
        PromptGroupSampler(num_groups=1, min_reward_std=5.0).sample(store, 2)


def test_reward_scalar_ignores_nan_components(store):
    vec = np.array([[1, np.nan], [np.nan, np.nan], [0.5, 0.5], [0, 0]], dtype=np.float32)
    put(store, ["g"] * 4, vec_reward=vec)
    s = PromptGroupSampler.reward(num_groups=1, reward_key="vec_reward")
    assert s.sample(store, 4, groups=["g"]).tolist() == [0, 2, 3, 1]  # 1.0, 0.5, 0, all-NaN last


# --------------------------------------------------------------------------- ranks (issue 9 item 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_partition_one_global_batch(tmp_path, world_size):
    with ReplayStore(tmp_path / "s", capacity=200) as st_:
        rng = np.random.default_rng(0)
        for b in range(4):
            keys = [f"p{(b * 7 + i // 4) % 23}" for i in range(64)]
            put(st_, keys, rewards=rng.random(64), advantages=rng.standard_normal(64), versions=[b] * 64)
        bs = 8

        def build(kind, rank, ws):
            common = dict(seed=5, rank=rank, world_size=ws)
            return {"group": lambda: PromptGroupSampler(samples_per_group=4, **common),
                    "group_n": lambda: PromptGroupSampler(num_groups=2 * (world_size // ws), **common),
                    "variance": lambda: PromptGroupSampler.variance(samples_per_group=2, **common),
                    "pass": lambda: RandomSampler(**common),
                    "ordered": lambda: RandomSampler(shuffle=False, drop_last=True, **common),
                    "uniform": lambda: RandomSampler(replacement=True, **common),
                    "ssr": lambda: PrioritizedSampler(**common)}[kind]()

        for kind in ("group", "group_n", "variance", "pass", "ordered", "uniform", "ssr"):
            ranks = [build(kind, r, world_size) for r in range(world_size)]
            single = build(kind, 0, 1)
            for step in range(6):
                if step == 3:  # resume every rank from its own saved state
                    states = [r.state_dict() for r in ranks]
                    ranks = [build(kind, r, world_size) for r in range(world_size)]
                    for r, state in zip(ranks, states):
                        r.load_state_dict(state)
                parts = [r.sample(st_, bs) for r in ranks]
                whole = single.sample(st_, bs * world_size)
                assert np.concatenate(parts).tolist() == whole.tolist(), (kind, step)
                if kind in ("pass", "ordered"):
                    assert len(set(whole.tolist())) == len(whole)  # disjoint across ranks
                if kind.startswith("group") or kind == "variance":
                    k = 4 if kind != "variance" else 2
                    keys = st_.read(whole, ["prompt_id"])["prompt_id"]
                    blocks = [set(keys[i:i + k]) for i in range(0, len(keys), k)]
                    assert all(len(b) == 1 for b in blocks)  # whole groups ...
                    per_rank = [set().union(*blocks[r * bs // k:(r + 1) * bs // k]) for r in range(world_size)]
                    assert sum(len(g) for g in per_rank) == len(set().union(*per_rank))  # ... never split
        with pytest.raises(SamplerError, match="rank"):
            RandomSampler(rank=2, world_size=2)
        with pytest.raises(SamplerError, match="world_size"):
            RandomSampler(world_size=0)
        for kw in ({"rank": "1", "world_size": 2}, {"rank": 1.0, "world_size": 2}, {"world_size": 2.0}):
            with pytest.raises(TypeError, match="must be"):  # a value of the wrong type is a TypeError too
                RandomSampler(**kw)
        with pytest.raises(SamplerError, match="config"):
            RandomSampler(rank=1, world_size=2).load_state_dict(RandomSampler(world_size=2).state_dict())


def test_agree_generation_without_torch_distributed(store):
    from diskreplay.samplers import agree_generation
    put(store, ["a", "b"])
    if "generation" not in ReplayStore.__init__.__code__.co_varnames:
        with pytest.raises(SamplerError, match="pinned snapshots"):
            agree_generation(store)
        return
    with agree_generation(store) as snap:  # pragma: no cover - runs once the store has snapshots
        gen = snap.generation
        put(store, ["c"])
        assert snap.generation == gen and len(snap) == 2 and store.generation > gen


def test_agree_generation_on_a_lagging_rank_keeps_the_store_s_options(tmp_path):
    """A rank whose store is behind rank 0's opens rank 0's generation with its own store's options
    (an s3:// store's storage options and cache, verify_reads), as store.snapshot() does."""
    from diskreplay.samplers.distributed import _open_generation

    path = str(tmp_path / "s")
    with ReplayStore(path) as writer:
        put(writer, ["a", "b"])
        with ReplayStore(path, readonly=True, verify_reads=False) as follower:
            put(writer, ["c"])
            with _open_generation(follower, writer.generation) as snap:
                assert snap.generation == writer.generation > follower.generation
                assert snap.verify_reads is False and snap._storage_args == follower._storage_args
            with follower.snapshot(follower.generation - 1) as older, follower.snapshot() as now:
                assert (older.generation, now.generation) == (follower.generation - 1, follower.generation)
                assert not older.verify_reads and (len(older), len(now)) == (0, 2)


def test_agree_generation_on_a_reader_pins_the_newest_commit(tmp_path):
    """A read-only store (what every rank of a torchrun job opens) is moved to the newest commit before
    its generation is pinned: it pinned the generation the reader was opened at, again and again."""
    from diskreplay.samplers import agree_generation

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as writer, ReplayStore(path, readonly=True) as reader:
        put(writer, ["a"])
        for step in range(3):
            put(writer, ["b", "c"])
            with agree_generation(reader) as snap:
                assert snap.generation == writer.generation and len(snap) == len(writer), step


def test_a_snapshot_whose_files_were_collected_says_so(tmp_path):
    """A pinned snapshot of a single-writer store outlives its generation's files after 4 more commits
    (merges and clean-up): reads raised a bare FileNotFoundError naming a segment; they now say which
    generation is gone, why, and what to do."""
    from diskreplay import StoreNotFoundError
    from diskreplay.samplers import agree_generation

    path = str(tmp_path / "s")
    with ReplayStore(path) as writer, ReplayStore(path, readonly=True) as reader:
        put(writer, ["a", "b"])
        with agree_generation(reader) as snap:
            pinned = snap.generation
            for step in range(40):  # merges of the small segments, then their collection
                put(writer, [f"x{step}"])
            with pytest.raises(StoreNotFoundError, match=f"generation {pinned} .* no longer retained.*retain_seconds"):
                snap.read(snap.row_ids())


def test_ssr_moving_to_another_store_starts_over(tmp_path):
    with ReplayStore(tmp_path / "a") as a, ReplayStore(tmp_path / "b") as b:
        put(a, ["x"] * 2, advantages=[5.0, 0.0])
        put(b, ["x"] * 3, advantages=[0.0, 0.0, 5.0])
        s = PrioritizedSampler(eps=0.0, seed=0)
        assert set(s.sample(a, 20).tolist()) == {0}
        assert set(s.sample(b, 20).tolist()) == {2}  # b's own priorities, not a's left in the tree


# --------------------------------------------------------------------------- exclude= and min_row=


def _filter_kinds():
    return {"group_random": lambda: PromptGroupSampler(samples_per_group=2, seed=1),
            "group_recency": lambda: PromptGroupSampler.recency(samples_per_group=2, seed=1),
            "group_reward": lambda: PromptGroupSampler.reward(samples_per_group=2, seed=1),
            "group_variance": lambda: PromptGroupSampler.variance(samples_per_group=2, seed=1),
            "group_signal": lambda: PromptGroupSampler(num_groups=2, min_reward_std=0.0, seed=1),
            "pass": lambda: RandomSampler(seed=1),
            "ordered": lambda: RandomSampler(shuffle=False, drop_last=True, seed=1),
            "uniform": lambda: RandomSampler(replacement=True, seed=1),
            "ssr": lambda: PrioritizedSampler(alpha=0.7, seed=1),
            "ssr_max": lambda: PrioritizedSampler(new_priority="max", eps=0.0, seed=1)}


FILTERS = st.fixed_dictionaries({
    "exclude": st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)).map(lambda p: (p[0], p[0] + p[1])),
                        max_size=3),
    "min_row": st.one_of(st.none(), st.integers(0, 40)),
    "min_policy_version": st.one_of(st.none(), st.integers(0, 5))})


def _allowed(store, versions, exclude, min_row, min_policy_version):
    """The rows a draw may take, by the plain rule."""
    out = set()
    for r in range(store.head, store.next_row):
        if min_row is not None and r < min_row:
            continue
        if any(a <= r < b for a, b in exclude):
            continue
        if min_policy_version is not None and versions[r] < min_policy_version:
            continue
        out.add(r)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.integers(2, 10), min_size=1, max_size=5), capacity=st.sampled_from([None, 24]),
       filters=st.lists(FILTERS, min_size=1, max_size=4), data=st.data())
def test_excluded_rows_are_never_drawn(tmp_path_factory, batches, capacity, filters, data):
    """Every sampler and strategy, a store with eviction, and filters that change between draws of one sampler."""
    path = tmp_path_factory.mktemp("exclude") / "s"
    rng = np.random.default_rng(len(batches))
    with ReplayStore(path, capacity=capacity) as store:
        versions = {}
        for b, n in enumerate(batches):
            vs = [int(v) for v in rng.integers(0, 6, n)]  # versions need not grow along the rows
            rows = put(store, [f"p{int(k)}" for k in rng.integers(0, 4, n)], rewards=rng.integers(0, 3, n),
                       advantages=rng.standard_normal(n), versions=vs)
            versions.update(zip(rows.tolist(), vs))
        for name, build in _filter_kinds().items():
            s = build()
            if name.startswith("ssr"):
                s.update_priorities([store.head], [3.0])
            for f in filters:
                allowed = _allowed(store, versions, **f)
                n = 4 if not name.startswith(("pass", "ordered")) else 3
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", ReplacementWarning)
                        rows = s.sample(store, n, **f)
                except SamplerError:
                    if name in ("pass", "ordered"):
                        assert len(allowed) < n, (name, f)
                    elif name != "group_signal":  # no group with spread among the allowed rows is fine too
                        assert not allowed, (name, f)
                    continue
                assert set(rows.tolist()) <= allowed, (name, f, rows)
                mask = s.eligible(store, **f)
                got = set(range(store.head, store.next_row)) if mask is None else \
                    set((store.head + np.flatnonzero(mask)).tolist())
                assert got == allowed
            if name.startswith("group") and name != "group_signal":
                f = data.draw(FILTERS, label="named")
                allowed = _allowed(store, versions, **f)
                if allowed:
                    key = store.read([min(allowed)], ["prompt_id"])["prompt_id"][0]
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", ReplacementWarning)
                        rows = s.sample(store, 2, groups=[key], **f)
                    assert set(rows.tolist()) <= allowed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filters=st.lists(FILTERS, min_size=1, max_size=6), alpha=st.sampled_from([0.5, 1.0]))
def test_sum_tree_reweighted_for_a_changed_exclusion_matches_a_fresh_one(tmp_path_factory, filters, alpha):
    path = tmp_path_factory.mktemp("tree") / "s"
    rng = np.random.default_rng(1)
    with ReplayStore(path) as store:
        put(store, ["a"] * 48, advantages=rng.standard_normal(48), versions=rng.integers(0, 6, 48).tolist())
        used = PrioritizedSampler(alpha=alpha, seed=0)
        used.update_priorities([3, 40], [5.0, 0.0])
        live = store.row_ids()
        for f in filters:
            fresh = PrioritizedSampler(alpha=alpha, seed=0)
            fresh.update_priorities([3, 40], [5.0, 0.0])
            np.testing.assert_allclose(used.probabilities(store, live, **f), fresh.probabilities(store, live, **f),
                                       rtol=1e-12, atol=1e-15)


def test_unchanged_exclusion_costs_no_pass_over_the_rows(store):
    put(store, ["a"] * 4000, advantages=np.arange(4000) % 7, versions=[0] * 4000)
    s = PrioritizedSampler(seed=0)
    weighed = []
    original = s._weights
    s._weights = lambda st_, filt, rows: weighed.append(len(rows)) or original(st_, filt, rows)
    s.sample(store, 8, exclude=[(100, 200)], min_row=50)
    assert weighed == [4000]  # the first draw builds the tree
    for _ in range(3):
        s.sample(store, 8, exclude=[(100, 200)], min_row=50)
    assert weighed == [4000]
    put(store, ["a"] * 8)
    s.sample(store, 8, exclude=[(100, 200)], min_row=58)  # the window moved up with one batch
    assert weighed == [4000, 8, 8]  # rows 50-57 left the window, rows 4000-4007 came
    s.sample(store, 8, exclude=[(100, 200), (300, 310)], min_row=58)
    assert weighed == [4000, 8, 8, 10]
    g = PromptGroupSampler(samples_per_group=2, seed=0)
    g.sample(store, 2, exclude=[(0, 10)])
    first = g._eligible_cache[1]
    g.sample(store, 2, exclude=((0, 10),))  # the same rows, written differently
    assert g._eligible_cache[1] is first


def test_exclude_and_min_row_with_ranks(tmp_path):
    with ReplayStore(tmp_path / "s") as st_:
        rng = np.random.default_rng(0)
        put(st_, [f"p{i % 9}" for i in range(96)], rewards=rng.random(96), advantages=rng.standard_normal(96),
            versions=[i // 16 for i in range(96)])
        kw = dict(exclude=[(20, 40), (60, 64)], min_row=8, min_policy_version=1)
        for name, build in _filter_kinds().items():
            if name == "group_signal":
                continue
            kwargs = {**build().config(), "seed": 4}
            kwargs.pop("rank"), kwargs.pop("world_size")
            cls = type(build())
            ranks = [cls(**kwargs, rank=r, world_size=2) for r in range(2)]
            single = cls(**kwargs)
            for _ in range(3):
                parts = [r.sample(st_, 4, **kw) for r in ranks]
                whole = single.sample(st_, 8, **kw)
                assert np.concatenate(parts).tolist() == whole.tolist(), name
                assert not ((whole >= 20) & (whole < 40)).any() and (whole >= 16).all(), name


def test_exclude_and_min_row_are_checked(store):
    put(store, ["a", "b"] * 4, versions=[0, 1] * 4)
    s = RandomSampler(seed=0)
    for bad, match in [("16-32", "list of"), ([(3,)], r"exclude\[0\]"), ([(5, 2)], "start <= stop"),
                       ([(-1, 2)], "start <= stop"), ([(0.5, 2)], "integer row ids")]:
        with pytest.raises(SamplerError, match=match):
            s.sample(store, 1, exclude=bad)
    for bad in (-1, 2.0, "3"):
        with pytest.raises(SamplerError, match="min_row"):
            s.sample(store, 1, min_row=bad)
    assert sorted(s.sample(store, 2, exclude=np.array([[0, 6]])).tolist()) == [6, 7]
    # one call shape for every sampler (DESIGN.md): groups=None is accepted, named groups need a group sampler
    for single in (RandomSampler(seed=0), PrioritizedSampler(seed=0)):
        assert len(single.sample(store, 2, groups=None, min_policy_version=None)) == 2
        with pytest.raises(SamplerError, match="PromptGroupSampler"):
            single.sample(store, 2, groups=["a"])
    with pytest.raises(SamplerError, match=r"outside exclude=\[0, 8\).*exclude fewer rows"):
        PromptGroupSampler(num_groups=1, seed=0).sample(store, 2, exclude=[(0, 8)])
    with pytest.raises(SamplerError, match=r"min_row=8.*lower min_row"):
        PrioritizedSampler(seed=0).sample(store, 2, min_row=8)
    with pytest.raises(SamplerError, match=r"has no live row with policy_version >= 1, outside exclude=\[0, 4\)"):
        PromptGroupSampler(num_groups=1, seed=0).sample(store, 2, groups=["a"], min_policy_version=1,
                                                        exclude=[(0, 4)])


def test_int64_versions_are_compared_exactly(store):
    # the merge bug: versions cached as float64 made int64-min + 1 equal int64-min
    low = int(np.iinfo(np.int64).min)
    put(store, ["a"] * 4, versions=[low, low + 1, 2 ** 62 + 1, 2 ** 62])
    for s in (RandomSampler(replacement=True, seed=0), PrioritizedSampler(seed=0),
              PromptGroupSampler(samples_per_group=2, seed=0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplacementWarning)
            assert set(s.sample(store, 8, min_policy_version=low + 1).tolist()) <= {1, 2, 3}
            assert set(s.sample(store, 8, min_policy_version=2 ** 62 + 1).tolist()) == {2}


def test_an_infinite_priority_is_sampled_as_a_nan_one_and_named(tmp_path):
    # extend accepts an infinite advantage; SSR then refused every draw ("total inf") without naming the row
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": [0, 0, 1], "completion_ids": [[1], [2], [3]],
                      "advantages": np.array([0.5, np.inf, 1.0], np.float32)})
        sampler = PrioritizedSampler(eps=0.0, seed=0)
        with pytest.warns(RuntimeWarning, match="column 'advantages' row 1 is infinite") as caught:
            rows = sampler.sample(store, 64)
        assert caught[0].filename == __file__
        assert set(rows.tolist()) == {0, 2}
        assert set(sampler.sample(store, 64).tolist()) == {0, 2}


def test_a_sampler_used_on_an_older_snapshot_keeps_its_state(tmp_path):
    """Priorities and sample counts are sampler state: a draw on an older snapshot of the same store
    (a rank pinned at the agreed generation, the live store used for logging) threw them away."""
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": [0, 0, 1, 1], "completion_ids": [[1], [2], [3], [4]],
                      "advantages": np.float32([1, 1, 1, 1])})
        snap = store.snapshot()
        store.extend({"prompt_id": [2, 2], "completion_ids": [[5], [6]], "advantages": np.float32([1, 1])})
        ssr = PrioritizedSampler(eps=0.0, seed=0)
        ssr.update_priorities([0], [100.0])
        live = ssr.probabilities(store, [0, 1, 2, 3])
        old = ssr.probabilities(snap, [0, 1, 2, 3])
        assert old[0] == pytest.approx(100 / 103) and live[0] == pytest.approx(100 / 105)
        assert set(ssr.sample(snap, 64).tolist()) <= {0, 1, 2, 3}  # never a row the snapshot lacks
        np.testing.assert_allclose(ssr.probabilities(store, [0, 1, 2, 3]), live)
        uniform = RandomSampler(seed=0)
        rows = uniform.sample(store, 6)
        uniform.sample(snap, 1)
        assert (uniform.sample_counts(rows) >= 1).all()
        snap.close()


def test_a_group_draw_that_raises_leaves_the_stream_where_it_was(tmp_path):
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": list(range(20)), "completion_ids": [[i + 1] for i in range(20)]})
        failed, clean = PromptGroupSampler(num_groups=1, seed=1), PromptGroupSampler(num_groups=1, seed=1)
        for bad in ({"groups": [99]}, {"groups": [1, 2]}):
            with pytest.raises(diskreplay.SamplerError):
                failed.sample(store, 1 if "99" in str(bad) else 3, **bad)
        assert [failed.sample(store, 1).tolist() for _ in range(5)] == [clean.sample(store, 1).tolist()
                                                                        for _ in range(5)]


@pytest.mark.parametrize("make", [lambda: RandomSampler(seed=0), lambda: PrioritizedSampler(seed=0),
                                  lambda: PromptGroupSampler(num_groups=1, seed=0)])
def test_an_empty_store_says_to_extend_it(tmp_path, make):
    with ReplayStore(str(tmp_path / "s")) as store:
        with pytest.raises(diskreplay.SamplerError, match="extend it first"):
            make().sample(store, 2)


@pytest.mark.parametrize("case", ["float64 scalar", "three reward functions"])
def test_min_reward_std_zero_drops_groups_whose_rewards_are_all_equal(tmp_path, case):
    """A group's mean (a rounded sum over a count) can differ from its equal rewards by one rounding
    step: identical rewards got a spread of ~1e-17 > 0.0, so min_reward_std=0.0 ("only groups with any
    spread") drew them. 12 of the 19 values 0.05 .. 0.95 did in groups of 8; any 0/1 pattern over
    three reward functions did in groups of 16."""
    if case == "float64 scalar":
        n, r0, r1 = 8, np.full(8, 0.1), np.array([0.0, 1.0] * 4)
    else:
        n = 16
        r0 = np.tile(np.array([1, 0, 0], np.float32), (n, 1))
        r1 = np.array([[1, 0, 0]] * (n // 2) + [[0, 0, 0]] * (n // 2), np.float32)
    store = ReplayStore(str(tmp_path / "s"))
    store.extend({"prompt_id": [0] * n + [1] * n, "rewards": np.concatenate([r0, r1])})
    sampler = PromptGroupSampler(samples_per_group=n, min_reward_std=0.0, seed=0)
    drawn = {int(k) for _ in range(20) for k in store.read(sampler.sample(store, n), ["prompt_id"])["prompt_id"]}
    assert drawn == {1}
    store.close()


def test_a_prioritized_state_loads_after_beta_was_annealed(tmp_path):
    """beta (and alpha, eps) may be changed on a live sampler, but its saved state refused to load into
    the sampler a restarted run builds with the first values: ReplayLoader(state_name=...) did not start."""
    store = ReplayStore(str(tmp_path / "s"))
    store.extend({"prompt_id": [0, 1, 2], "advantages": np.array([1.0, 2.0, 3.0], np.float32)})
    s = PrioritizedSampler(beta=0.4, seed=0)
    s.sample(store, 2)
    s.beta, s.alpha = 0.7, 0.9
    state = s.state_dict()
    fresh = PrioritizedSampler(beta=0.4, seed=0)
    fresh.load_state_dict(state)
    assert (fresh.beta, fresh.alpha) == (0.4, 1.0)  # its own
    s.alpha = 1.0
    assert fresh.sample(store, 4).tolist() == s.sample(store, 4).tolist()
    with pytest.raises(SamplerError, match=r"alpha, eps, beta may differ"):
        PrioritizedSampler(new_priority="max", seed=0).load_state_dict(state)
    store.close()


def test_random_sampler_refuses_a_closed_store(tmp_path):
    """RandomSampler reads nothing from the store and kept drawing row ids from a closed one (the other
    samplers raise StoreClosedError)."""
    from diskreplay import StoreClosedError

    store = ReplayStore(str(tmp_path / "s"))
    store.extend({"prompt_id": [0, 1, 2], "completion_ids": [[1]] * 3})
    store.close()
    with pytest.raises(StoreClosedError, match="closed"):
        RandomSampler(seed=0).sample(store, 2)


def test_variance_strategy_does_not_take_a_smaller_variance_for_a_tie(tmp_path):
    """Subsets within 1e-9 relative variance of the best counted as ties (then the larger total won):
    rewards 0, 1e-6, 1000 and k=2 gave [1000, 1e-6] (249999.9995) instead of [1000, 0] (250000)."""
    store = ReplayStore(str(tmp_path / "s"))
    r = np.array([0.0, 1e-6, 1000.0])
    store.extend({"prompt_id": ["a"] * 3, "rewards": r})
    rows = PromptGroupSampler.variance(samples_per_group=2, seed=0).sample(store, 2, groups=["a"])
    assert sorted(r[rows].tolist()) == [0.0, 1000.0]
    store.close()
