"""The robot task registry: one ``TaskSpec`` per task, added with ``register_task``, read by the CLIs
and the demo generator (no task names hard-coded elsewhere)."""

import numpy as np
import pytest

from mmpo.robotics.cli import _demos_parser
from mmpo.robotics.demos import CanExpert, LiftExpert, SquareExpert, make_expert
from mmpo.robotics.envs import OBS_KEYS, TASKS, TaskSpec, expert_tasks, get_task, register_task
from mmpo.robotics.rollout_cli import _parser as rollout_parser


class _Expert:
    def __init__(self, noise=0.0, rng=None):
        self.noise, self.rng = noise, rng


@pytest.fixture
def extra_task():
    spec = register_task(TaskSpec("test_extra", "robosuite", "Lift", OBS_KEYS["lift"], 40, 19, 7, expert=_Expert))
    yield spec
    del TASKS["test_extra"], OBS_KEYS["test_extra"]


def test_builtin_entries_carry_their_experts():
    stl = [f"stl_{body}{k}{suffix}" for body in ("pointmass", "reacher") for k in (2, 3, 4)
           for suffix in ("", "_robustness")]  # TGPO's and its flat baseline's (no expert)
    stl += [f"stl_reacher{k}_inner{suffix}" for k in (2, 3, 4) for suffix in ("", "_robustness")]
    assert sorted(TASKS) == sorted(["can", "hopper", "lift", "lift_img", "square", *stl, "stl_pointmass2_tight"])
    assert expert_tasks() == ["can", "lift", "lift_img", "square"]
    lift = get_task("lift").make_expert(noise=0.2, rng=np.random.default_rng(0))
    assert type(lift) is LiftExpert and lift.noise == 0.2
    assert type(make_expert("can")) is CanExpert and type(make_expert("square")) is SquareExpert
    with pytest.raises(ValueError, match="'hopper' has no scripted expert"):
        get_task("hopper").make_expert()
    assert (get_task("lift").obs_dim, get_task("can").obs_dim, get_task("lift").max_episode_steps) == (19, 23, 300)
    # robomimic Square: NutAssemblySquare, 23-D state (DPPO cfg/robomimic/finetune/square: obs_dim 23), 400 steps
    square = get_task("square")
    assert (square.sim_name, square.obs_dim, square.action_dim, square.max_episode_steps) == (
        "NutAssemblySquare", 23, 7, 400)


def test_register_task_is_all_a_new_task_needs(extra_task):
    assert get_task("TEST_EXTRA") is extra_task and OBS_KEYS["test_extra"] == OBS_KEYS["lift"]
    assert "test_extra" in expert_tasks()
    expert = make_expert("test_extra", noise=0.1)
    assert isinstance(expert, _Expert) and expert.noise == 0.1
    # the CLIs' --task choices come from the registry, so the new task is accepted at once
    args = _demos_parser().parse_args(["--task", "test_extra", "--num-demos", "1", "--out", "x.hdf5"])
    assert args.task == "test_extra"
    assert rollout_parser().parse_args(["--ckpt", "c.ckpt", "--task", "test_extra"]).task == "test_extra"


def test_demos_cli_offers_only_tasks_with_experts(capsys):
    with pytest.raises(SystemExit):
        _demos_parser().parse_args(["--task", "hopper", "--num-demos", "1", "--out", "x.hdf5"])
    assert "--task {can,lift,lift_img,square}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        (TaskSpec("lift", "robosuite", "Lift", ("a",), 10, 3, 1), "already registered"),
        (TaskSpec("Upper", "robosuite", "Lift", ("a",), 10, 3, 1), "lower case"),
        (TaskSpec("odd", "isaac", "X", ("a",), 10, 3, 1), "unknown family 'isaac'"),
        (TaskSpec("odd", "gymnasium", "X", ("a",), 10, 0, 1), "obs_dim must be >= 1"),
    ],
)
def test_register_task_refuses_bad_entries(spec, message):
    before = dict(TASKS)
    with pytest.raises(ValueError, match=message):
        register_task(spec)
    assert TASKS == before


def test_replace_redefines_a_task():
    original = TASKS["hopper"]
    try:
        changed = TaskSpec("hopper", "gymnasium", "Hopper-v5", ("observation",), 500, 11, 3)
        register_task(changed, replace=True)
        assert get_task("hopper").max_episode_steps == 500
    finally:
        register_task(original, replace=True)
    assert get_task("hopper") is original
