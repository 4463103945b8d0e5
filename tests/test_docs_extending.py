"""docs/extending.md: every recipe's code blocks run as written and assert their hand-computed values.

Each recipe is the doc section under its ``## `` heading; its ```python blocks are executed in order in
one namespace (the launcher block, which starts ``mmpo fit``, is only compiled), its ```yaml block is
fed to the module it configures. Registrations are undone afterwards.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mmpo.training.config import LossConfig, SamplingConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _section(heading: str) -> str:
    text = DOC.read_text()
    assert f"\n## {heading}\n" in text, f"docs/extending.md has no section {heading!r}"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def _run(code: str, namespace: dict) -> None:
    exec(compile(code, str(DOC), "exec"), namespace)


def test_every_section_is_a_recipe_with_code():
    headings = re.findall(r"^## (.+)$", DOC.read_text(), flags=re.M)
    assert {"A new advantage estimator", "A new algorithm module", "A new robot task"} <= set(headings)
    for heading in headings:  # no placeholder sections: each one shows code
        assert _blocks(_section(heading), "python"), f"section {heading!r} has no python code block"


@pytest.fixture
def unregister_estimator():
    from mmpo.core import ADVANTAGE_ESTIMATORS

    yield
    if "group_minmax" in ADVANTAGE_ESTIMATORS:
        ADVANTAGE_ESTIMATORS.unregister("group_minmax")


def test_advantage_estimator_recipe(unregister_estimator, tmp_path):
    from mmpo.core import ADVANTAGE_ESTIMATORS

    section = _section("A new advantage estimator")
    estimator_code, launcher_code = _blocks(section, "python")
    namespace: dict = {}
    _run(estimator_code, namespace)  # asserts the hand-computed advantages itself
    assert "group_minmax" in ADVANTAGE_ESTIMATORS
    compile(launcher_code, str(DOC), "exec")
    assert "import my_advantages" in launcher_code and "main(sys.argv[1:])" in launcher_code

    # `advantage: group_minmax` in a GRPO config reaches the estimator through the module
    (config,) = _blocks(section, "yaml")
    model = yaml.safe_load(config)["model"]
    assert model["class_path"] == "mmpo.algos.grpo.GRPOModule"
    from mmpo.algos.grpo import GRPOModule
    from mmpo.vlm.factory import build_tiny_vlm

    module = GRPOModule(str(build_tiny_vlm(tmp_path / "tiny")), sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.0), **model["init_args"])
    advantages, metrics = module.compute_advantages(namespace["rewards"], namespace["prompt_ids"], None)
    assert advantages.tolist() == [0.625, 0.0, -0.375, -0.375, 0.0, 0.125]
    assert metrics["advantages/minmax_range_mean"] == pytest.approx(4 / 6)

    # a name that is taken is refused
    with pytest.raises(ValueError, match="duplicate advantage estimator name 'group_minmax'"):
        _run(estimator_code, {})


def test_algorithm_module_recipe(tmp_path):
    hand_check, training = _blocks(_section("A new algorithm module"), "python")
    namespace: dict = {}
    _run(hand_check, namespace)  # asserts the term and the metric on hand values
    namespace["tiny_dir"] = tmp_path / "tiny"
    _run(training, namespace)  # two GRPO steps through the update engine
    algorithm = namespace["algorithm"]
    assert algorithm.training_step.__func__ is namespace["GRPOModule"].training_step  # hooks only
    assert algorithm.last_metrics["losses/over_budget"] < 0  # log-probs of real tokens


@pytest.fixture
def unregister_task():
    from mmpo.robotics.envs import OBS_KEYS, TASKS

    yield
    TASKS.pop("lift_short", None)
    OBS_KEYS.pop("lift_short", None)


def test_robot_task_recipe(unregister_task, tmp_path, monkeypatch):
    from mmpo.robotics.cli import _demos_parser
    from mmpo.robotics.data import load_demos
    from mmpo.robotics.envs import get_task, make_env

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (code,) = _blocks(_section("A new robot task"), "python")
    namespace: dict = {}
    _run(code, namespace)  # writes 2 demos and asserts their layout itself

    spec = get_task("lift_short")
    assert (spec.sim_name, spec.max_episode_steps, spec.obs_dim, spec.action_dim) == ("Lift", 120, 19, 7)
    assert isinstance(spec.make_expert(), namespace["ShortLiftExpert"])
    args = _demos_parser().parse_args(["--task", "lift_short", "--num-demos", "1", "--out", "d.hdf5"])
    assert args.task == "lift_short"
    env = make_env("lift_short", seed=0)
    try:
        obs, _ = env.reset()
        assert obs.shape == (19,) and env.action_space.shape == (7,)
    finally:
        env.close()
    demos = load_demos("runs/demos/lift_short.hdf5")  # robomimic's keys, concatenated as the task's obs
    assert len(demos) == 2
    assert all(demo.obs.shape[1] == 19 and demo.actions.shape[1] == 7 for demo in demos)
