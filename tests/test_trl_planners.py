"""The TRL integration's replay planners and replay state, on real stores, without TRL.

TRL's reward rules (a reward function returning None makes the row's reward
NaN, left out of its group's statistics, advantage 0) and the exclusion of
rows of a discarded timeline are checked here against plain numpy models.
"""

import subprocess
import sys

import numpy as np
from hypothesis import given, settings, strategies as st

from diskreplay import PrioritizedSampler, PromptGroupSampler, ReplayStore
from diskreplay.integrations.trl.checkpoint import ReplayState, load_checkpoint_state, save_checkpoint_state
from diskreplay.integrations.trl.planners import (Draw, FreshBatch, RepoAnyPlanner, RepoPlanner, SsrPlanner,
                                                  SwapZeroStdPlanner, Timeline, group_advantages,
                                                  recompute_advantages, zero_spread_groups)

NAN = float("nan")


def trl_advantages(rewards, g):
    """TRL 1.16's sum_then_normalize / scale_rewards='group' advantages, written out with numpy."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, g)
    out = np.zeros_like(r)
    for j, row in enumerate(r):
        ok = row[~np.isnan(row)]
        mean = ok.mean() if len(ok) else np.nan
        std = ok.std(ddof=1) if len(ok) > 1 else np.nan
        out[j] = (row - mean) / (std + 1e-4)
    return np.nan_to_num(out, nan=0.0).reshape(-1)


def extend(store, keys, versions, rewards, advantages=None):
    n = len(keys)
    return store.extend({"prompt_id": np.asarray(keys, dtype=np.int64), "completion_ids": [[1, 2]] * n,
                         "policy_version": np.asarray(versions, dtype=np.int64),
                         "rewards": np.asarray(rewards, dtype=np.float32),
                         "advantages": np.asarray(np.ones(n) if advantages is None else advantages,
                                                  dtype=np.float32)})


def test_planners_import_without_trl():
    code = ("import sys; import diskreplay.integrations.trl.planners, diskreplay.integrations.trl.checkpoint, "
            "diskreplay.integrations.trl.rewards; "
            "assert 'trl' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- TRL's reward rules


def test_unscorable_rows_give_no_advantage():
    # the reproduction: [1, 1, nan, nan] was replayed with [0.866, 0.866, -0.866, -0.866]
    r = np.array([1, 1, NAN, NAN])
    assert group_advantages(r, r, "group").tolist() == [0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(group_advantages(r, r, "group"), trl_advantages(r, 4))
    assert zero_spread_groups(r, 4).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(NAN), st.sampled_from([0.0, 0.5, 1.0, 2.0])), min_size=8, max_size=8))
def test_advantages_and_zero_spread_match_trl(values):
    r = np.array(values)
    want = trl_advantages(r, 4)
    got = np.concatenate([group_advantages(r[j:j + 4], r[j:j + 4], "group") for j in (0, 4)])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # a group is "zero spread" exactly when TRL gives every row of it advantage 0
    zero = set(zero_spread_groups(r, 4).tolist())
    assert zero == {j for j in (0, 1) if not np.any(want[4 * j:4 * j + 4])}


# --------------------------------------------------------------------------- planners and NaN rewards


def test_swap_candidates_need_two_scorable_rows_that_differ(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        # group 1: [1, 1, nan, nan] (no gradient in TRL), group 2: [1, 0, nan, nan], group 3: all nan
        extend(store, [1] * 4 + [2] * 4 + [3] * 4, [0] * 12, [1, 1, NAN, NAN, 1, 0, NAN, NAN] + [NAN] * 4)
        planner = SwapZeroStdPlanner(PromptGroupSampler(samples_per_group=4, strategy="variance", seed=0),
                                     np.random.Generator(np.random.PCG64(0)), num_generations=4)
        assert planner.candidates(store) == [2]
        fresh = FreshBatch(np.array([7] * 4 + [8] * 4), np.array([1, 1, NAN, NAN, 0, 1, 0, 1.0]), np.zeros(8))
        plan = planner.plan(store, fresh, step=1)
        assert plan.positions.tolist() == [0, 1, 2, 3] and plan.group_size == 4
        got = store.read(plan.rows, ["prompt_id", "rewards"])
        assert got["prompt_id"].tolist() == [2] * 4
        # the replayed group's recomputed advantages are TRL's for it
        adv = recompute_advantages(plan, got["rewards"], got["prompt_id"], fresh, planner, store, 1, "group")
        np.testing.assert_allclose(adv, trl_advantages(got["rewards"], 4))


def test_repo_recomputes_against_fresh_rows_with_nan(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        extend(store, [5] * 4, [0] * 4, [1, 1, NAN, NAN])
        planner = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                              num_generations=4)
        fresh = FreshBatch(np.array([5] * 4), np.array([1, 1, NAN, NAN]), np.zeros(4))
        plan = planner.plan(store, fresh, step=1)
        assert plan.rows.tolist() == [3, 2] and plan.positions.tolist() == [2, 3]
        got = store.read(plan.rows, ["prompt_id", "rewards"])
        adv = recompute_advantages(plan, got["rewards"], got["prompt_id"], fresh, planner, store, 1, "group")
        assert adv.tolist() == [0.0, 0.0]
        plan = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="reward", seed=0), 2,
                           num_generations=4).plan(store, fresh, step=1)
        assert plan.rows.tolist() == [1, 0]  # an unscorable row ranks last


# --------------------------------------------------------------------------- timelines


def discarded_timeline_store(path):
    """Rows 0-7 at versions 0, 1 (kept), 8-15 at versions 2, 3 (after the checkpoint: discarded),
    16-23 at versions 2, 3 again (the resumed run). Versions are not monotone along the rows."""
    store = ReplayStore(path)
    for v in (0, 1, 2, 3, 2, 3):
        extend(store, [1, 1, 2, 2], [v] * 4, [0, 1, 0, 1], advantages=[5.0] * 4)
    return store


def test_excluded_rows_are_never_drawn_by_any_planner(tmp_path):
    with discarded_timeline_store(tmp_path / "s") as store:
        timeline = Timeline().resumed(checkpoint_rows=8, store_rows=16)
        assert timeline.count(store.head, store.next_row) == 8
        fresh = FreshBatch(np.array([1] * 4 + [2] * 4), np.array([0, 0, 0, 0, 1, 1, 1, 1.0]), np.zeros(8))
        ssr = SsrPlanner(PrioritizedSampler(seed=0), 8.0, num_generations=4, timeline=timeline)
        repo = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                           num_generations=4, timeline=timeline)
        swap = SwapZeroStdPlanner(PromptGroupSampler(samples_per_group=4, strategy="variance", seed=0),
                                  np.random.Generator(np.random.PCG64(0)), num_generations=4, timeline=timeline)
        any_ = RepoAnyPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                              np.random.Generator(np.random.PCG64(0)), num_generations=4, timeline=timeline)
        for step in range(5):
            for planner in (ssr, repo, swap, any_):
                drawn = planner.plan(store, fresh, step).rows
                assert len(drawn) and not timeline.contains(drawn).any(), (type(planner).__name__, drawn)
        # the planner counts eligible rows with the sampler's own rule
        assert ssr.eligible(store, ssr.draw(store, 0)).tolist() == [True] * 8 + [False] * 8 + [True] * 8
        # the versions of the discarded rows are not touched: a version bound still means what it says
        lagged = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                             num_generations=4, max_policy_lag=1, timeline=timeline)
        assert lagged.draw(store, 4) == Draw(3, ((8, 16),), None)
        rows = lagged.plan(store, fresh, 4).rows
        assert set(store.read(rows, ["policy_version"])["policy_version"].tolist()) == {3}
        assert rows.min() >= 16


def test_a_new_timeline_takes_effect_on_the_next_draw_of_a_used_sampler(tmp_path):
    # the merge bug: the sampler had cached the rows' versions before the exclusion was known
    with discarded_timeline_store(tmp_path / "s") as store:
        repo = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                           num_generations=4)
        fresh = FreshBatch(np.array([1] * 4 + [2] * 4), np.zeros(8), np.zeros(8))
        assert repo.plan(store, fresh, 3).rows.max() >= 16
        repo.set_timeline(Timeline(((12, 24),)))
        assert repo.plan(store, fresh, 3).rows.max() < 12


def test_resume_excludes_rows_newer_than_the_checkpoint(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        for v in (0, 1, 2, 3):  # a run that checkpointed at step 2 (8 rows) and died after step 3
            extend(store, [1, 1, 2, 2], [v] * 4, [0, 1, 0, 1])
        timeline = Timeline().resumed(checkpoint_rows=8, store_rows=store.next_row)
        repo = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                           num_generations=4, timeline=timeline)
        fresh = FreshBatch(np.array([1] * 4 + [2] * 4), np.zeros(8), np.zeros(8))
        plan = repo.plan(store, fresh, step=2)
        versions = store.read(plan.rows, ["policy_version"])["policy_version"]
        assert versions.tolist() == [1] * 4  # not the discarded step-3 rows, although they are newer
        unbounded = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                                num_generations=4)
        assert store.read(unbounded.plan(store, fresh, 2).rows, ["policy_version"])["policy_version"].tolist() \
            == [3] * 4


def test_window_and_lag_with_versions_that_go_back(tmp_path):
    with discarded_timeline_store(tmp_path / "s") as store:
        timeline = Timeline(((8, 16),))
        ssr = SsrPlanner(PrioritizedSampler(seed=0), 1.0, num_generations=4, window=8, timeline=timeline)
        assert ssr.draw(store, 4).min_row == 16  # the newest 8 kept rows are 16-23
        fresh = FreshBatch(np.zeros(32, dtype=np.int64), np.zeros(32), np.zeros(32))
        assert (ssr.plan(store, fresh, 4).rows >= 16).all()
        # a window across the excluded range: rows 4-7 and 16-23
        wide = SsrPlanner(PrioritizedSampler(seed=0), 8.0, num_generations=4, window=12, timeline=timeline)
        assert wide.draw(store, 4).min_row == 4
        assert set(wide.plan(store, fresh, 4).rows.tolist()) == set(range(4, 8)) | set(range(16, 24))
        # a lag bound that only the discarded rows would meet: nothing is replayable
        lagged = SsrPlanner(PrioritizedSampler(seed=0), 1.0, num_generations=4, max_policy_lag=0,
                            timeline=Timeline(((8, 24),)))
        assert lagged.plan(store, fresh, 3).rows.tolist() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=5), st.integers(0, 30),
       st.integers(0, 40), st.integers(1, 50))
def test_window_start_matches_a_plain_count(ranges, head, length, window):
    timeline = Timeline().resumed(0, 0)
    for a, n in ranges:
        timeline = timeline.resumed(a, a + n)
    nxt = head + length
    start = timeline.window_start(head, nxt, window)
    kept = [r for r in range(head, nxt) if not timeline.contains(np.array([r]))[0]]
    assert start == (kept[-window] if len(kept) >= window else head)


def test_replay_state_survives_a_checkpoint_holder(tmp_path):
    rng = np.random.Generator(np.random.PCG64(7))
    sampler = PrioritizedSampler(seed=3)
    state = ReplayState("ssr", sampler.state_dict(), rng, next_row=40, global_step=5, store_path="/s",
                        timeline=Timeline(((16, 32), (8, 12))))
    save_checkpoint_state(str(tmp_path / "holder"), state)
    back = load_checkpoint_state(str(tmp_path / "holder"))
    assert back.timeline.excluded == ((8, 12), (16, 32)) and back.next_row == 40 and back.global_step == 5
    assert back.rng.random() == rng.random()
    PrioritizedSampler(seed=0).load_state_dict(back.sampler)
    assert load_checkpoint_state(str(tmp_path / "none")) is None


def test_repo_recomputes_with_the_replayed_row_in_its_group(tmp_path):
    """Against fresh rewards without spread (a prompt solved 4/4 now, 0/4 earlier) a replayed 0 got
    (0 - 1) / (0 + 1e-4) = -10,000: the baseline left the replayed row's own reward out of the std,
    which TRL never does (a row is in its group)."""
    with ReplayStore(tmp_path / "s") as store:
        extend(store, [5] * 4, [0] * 4, [0.0, 0.0, 0.0, 0.0])
        planner = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                              num_generations=4)
        fresh = FreshBatch(np.array([5] * 4), np.array([1.0, 1.0, 1.0, 1.0]), np.zeros(4))
        plan = planner.plan(store, fresh, step=1)
        got = store.read(plan.rows, ["prompt_id", "rewards"])
        adv = recompute_advantages(plan, got["rewards"], got["prompt_id"], fresh, planner, store, 1, "group")
        want = group_advantages(np.array([0.0]), np.array([1.0, 1.0, 1.0, 1.0, 0.0]), "group")[0]
        np.testing.assert_allclose(adv, [want, want])
        assert -3 < want < -1


def test_swap_with_stored_advantages_needs_rows_that_move_the_loss(tmp_path):
    """A prompt solved 4/4 in one generation batch and 0/4 in another has reward spread across its
    stored rows, but every row was stored with advantage 0: swapped in with its stored advantages it gave
    no gradient either (while replay/fraction said 1.0)."""
    with ReplayStore(tmp_path / "s") as store:
        extend(store, [1] * 4, [0] * 4, [1.0] * 4, advantages=[0.0] * 4)
        extend(store, [1] * 4, [1] * 4, [0.0] * 4, advantages=[0.0] * 4)
        extend(store, [2] * 4, [1] * 4, [1.0, 0.0, 1.0, 0.0], advantages=[1.0, -1.0, 1.0, -1.0])

        def planner(stored):
            return SwapZeroStdPlanner(PromptGroupSampler(samples_per_group=4, strategy="variance", seed=0),
                                      np.random.Generator(np.random.PCG64(0)), stored_advantages=stored,
                                      num_generations=4)

        assert planner(False).candidates(store) == [1, 2]  # recomputed: group 1's spread is a gradient
        assert planner(True).candidates(store) == [2]


# --------------------------------------------------------------------------- one epoch: prompts that never recur


def one_epoch_store(path):
    """Steps 0-2 each stored one group of 4 rows for each of two new prompts (keys 10+2v, 11+2v)."""
    store = ReplayStore(path)
    for v in range(3):
        extend(store, [10 + 2 * v] * 4 + [11 + 2 * v] * 4, [v] * 8, [0, 1, 0, 1] * 2)
    return store


def test_repo_replays_nothing_when_prompts_do_not_recur_and_says_why(tmp_path):
    with one_epoch_store(tmp_path / "s") as store:
        fresh = FreshBatch(np.array([20] * 4 + [21] * 4), np.zeros(8), np.zeros(8))
        repo = RepoPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                           num_generations=4, max_policy_lag=1)
        plan = repo.plan(store, fresh, step=3)
        assert len(plan) == 0 and plan.eligible_groups == 0
        why = repo.explain(store, fresh, step=3)
        assert "none of the batch's 2 prompt(s) has replay_min_generations=2 stored row(s) within " \
            "max_policy_lag=1 steps (policy_version >= 2)" in why
        assert "8 such row(s) in 2 group(s) (2 with 2 or more)" in why and "repo_any" in why
        # a prompt that recurs is counted
        again = FreshBatch(np.array([14] * 4 + [21] * 4), np.zeros(8), np.zeros(8))
        assert repo.plan(store, again, step=3).eligible_groups == 1
    with ReplayStore(tmp_path / "empty") as store:  # nothing stored yet: nothing to explain
        assert repo.plan(store, fresh, step=0).eligible_groups == 0
        assert repo.explain(store, fresh, step=0) is None


def test_repo_any_replays_groups_of_any_prompt_within_the_lag(tmp_path):
    with one_epoch_store(tmp_path / "s") as store:
        fresh = FreshBatch(np.array([20] * 4 + [21] * 4), np.zeros(8), np.zeros(8))
        planner = RepoAnyPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                                 np.random.Generator(np.random.PCG64(0)), num_generations=4, max_policy_lag=1)
        assert planner.candidates(store, planner.draw(store, 3)) == [14, 15]  # steps >= 2 only
        plan = planner.plan(store, fresh, step=3)
        assert plan.eligible_groups == 2 and plan.positions.tolist() == [2, 3, 6, 7]
        got = store.read(plan.rows, ["prompt_id", "policy_version"])
        assert got["policy_version"].tolist() == [2] * 4
        # two distinct groups, k rows each, the newest of each (recency)
        assert sorted(set(got["prompt_id"].tolist())) == [14, 15]
        assert sorted(plan.rows.tolist()) == [18, 19, 22, 23]
        # more groups in the batch than stored: groups repeat
        wide = FreshBatch(np.repeat(np.arange(30, 35), 4), np.zeros(20), np.zeros(20))
        assert len(planner.plan(store, wide, step=3)) == 10
        # a group needs replay_min_generations eligible rows; too old is not eligible
        strict = RepoAnyPlanner(PromptGroupSampler(samples_per_group=2, strategy="recency", seed=0), 2,
                                np.random.Generator(np.random.PCG64(0)), num_generations=4, max_policy_lag=1,
                                min_generations=5)
        assert strict.plan(store, fresh, step=3).eligible_groups == 0
        assert "none of the 6 stored group(s) has replay_min_generations=5 row(s) within max_policy_lag=1" \
            in strict.explain(store, fresh, step=3)
        assert len(planner.plan(store, fresh, step=9)) == 0
        assert "(0 of the 24 stored rows are)" in planner.explain(store, fresh, step=9)
        # appended, a plan is whole optimizer steps
        appended = RepoAnyPlanner(PromptGroupSampler(samples_per_group=1, strategy="recency", seed=0), 1,
                                  np.random.Generator(np.random.PCG64(0)), num_generations=4,
                                  steps_per_generation=2, append=True)
        plan = appended.plan(store, FreshBatch(np.repeat([20, 21, 22], 4), np.zeros(12), np.zeros(12)), step=3)
        assert plan.positions is None and len(plan) == 2


def test_repo_any_candidates_are_ordered_by_rows_not_by_group_codes(tmp_path):
    """A reopened store numbers its groups afresh; the draw must not depend on that."""
    with ReplayStore(tmp_path / "s") as store:
        extend(store, [7, 7, 3, 3], [0] * 4, [0, 1, 0, 1])
        extend(store, [5, 5, 7, 7], [1] * 4, [0, 1, 0, 1])
        planner = RepoAnyPlanner(PromptGroupSampler(samples_per_group=2, seed=0), 2,
                                 np.random.Generator(np.random.PCG64(0)), num_generations=2)
        assert planner.candidates(store) == [7, 3, 5]
        # rows 0-1 excluded (a discarded timeline): prompt 7's first eligible row is 6
        planner.set_timeline(Timeline(((0, 2),)))
        assert planner.candidates(store, planner.draw(store, 2)) == [3, 5, 7]
    with ReplayStore(tmp_path / "s", readonly=True) as store:
        assert planner.candidates(store, planner.draw(store, 2)) == [3, 5, 7]


def test_swap_explains_only_a_batch_with_groups_to_replace(tmp_path):
    with one_epoch_store(tmp_path / "s") as store:
        swap = SwapZeroStdPlanner(PromptGroupSampler(samples_per_group=4, strategy="variance", seed=0),
                                  np.random.Generator(np.random.PCG64(0)), num_generations=4, max_policy_lag=0)
        spread = FreshBatch(np.array([20] * 4), np.array([0, 1, 0, 1.0]), np.zeros(4))
        assert swap.plan(store, spread, step=3).eligible_groups == 0
        assert swap.explain(store, spread, step=3) is None  # nothing to replace
        flat = FreshBatch(np.array([20] * 4), np.ones(4), np.zeros(4))
        assert "1 group(s) of the batch have no reward spread" in swap.explain(store, flat, step=3)
        assert swap.plan(store, flat, step=2).eligible_groups == 2
