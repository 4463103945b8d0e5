"""Pipelined DPPO collection (``env_groups``, issue 19): the envs in groups stepped one group at a time
(mmpo.robotics.envs.groups.EnvGroups), the rollout the same as with one batched call."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from mmpo.robotics.config import EvalConfig, merged_settings
from mmpo.robotics.dppo import DPPOModule, Rollout
from mmpo.robotics.envs.groups import EnvGroups, concat_infos, group_sizes
from mmpo.robotics.envs.workers import EnvWorkerError
from mmpo.robotics.policy import DiffusionPolicy
from mmpo.robotics.policy.io import save_policy_safetensors

from robotics_reach import reach_envs  # tests/ is on sys.path (tests/conftest.py)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bc_checkpoint(tmp_path_factory) -> str:
    """A random diffusion policy for the 1-D reach task (K = 5; throughput and bookkeeping need no training)."""
    torch.manual_seed(0)
    policy = DiffusionPolicy(2, 1, 2, denoising_steps=5, hidden_dims=[64, 64, 64])
    path = tmp_path_factory.mktemp("bc") / "policy.safetensors"
    return str(save_policy_safetensors(policy, {"kind": "bc", "task": "reach", "act_steps": 2}, path))


def make_module(bc_checkpoint: str, **kwargs) -> DPPOModule:
    torch.manual_seed(0)
    settings = dict(num_iterations=2, env={"num_envs": 4, "n_steps": 6}, chain={"ft_steps": 4}, returns={"gamma": 0.99},
                    optim={"minibatch_size": 40, "mu": 1}, evaluation={"every": 0}, critic={"hidden_dims": [16]},
                    env_factory=reach_envs, loss={"target_kl": None})
    return DPPOModule(bc_checkpoint, **merged_settings(settings, kwargs))
FIELDS = ("obs", "chains", "old_log_probs", "rewards", "terminated", "truncated", "episode_start", "reached_obs")


def _rollout(bc_checkpoint: str, env_groups: int, split_act: list[slice] | None = None, **kwargs) -> tuple[DPPOModule, Rollout]:
    module = make_module(bc_checkpoint, env={"num_envs": 5, "n_steps": 14, "env_groups": env_groups}, **kwargs)
    if split_act is not None:
        # env_groups=1 with the batched call split into the groups' row blocks (the same noise rows): the
        # network then sees exactly the batches a pipelined rollout gives it
        def act(obs: torch.Tensor):
            noise = module.draw_step_noise(len(obs))
            parts = [DPPOModule.act(module, obs[rows], noise=[draw[rows] for draw in noise]) for rows in split_act]
            return tuple(torch.cat(part) for part in zip(*parts))

        module.act = act
    module.envs = module.make_envs()
    rollout = module.collect_rollout()
    return module, rollout


def test_group_sizes_and_concat_infos_by_hand():
    assert group_sizes(5, 2) == [3, 2] and group_sizes(4, 4) == [1, 1, 1, 1] and group_sizes(3, 1) == [3]
    with pytest.raises(ValueError, match="env groups must be in"):
        group_sizes(2, 3)
    first = {"success": np.array([True, False]), "_success": np.array([True, True]),
             "final_obs": np.array([None, np.ones(2)], dtype=object), "_final_obs": np.array([False, True]),
             "final_info": {"fault": np.array([False, True]), "_fault": np.array([False, True])}}
    second = {"success": np.array([True]), "_success": np.array([True]), "count": np.array([7])}
    merged = concat_infos([first, second], [2, 1])
    assert merged["success"].tolist() == [True, False, True] and merged["_success"].tolist() == [True] * 3
    assert merged["count"].tolist() == [0, 0, 7]  # gymnasium's fill where a group lacks the key
    assert merged["final_obs"][0] is None and merged["final_obs"][2] is None
    np.testing.assert_array_equal(merged["final_obs"][1], np.ones(2))
    assert merged["_final_obs"].tolist() == [False, True, False]
    assert merged["final_info"]["fault"].tolist() == [False, True, False]
    assert merged["final_info"]["_fault"].tolist() == [False, True, False]


def test_env_groups_reset_seeds_and_steps_like_one_vector_env():
    groups = EnvGroups([reach_envs(2, 0, 2), reach_envs(1, 0, 2)])
    whole = reach_envs(3, 0, 2)
    obs, _ = groups.reset(seed=9)
    expected, _ = whole.reset(seed=9)  # env i seeded 9 + i in both
    np.testing.assert_array_equal(obs, expected)
    actions = np.full((3, 2, 1), 0.5, dtype=np.float32)
    for _ in range(8):  # 2 x 8 = 16 > 12 steps: one episode ends in every env (SAME_STEP autoreset)
        got, want = groups.step(actions), whole.step(actions)
        for a, b in zip(got[:4], want[:4]):
            np.testing.assert_array_equal(a, b)
        assert got[4].keys() == want[4].keys()
    assert groups.num_envs == 3 and groups.action_space.shape == (3, 2, 1)
    assert groups.get_attr("act_steps") == (2, 2, 2)
    groups.close()
    whole.close()


def test_pipelined_rollout_equals_the_same_batches_exactly(bc_checkpoint):
    """env_groups=2 on 5 envs ([3, 2]) is bit-identical to env_groups=1 whose one batched call is split into the
    same row blocks: the pipelining, the noise split and the bookkeeping change nothing but the batch shape."""
    grouped_module, grouped = _rollout(bc_checkpoint, 2)
    reference_module, reference = _rollout(bc_checkpoint, 1, split_act=[slice(0, 3), slice(3, 5)])
    assert isinstance(grouped_module.envs, EnvGroups) and grouped_module.envs.sizes == [3, 2]
    for name in FIELDS:
        assert torch.equal(getattr(grouped, name), getattr(reference, name)), name
    # 14 chunk steps x 2 actions = 28 > 12-step episodes: episodes ended inside the rollout
    assert grouped.truncated.any() and grouped.episode_start[1:].any()
    assert grouped_module.train_tracker.summary() == reference_module.train_tracker.summary()
    assert grouped_module.train_tracker.env_steps == reference_module.train_tracker.env_steps == 5 * 14 * 2
    assert torch.equal(grouped_module._generator.get_state(), reference_module._generator.get_state())
    np.testing.assert_array_equal(grouped_module._obs, reference_module._obs)


def test_pipelined_rollout_matches_one_batched_call_and_rescores_to_ratio_one(bc_checkpoint):
    """Against plain env_groups=1 (one batch of 5): the same rollout up to the network's float rounding on a
    smaller batch; the stored log-probs are exactly what the update recomputes (ratio 1), and replaying the
    executed chunks on fresh envs gives the stored rewards and observations."""
    module, grouped = _rollout(bc_checkpoint, 3)  # [2, 2, 1]
    _, plain = _rollout(bc_checkpoint, 1)
    for name in FIELDS:
        torch.testing.assert_close(getattr(grouped, name), getattr(plain, name), rtol=0, atol=1e-5, msg=name)
    steps, envs, ft = grouped.old_log_probs.shape
    rows = torch.arange(steps * envs).repeat_interleave(ft)
    ft_index = torch.arange(ft).repeat(steps * envs)
    rescored = module.rescore(grouped.obs.reshape(steps * envs, -1)[rows],
                              grouped.chains.reshape(steps * envs, *grouped.chains.shape[2:])[rows], ft_index)
    stored = grouped.old_log_probs.reshape(steps * envs, ft)[rows, ft_index]
    assert (rescored - stored).abs().max().item() < 1e-6
    # replay: the executed chunks (the chains' last state) on a fresh vector env with the rollout's reset seed
    replay = reach_envs(5, 0, 2)
    obs, _ = replay.reset(seed=module.hparams.seed)  # iteration 0: seed + 1000 * 0
    for step in range(steps):
        np.testing.assert_array_equal(obs, grouped.obs[step].numpy())
        obs, rewards, terminated, truncated, _ = replay.step(grouped.chains[step, :, -1].numpy())
        np.testing.assert_array_equal(rewards.astype(np.float32), grouped.rewards[step].numpy())
        assert truncated.tolist() == grouped.truncated[step].tolist()
    replay.close()


def test_env_groups_setting_is_checked(bc_checkpoint):
    with pytest.raises(ValueError, match=r"env_groups must be in \[1, num_envs=2\], got 3"):
        make_module(bc_checkpoint, env={"num_envs": 2, "env_groups": 3})


def test_pipelined_collection_on_subprocess_workers_with_a_killed_worker(tmp_path):
    """Real worker processes (Hopper, 2 groups of 1): the pipelined rollout equals the split-batch one exactly; a
    worker killed mid-run is restarted and its episode ends as a fault; the groups share one restart budget."""
    torch.manual_seed(0)
    policy = DiffusionPolicy(11, 3, 2, denoising_steps=3, hidden_dims=[8, 8, 8])  # Hopper: obs 11, action 3
    checkpoint = save_policy_safetensors(policy, {"kind": "bc", "task": "hopper", "act_steps": 2},
                                         tmp_path / "policy.safetensors")
    settings = dict(num_iterations=2, chain={"ft_steps": 2}, optim={"minibatch_size": 12, "mu": 1},
                    evaluation={"every": 0}, critic={"hidden_dims": [8]})
    env = {"num_envs": 2, "n_steps": 5, "max_episode_steps": 6, "max_worker_restarts": 1}
    grouped = DPPOModule(str(checkpoint), env={**env, "env_groups": 2}, **settings)
    plain = DPPOModule(str(checkpoint), env=env, **settings)
    plain.act = lambda obs: tuple(torch.cat(part) for part in zip(*[
        DPPOModule.act(plain, obs[rows], noise=[draw[rows] for draw in noise])
        for noise in [plain.draw_step_noise(len(obs))] for rows in (slice(0, 1), slice(1, 2))]))
    grouped.envs, plain.envs = grouped.make_envs(), plain.make_envs()
    try:
        first, reference = grouped.collect_rollout(), plain.collect_rollout()
        for name in FIELDS:
            assert torch.equal(getattr(first, name), getattr(reference, name)), name
        assert first.truncated.any()  # 5 chunk steps x 2 = 10 > 6-step episodes
        group = grouped.envs.groups[1]
        os.kill(group.processes[0].pid, signal.SIGKILL)
        group.processes[0].join(timeout=10)
        second = grouped.collect_rollout()  # the reset finds env 1's worker dead: restarted, exactly reset
        assert grouped.envs.worker_restarts == 1 and second.obs.shape == (5, 2, 11)
        assert torch.equal(second.obs[0], first.obs[0])  # the same seeded reset (iteration 0) in the new worker
        other = grouped.envs.groups[0]
        os.kill(other.processes[0].pid, signal.SIGKILL)  # the other group: the shared budget (1) is spent
        other.processes[0].join(timeout=10)
        with pytest.raises(EnvWorkerError, match=r"env worker 0 \(hopper, seed 0, pid \d+\) died .*max_worker_restarts=1"):
            grouped.collect_rollout()
    finally:
        grouped.envs.close(terminate=True)
        plain.envs.close(terminate=True)


def _hopper_checkpoint(tmp_path) -> str:
    torch.manual_seed(0)
    policy = DiffusionPolicy(11, 3, 2, denoising_steps=3, hidden_dims=[8, 8, 8])
    return str(save_policy_safetensors(policy, {"kind": "bc", "task": "hopper", "act_steps": 2},
                                       tmp_path / "policy.safetensors"))


def _hopper_fit(checkpoint: str, root, eval_at_0_and_2: bool, instrument=None, *, minibatch_size: int,
                **env) -> DPPOModule:
    """A 3-iteration DPPO fit on 2 Hopper subprocess workers (6-step episodes); ``instrument(module)`` runs
    before the fit."""
    import lightning.pytorch as pl

    torch.manual_seed(0)
    module = DPPOModule(checkpoint, num_iterations=3, env={"num_envs": 2, "max_episode_steps": 6, **env},
                        chain={"ft_steps": 2}, optim={"minibatch_size": minibatch_size, "mu": 1}, evaluation={"every": 0},
                        critic={"hidden_dims": [8], "warmup_iterations": 0}, loss={"target_kl": None})
    if eval_at_0_and_2:
        module.evaluation = EvalConfig(every=1000, episodes=2)
    if instrument is not None:
        instrument(module)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module)
    return module


def _assert_same_fit(plain: DPPOModule, other: DPPOModule) -> None:
    for key, value in plain.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
    for key, value in plain.last_metrics.items():
        if not key.startswith("perf/env_steps_per_s"):
            assert value == other.last_metrics[key] or (np.isnan(value) and np.isnan(other.last_metrics[key])), key


@pytest.mark.parametrize("env_groups", [1, 2])
def test_prefetched_reset_changes_nothing(tmp_path, env_groups):
    """prefetch_reset: the next iteration's reset runs in the workers during the update; the fit is bit-identical
    (weights, metrics) to one that resets at the rollout's start. Hopper on subprocess workers, 3 iterations,
    evaluation after iterations 0 and 2 (none is prefetched before an evaluation, nor after the last iteration):
    one prefetch, after iteration 1 for iteration 2."""
    checkpoint = _hopper_checkpoint(tmp_path)
    fits = {}
    for prefetch in (False, True):
        started = []

        def instrument(module: DPPOModule) -> None:
            start_reset = module.start_reset
            module.start_reset = lambda iteration: started.append(start_reset(iteration)) or started[-1]

        module = _hopper_fit(checkpoint, tmp_path / str(prefetch), True, instrument, n_steps=4, minibatch_size=8,
                             env_groups=env_groups, prefetch_reset=prefetch)
        fits[prefetch] = (module, started)
    (plain, plain_started), (prefetched, prefetched_started) = fits[False], fits[True]
    assert plain_started == [] and prefetched_started == [True]
    _assert_same_fit(plain, prefetched)


@pytest.mark.parametrize("env_groups", [1, 2])
def test_skipping_the_final_autoreset_leaves_the_rollouts_unchanged(bc_checkpoint, env_groups):
    """Reach episodes are 6 chunk steps: a 12-step rollout ends episodes at steps 6 and 12. With
    skip_final_autoreset the reset after step 12 (thrown away by the next iteration's seeded reset) is skipped;
    every recorded tensor of two consecutive rollouts is the same as with gymnasium's plain autoreset."""
    rollouts, skipped = {}, {}
    for skip in (False, True):
        module = make_module(bc_checkpoint, env={"num_envs": 4, "n_steps": 12, "env_groups": env_groups,
                                                 "skip_final_autoreset": skip})
        module.envs = module.make_envs()
        first = module.collect_rollout()
        module.iteration += 1
        rollouts[skip] = (first, module.collect_rollout())
        skipped[skip] = module.envs.get_attr("skipped_resets")
        module.envs.close()
    assert skipped[False] == (0, 0, 0, 0) and skipped[True] == (2, 2, 2, 2)  # one per env and rollout
    for before, after in zip(rollouts[False], rollouts[True]):
        assert bool(before.episode_start[6].all()) and bool(before.truncated[11].all())
        for field in FIELDS:
            torch.testing.assert_close(getattr(after, field), getattr(before, field), rtol=0, atol=0)


def test_skip_final_autoreset_is_off_without_a_reset_at_each_iteration(bc_checkpoint):
    module = make_module(bc_checkpoint, env={"num_envs": 2, "n_steps": 6, "reset_at_iteration": False})
    module.envs = module.make_envs()
    module.collect_rollout()
    module.collect_rollout()  # the episodes go on across rollouts: the autoreset after step 6 must have run
    assert module.envs.get_attr("skipped_resets") == (0, 0)
    module.envs.close()


def test_skipped_final_autoreset_on_subprocess_workers_with_prefetch_changes_nothing(tmp_path):
    """Hopper on 2 groups of subprocess workers, prefetched resets, 6-step episodes = 3 chunk steps = one rollout:
    every rollout's last step ends every episode. Skipping those autoresets (one per env and iteration) leaves
    the fit bit-identical."""
    checkpoint = _hopper_checkpoint(tmp_path)
    fits = {}
    for skip in (False, True):
        skipped = []

        def instrument(module: DPPOModule) -> None:
            collect = module.collect_rollout

            def collect_and_count() -> Rollout:
                rollout = collect()
                skipped.append(module.envs.get_attr("skipped_resets"))
                return rollout

            module.collect_rollout = collect_and_count

        module = _hopper_fit(checkpoint, tmp_path / str(skip), False, instrument, n_steps=3, minibatch_size=6,
                             env_groups=2, prefetch_reset=True, skip_final_autoreset=skip)
        fits[skip] = (module, skipped)
    (plain, plain_skipped), (skipping, skipping_skipped) = fits[False], fits[True]
    assert plain_skipped == [(0, 0)] * 3 and skipping_skipped == [(1, 1), (2, 2), (3, 3)]
    _assert_same_fit(plain, skipping)
