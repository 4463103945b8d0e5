"""Task registry: which simulator, which observation keys, which defaults.

The robosuite tasks are set up the way robomimic (and DPPO, arXiv 2409.00588, which
trains on robomimic data) set them up: Panda arm, OSC_POSE delta control at 20 Hz,
sparse reward, ``ignore_done=True`` (episodes end only by the time limit), and a
low-dim state that concatenates robomimic's keys in the order DPPO's
``process_robomimic_dataset.py`` uses: robot0_eef_pos (3), robot0_eef_quat (4),
robot0_gripper_qpos (2), object (task-specific).

A task is ONE entry of :data:`TASKS`, a :class:`TaskSpec` carrying everything about it: the
simulator and its id, observation keys and dimensions, the episode length, extra simulator
kwargs and the scripted expert that writes its demonstrations. Add a task with
:func:`register_task`; the CLIs' ``--task`` choices, ``make_env`` and ``generate_demos`` read
the registry (docs/extending.md, "A new robot task").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class TaskSpec:
    """Static description of one task.

    Attributes:
        name: our task name ("lift", "can", "hopper").
        family: "robosuite" or "gymnasium".
        sim_name: robosuite environment name ("Lift") or gymnasium id ("Hopper-v5").
        obs_keys: low-dim observation keys, concatenated in this order.
        max_episode_steps: default time limit in env steps (robomimic/DPPO: 300 for lift/can).
        obs_dim: length of the flattened observation.
        action_dim: length of one action.
        extra_env_kwargs: merged last into the simulator's kwargs (robosuite: ``robosuite.make``).
        expert: the scripted expert that writes demos (``mmpo demos``): a class or factory called
            as ``expert(noise=..., rng=...)``, or its ``"module:attr"`` path (imported when first
            used); None for a task without one. The object it returns has
            ``start_episode(env)`` (called after each ``env.reset()`` with the unwrapped env) and
            ``act(raw_obs) -> action`` (see ``mmpo.robotics.demos.experts.ScriptedExpert``).
        camera: robosuite camera whose (image_size, image_size, 3) uint8 frame, upright, is the LAST observation
            key ``f"{camera}_image"``, flattened in (H, W, C) order into the flat float observation (pixel values
            0-255; the demo stats fix their range to [0, 255]); None for a state-only task.
        image_size: side of that frame (0 without a camera).
    """

    name: str
    family: str
    sim_name: str
    obs_keys: tuple[str, ...]
    max_episode_steps: int
    obs_dim: int
    action_dim: int
    extra_env_kwargs: dict[str, Any] = field(default_factory=dict)
    expert: Callable[..., Any] | str | None = None
    camera: str | None = None
    image_size: int = 0

    @property
    def image_dims(self) -> int:
        """How many trailing observation dimensions are pixels (3 image_size^2; 0 without a camera)."""
        return 3 * self.image_size * self.image_size if self.camera else 0

    def make_expert(self, *, noise: float = 0.0, rng: Any = None) -> Any:
        """A fresh scripted expert for this task; ``ValueError`` when the task has none."""
        if self.expert is None:
            raise ValueError(f"task {self.name!r} has no scripted expert; tasks with one: {expert_tasks()}")
        factory = self.expert
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(noise=noise, rng=rng)


ROBOMIMIC_LOW_DIM_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object")

#: name -> spec of every task; add to it with :func:`register_task`.
TASKS: dict[str, TaskSpec] = {}

#: name -> observation keys of every task (kept in step with ``TASKS`` by ``register_task``).
OBS_KEYS: dict[str, tuple[str, ...]] = {}


def register_task(spec: TaskSpec, *, replace: bool = False) -> TaskSpec:
    """Add ``spec`` to the registry under ``spec.name`` (lower case) and return it.

    Raises ``ValueError`` when the name is taken (unless ``replace``), the name is not lower
    case, the family is unknown or a dimension is not positive.
    """
    if spec.name != spec.name.lower() or not spec.name:
        raise ValueError(f"task names are non-empty and lower case, got {spec.name!r}")
    if spec.family not in FAMILIES:
        raise ValueError(f"task {spec.name!r}: unknown family {spec.family!r}; valid: {list(FAMILIES)}")
    for attr in ("max_episode_steps", "obs_dim", "action_dim"):
        if int(getattr(spec, attr)) < 1:
            raise ValueError(f"task {spec.name!r}: {attr} must be >= 1, got {getattr(spec, attr)}")
    if spec.camera is not None and (spec.image_size < 1 or spec.obs_keys[-1] != f"{spec.camera}_image"
                                    or spec.obs_dim <= spec.image_dims):
        raise ValueError(f"task {spec.name!r}: a camera task needs image_size >= 1, its last obs key "
                         f"{spec.camera}_image and obs_dim > 3 image_size^2")
    if spec.name in TASKS and not replace:
        raise ValueError(f"task {spec.name!r} is already registered; pass replace=True to redefine it")
    TASKS[spec.name] = spec
    OBS_KEYS[spec.name] = spec.obs_keys
    return spec


def get_task(task: str) -> TaskSpec:
    """Look up a task by name; raises ``ValueError`` naming the valid ones."""
    key = task.lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {sorted(TASKS)}")
    return TASKS[key]


def expert_tasks() -> list[str]:
    """Sorted names of the tasks that have a scripted expert (the ``mmpo demos --task`` choices)."""
    return sorted(name for name, spec in TASKS.items() if spec.expert is not None)


#: simulator families ``make_env`` knows how to build.
FAMILIES = ("robosuite", "gymnasium")

# The built-in experts are given by path: mmpo.robotics.demos imports make_env, which imports
# this module, so importing the classes here would be circular.
# Lift object = cube_pos (3), cube_quat (4), gripper_to_cube_pos (3): 19-D state.
register_task(TaskSpec("lift", "robosuite", "Lift", ROBOMIMIC_LOW_DIM_KEYS, 300, 19, 7,
                       expert="mmpo.robotics.demos.experts:LiftExpert"))
# Can object = Can_pos, Can_quat, Can_to_robot0_eef_pos, Can_to_robot0_eef_quat: 23-D.
register_task(TaskSpec("can", "robosuite", "PickPlaceCan", ROBOMIMIC_LOW_DIM_KEYS, 300, 23, 7,
                       expert="mmpo.robotics.demos.experts:CanExpert"))
# robomimic Square = robosuite NutAssemblySquare (one square nut, placed on the square peg). Object = SquareNut_pos,
# SquareNut_quat, SquareNut_to_robot0_eef_pos, SquareNut_to_robot0_eef_quat: 23-D. robomimic / DPPO: 400-step episodes.
register_task(TaskSpec("square", "robosuite", "NutAssemblySquare", ROBOMIMIC_LOW_DIM_KEYS, 400, 23, 7,
                       expert="mmpo.robotics.demos.experts:SquareExpert"))
# Pixel Lift (DPPO's cfg/robomimic/*/lift/*_img.yaml: the wrist camera robot0_eye_in_hand + the 9-D proprio
# robot0_eef_pos, robot0_eef_quat, robot0_gripper_qpos; DPPO renders 96 x 96, here 32 x 32 so CPU runs stay
# practical): obs = [proprio (9); image 32 x 32 x 3 flattened (H, W, C)] = 3081-D. The Lift expert reads the cube
# from the simulator's object state (not in the observation).
LIFT_IMAGE_SIZE = 32
register_task(TaskSpec("lift_img", "robosuite", "Lift",
                       ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "robot0_eye_in_hand_image"),
                       300, 9 + 3 * LIFT_IMAGE_SIZE ** 2, 7, expert="mmpo.robotics.demos.experts:LiftExpert",
                       camera="robot0_eye_in_hand", image_size=LIFT_IMAGE_SIZE))
# gymnasium's own flat 11-D observation; DPPO's Gym runs use max 1000 steps. No scripted expert.
register_task(TaskSpec("hopper", "gymnasium", "Hopper-v5", ("observation",), 1000, 11, 3))


def osc_pose_controller_config() -> dict[str, Any]:
    """robosuite 1.5 composite controller config with the Panda arm on OSC_POSE delta control.

    Loaded from robosuite's own BASIC composite config (arm part is OSC_POSE, kp 150,
    output_max 0.05 m / 0.5 rad per step, input in [-1, 1], delta input) — the same
    numbers as robomimic's v1.4.1 env_meta — and checked rather than trusted.
    """
    from robosuite.controllers import load_composite_controller_config

    config = load_composite_controller_config(controller="BASIC")
    # BASIC also lists left arm / torso / head / base / legs parts; a single Panda uses
    # only the right arm, so keep just that (cleaner robomimic env_args).
    config["body_parts"] = {"right": config["body_parts"]["right"]}
    arm = config["body_parts"]["right"]
    arm["type"] = "OSC_POSE"
    arm["input_type"] = "delta"
    if arm.get("kp") != 150 or list(arm.get("output_max", []))[:3] != [0.05, 0.05, 0.05]:
        raise RuntimeError(f"robosuite's BASIC OSC_POSE config changed: {arm}")
    return config


def robosuite_env_kwargs(
    spec: TaskSpec, *, max_episode_steps: int, render: bool, camera: str | None, image_size: int
) -> dict[str, Any]:
    """The kwargs passed to ``robosuite.make`` (also recorded as robomimic ``env_kwargs``). A camera task renders
    its own camera at its own size (``spec.camera``, ``spec.image_size``) besides any ``camera`` asked for."""
    if spec.camera is not None:
        if camera is not None and camera != spec.camera:
            raise ValueError(f"task {spec.name!r} observes camera {spec.camera!r}; camera={camera!r} cannot be added")
        camera, image_size = spec.camera, spec.image_size
    kwargs: dict[str, Any] = {
        "robots": ["Panda"],
        "controller_configs": osc_pose_controller_config(),
        "has_renderer": False,
        "has_offscreen_renderer": bool(render or camera is not None),
        "use_camera_obs": camera is not None,
        "use_object_obs": True,
        "reward_shaping": False,
        "control_freq": 20,
        "horizon": int(max_episode_steps),
        # robomimic: episodes never end inside robosuite; our TimeLimit truncates.
        "ignore_done": True,
        "camera_depths": False,
        "camera_heights": int(image_size),
        "camera_widths": int(image_size),
    }
    if camera is not None:
        kwargs["camera_names"] = camera
    kwargs.update(spec.extra_env_kwargs)
    return kwargs


# TGPO's STL tasks (mmpo/robotics/envs/stl_envs.py): K = 2-4 timed reach subgoals plus an obstacle; episodes of
# H = 20 K (point mass) / 30 K (arm) steps; observation = state, t / H, stage one-hot (K + 1), tau / H (K).
STL_SUBGOALS = (2, 3, 4)


def _register_stl_tasks() -> None:
    import gymnasium as gym

    for k in STL_SUBGOALS:
        for name, cls, state_dim, steps_per_goal in (("pointmass", "STLPointMassEnv", 2, 20),
                                                     ("reacher", "STLReacherEnv", 8, 30)):
            # "_robustness": the flat baseline's reward (the episode's STL robustness at its last step only)
            for suffix, reward in (("", "stage"), ("_robustness", "robustness")):
                env_id = f"MmpoSTL{cls[3:-3]}{k}{'Robustness' if suffix else ''}-v0"
                if env_id not in gym.registry:
                    gym.register(env_id, entry_point=f"mmpo.robotics.envs.stl_envs:{cls}",
                                 kwargs={"num_subgoals": k, "reward": reward})
                register_task(TaskSpec(f"stl_{name}{k}{suffix}", "gymnasium", env_id, ("observation",),
                                       steps_per_goal * k, state_dim + 2 * k + 2, 2), replace=True)
    # the arm with its obstacle inside the goals' circle (off the direct arc between the first two goals, across
    # their chord) and the robustness-valued reward terms scaled by 5 (the arm's distances are ~5x the point mass's
    # smaller): stl_reacher{K}'s obstacle lies on the arm's direct path and its penalty is ~0.04 a step (RESULTS.md)
    for k in STL_SUBGOALS:
        for suffix, reward in (("", "stage"), ("_robustness", "robustness")):
            env_id = f"MmpoSTLReacher{k}Inner{'Robustness' if suffix else ''}-v0"
            if env_id not in gym.registry:
                gym.register(env_id, entry_point="mmpo.robotics.envs.stl_envs:STLReacherEnv",
                             kwargs={"num_subgoals": k, "reward": reward, "obstacle": "inner", "distance_scale": 5.0})
            register_task(TaskSpec(f"stl_reacher{k}_inner{suffix}", "gymnasium", env_id, ("observation",), 30 * k,
                                   8 + 2 * k + 2, 2), replace=True)
    # the point mass with tight windows (F[0,10](g1 and F[0,10](g2)), H = 20): most allocations are too early,
    # the setting where the allocation search matters (the MH vs uniform ablation, bench/RESULTS.md)
    if "MmpoSTLPointMass2Tight-v0" not in gym.registry:
        gym.register("MmpoSTLPointMass2Tight-v0", entry_point="mmpo.robotics.envs.stl_envs:STLPointMassEnv",
                     kwargs={"num_subgoals": 2, "windows": "tight"})
    register_task(TaskSpec("stl_pointmass2_tight", "gymnasium", "MmpoSTLPointMass2Tight-v0", ("observation",), 20, 8,
                           2), replace=True)


_register_stl_tasks()
