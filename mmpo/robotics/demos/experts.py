"""Scripted experts for robosuite Lift, Can and Square (OSC_POSE delta actions).

Both are small phase machines on the object pose read from the observation: move
above the object, descend, close the gripper, lift (Lift) or carry to the target bin
and release (Can). Actions are 7-D in [-1, 1]: position delta (x, y, z) in units of the
controller's 0.05 m per step, rotation delta (kept 0 for Lift and Can: the Panda starts pointing down and
both objects can be grasped from above at any yaw; Square turns the gripper about z onto the nut's handle),
gripper (-1 open, +1 closed).
Gaussian noise of std ``noise`` on every dimension (then clipped) is the knob that makes
demonstrations imperfect, for a deliberately mediocre BC policy to fine-tune with DPPO.
No library ships experts for these tasks (robomimic's data were human teleoperation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

#: OSC_POSE output_max for position: an input of 1.0 asks for a 0.05 m step.
POSITION_SCALE = 0.05
GRIPPER_OPEN = -1.0
GRIPPER_CLOSED = 1.0


def move_towards(eef_pos: np.ndarray, target: np.ndarray, gain: float = 1.0) -> np.ndarray:
    """Position part of the action: (3,) clipped to [-1, 1], proportional to the error."""
    return np.clip(gain * (target - eef_pos) / POSITION_SCALE, -1.0, 1.0)


@dataclass
class ExpertConfig:
    """Geometry and timing of the scripted grasp (metres / env steps)."""

    hover_height: float = 0.08  # above the object before descending
    grasp_depth: float = -0.005  # eef target relative to the object centre when grasping
    reach_tolerance: float = 0.012
    close_steps: int = 8  # steps holding still while the fingers close
    lift_height: float = 0.18  # Lift: how far to raise the cube
    carry_height: float = 0.12  # Can: clearance above the bin walls while carrying
    release_steps: int = 8
    max_phase_steps: int = 60  # give up on a phase (move on) after this many steps


class ScriptedExpert(ABC):
    """Base phase machine; subclasses define the object key and the phases after grasping.

    Call :meth:`start_episode` after each ``env.reset()`` and :meth:`act` on each robosuite
    observation dict (the adapter's ``last_raw_obs``). This pair is what ``generate_demos``
    asks of any task's expert (``TaskSpec.expert``).
    """

    object_pos_key = ""

    def __init__(self, noise: float = 0.0, rng: np.random.Generator | None = None, config: ExpertConfig | None = None):
        if noise < 0:
            raise ValueError(f"noise std must be >= 0, got {noise}")
        self.noise = float(noise)
        self.rng = rng if rng is not None else np.random.default_rng()
        self.config = config or ExpertConfig()
        self.reset()

    def reset(self) -> None:
        self.phase = "approach"
        self.phase_steps = 0
        self.anchor: np.ndarray | None = None

    def start_episode(self, env) -> None:
        """Prepare for the episode ``env`` (the unwrapped, freshly reset env) has just begun."""
        self.reset()

    def _next(self, phase: str) -> None:
        self.phase = phase
        self.phase_steps = 0

    @abstractmethod
    def clean_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """(7,) noiseless action for this observation (advances the phase machine)."""

    def act(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """(7,) float64 action in [-1, 1] for one robosuite obs dict, with noise added."""
        action = self.clean_action(obs)
        self.phase_steps += 1
        if self.noise > 0:
            action = action + self.rng.normal(0.0, self.noise, size=action.shape)
        return np.clip(action, -1.0, 1.0)

    def _release_then_retreat(self, action: np.ndarray, eef: np.ndarray, carry_z: float) -> np.ndarray:
        """The last two phases: open the gripper for ``release_steps``, then move straight up to ``carry_z``."""
        if self.phase == "release":
            action[6] = GRIPPER_OPEN
            if self.phase_steps >= self.config.release_steps:
                self._next("retreat")
            return action
        action[:3] = move_towards(eef, np.array([eef[0], eef[1], carry_z]))
        action[6] = GRIPPER_OPEN
        return action

    def _grasp_phases(self, eef: np.ndarray, obj: np.ndarray) -> np.ndarray | None:
        """approach -> descend -> close; returns an action, or None once grasped."""
        c = self.config
        action = np.zeros(7)
        if self.phase == "approach":
            target = obj + np.array([0.0, 0.0, c.hover_height])
            action[:3] = move_towards(eef, target)
            action[6] = GRIPPER_OPEN
            close_xy = np.linalg.norm((target - eef)[:2]) < c.reach_tolerance
            if (close_xy and abs(target[2] - eef[2]) < 2 * c.reach_tolerance) or self.phase_steps > c.max_phase_steps:
                self._next("descend")
            return action
        if self.phase == "descend":
            target = obj + np.array([0.0, 0.0, c.grasp_depth])
            action[:3] = move_towards(eef, target)
            action[6] = GRIPPER_OPEN
            if np.linalg.norm(target - eef) < c.reach_tolerance or self.phase_steps > c.max_phase_steps:
                self._next("close")
            return action
        if self.phase == "close":
            target = obj + np.array([0.0, 0.0, c.grasp_depth])
            action[:3] = move_towards(eef, target)
            action[6] = GRIPPER_CLOSED
            if self.phase_steps >= c.close_steps:
                self.anchor = eef.copy()
                self._next("grasped")
            return action
        return None


class LiftExpert(ScriptedExpert):
    """Lift: grasp the cube and raise it ``lift_height`` above the grasp point."""

    object_pos_key = "cube_pos"

    def clean_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        eef = np.asarray(obs["robot0_eef_pos"], dtype=np.float64)
        cube = np.asarray(obs[self.object_pos_key], dtype=np.float64)
        action = self._grasp_phases(eef, cube)
        if action is not None:
            return action
        action = np.zeros(7)
        target = self.anchor + np.array([0.0, 0.0, self.config.lift_height])
        action[:3] = move_towards(eef, target)
        action[6] = GRIPPER_CLOSED
        return action


class CanExpert(ScriptedExpert):
    """Can: grasp the can, lift, carry above its target bin, lower, release, retreat.

    ``target`` is the can's bin-placement centre (robosuite ``target_bin_placements``),
    a fixed property of the scene passed in at episode start.
    """

    object_pos_key = "Can_pos"

    def __init__(self, target: np.ndarray | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.target = None if target is None else np.asarray(target, dtype=np.float64)

    def set_target(self, target: np.ndarray) -> None:
        self.target = np.asarray(target, dtype=np.float64)

    def start_episode(self, env) -> None:
        """Reset, then read the can's bin target from the robosuite env (``env.sim_env``)."""
        super().start_episode(env)
        sim_env = env.sim_env
        self.set_target(sim_env.target_bin_placements[sim_env.object_to_id["can"]])

    def clean_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        if self.target is None:
            raise ValueError("CanExpert needs the bin target: call set_target() after reset")
        c = self.config
        eef = np.asarray(obs["robot0_eef_pos"], dtype=np.float64)
        can = np.asarray(obs[self.object_pos_key], dtype=np.float64)
        action = self._grasp_phases(eef, can)
        if action is not None:
            return action
        action = np.zeros(7)
        action[6] = GRIPPER_CLOSED
        carry_z = max(self.anchor[2], self.target[2]) + c.carry_height
        if self.phase == "grasped":  # lift straight up first so the can clears bin 1's walls
            target = np.array([eef[0], eef[1], carry_z])
            action[:3] = move_towards(eef, target)
            if abs(carry_z - eef[2]) < 2 * c.reach_tolerance or self.phase_steps > c.max_phase_steps:
                self._next("carry")
            return action
        if self.phase == "carry":
            target = np.array([self.target[0], self.target[1], carry_z])
            action[:3] = move_towards(eef, target)
            if np.linalg.norm((target - eef)[:2]) < 2 * c.reach_tolerance or self.phase_steps > 2 * c.max_phase_steps:
                self._next("lower")
            return action
        if self.phase == "lower":
            target = np.array([self.target[0], self.target[1], self.target[2] + 0.08])
            action[:3] = move_towards(eef, target)
            if abs(target[2] - eef[2]) < 2 * c.reach_tolerance or self.phase_steps > c.max_phase_steps:
                self._next("release")
            return action
        # release, then retreat: move up so the gripper is > 4.2 cm from the can (robosuite's success check)
        return self._release_then_retreat(action, eef, carry_z)


def make_expert(task: str, *, noise: float = 0.0, rng: np.random.Generator | None = None) -> ScriptedExpert:
    """The scripted expert of a registered task (``TaskSpec.expert``; "lift", "can" and "square" built in)."""
    from mmpo.robotics.envs.tasks import get_task

    return get_task(task).make_expert(noise=noise, rng=rng)


def quat_yaw(quat_xyzw: np.ndarray) -> float:
    """Yaw (rotation about world z) of an (x, y, z, w) quaternion's x axis: atan2 of R[1, 0], R[0, 0]."""
    x, y, z, w = (float(v) for v in quat_xyzw)
    return float(np.arctan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z)))


def finger_axis_yaw(quat_xyzw: np.ndarray) -> float:
    """Yaw of the gripper's closing axis (the eef frame's y axis, R[:, 1]) projected on the table plane."""
    x, y, z, w = (float(v) for v in quat_xyzw)
    return float(np.arctan2(1.0 - 2.0 * (x * x + z * z), 2.0 * (x * y - z * w)))


def wrap_half_pi(angle: float) -> float:
    """``angle`` modulo pi, in [-pi/2, pi/2): a parallel gripper grasps the same at yaw and yaw + pi."""
    return float((angle + np.pi / 2) % np.pi - np.pi / 2)


#: OSC_POSE output_max for rotation: an input of 1.0 asks for a 0.5 rad step.
ROTATION_SCALE = 0.5


class SquareExpert(ScriptedExpert):
    """Square (robosuite NutAssemblySquare): grasp the nut's handle, carry the nut over the square peg, drop it on.

    The nut lies at a random yaw; its handle is the box at (+0.054, 0, 0) in the nut frame (robosuite
    ``square-nut.xml``, ``handle_site``), 3.2 cm wide across the nut's y axis. While hovering above the handle
    the gripper turns (rotation action about world z) until its closing axis is the nut's y axis (modulo pi),
    then descends and closes on the handle (fingers closed on nothing while lifting: open and start again, up to
    3 times); it lifts above the peg (top at z = 0.95: ``pegs_arena.xml`` peg1,
    0.85 + 0.1), moves so that the nut's centre (read from the observation, so the grasp offset is measured,
    not assumed) is above the peg, lowers until the nut is below robosuite's on-peg height (table + 5 cm),
    releases (the nut drops the last centimetres down the peg) and retreats up (success also needs the gripper > ~7 cm from the nut). The peg (1.6 cm half
    width) fits the hole (2.3 cm half width) at every yaw, so the nut is not re-aligned with it.
    """

    object_pos_key = "SquareNut_pos"
    handle_offset = 0.054
    #: finger opening (robot0_gripper_qpos[0] - [1], metres) below which the fingers hold nothing: ~0.03 on the
    #: 3.2 cm handle, ~0 when closed on air
    closed_opening = 0.008
    max_regrasps = 3

    def __init__(self, peg: np.ndarray | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.peg = None if peg is None else np.asarray(peg, dtype=np.float64)

    def reset(self) -> None:
        super().reset()
        self.regrasps = 0

    def start_episode(self, env) -> None:
        """Reset, then read the square peg's position (``peg1``) from the robosuite env (``env.sim_env``)."""
        super().start_episode(env)
        sim_env = env.sim_env
        self.peg = np.array(sim_env.sim.data.body_xpos[sim_env.peg1_body_id], dtype=np.float64)

    def handle_pos(self, nut_pos: np.ndarray, nut_quat: np.ndarray) -> np.ndarray:
        yaw = quat_yaw(nut_quat)
        return nut_pos + self.handle_offset * np.array([np.cos(yaw), np.sin(yaw), 0.0])

    def clean_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        if self.peg is None:
            raise ValueError("SquareExpert needs the peg position: pass peg= or call start_episode(env) after reset")
        c = self.config
        eef = np.asarray(obs["robot0_eef_pos"], dtype=np.float64)
        nut = np.asarray(obs[self.object_pos_key], dtype=np.float64)
        nut_quat = np.asarray(obs["SquareNut_quat"], dtype=np.float64)
        handle = self.handle_pos(nut, nut_quat)
        # closing axis onto the nut's y axis (yaw + pi/2), modulo pi
        yaw_error = wrap_half_pi(quat_yaw(nut_quat) + np.pi / 2 - finger_axis_yaw(obs["robot0_eef_quat"]))
        action = np.zeros(7)
        if self.phase in ("approach", "descend", "close"):
            action[5] = np.clip(2.0 * yaw_error / ROTATION_SCALE, -1.0, 1.0)
        if self.phase == "approach":
            target = handle + np.array([0.0, 0.0, c.hover_height])
            action[:3] = move_towards(eef, target, gain=2.0)
            action[6] = GRIPPER_OPEN
            # the handle is 3.2 cm wide and the hole beside it 4.6 cm: a centimetre off and a finger lands on the ring
            xy_error = np.linalg.norm((target - eef)[:2])
            close = xy_error < 0.004 and abs(target[2] - eef[2]) < 2 * c.reach_tolerance and abs(yaw_error) < 0.05
            if close or self.phase_steps > 2 * c.max_phase_steps:
                self._next("descend")
            return action
        if self.phase == "descend":
            target = handle + np.array([0.0, 0.0, c.grasp_depth])
            action[:3] = move_towards(eef, target, gain=2.0)
            action[6] = GRIPPER_OPEN
            if np.linalg.norm(target - eef) < c.reach_tolerance or self.phase_steps > c.max_phase_steps:
                self._next("close")
            return action
        if self.phase == "close":
            action[:3] = move_towards(eef, handle + np.array([0.0, 0.0, c.grasp_depth]))
            action[6] = GRIPPER_CLOSED
            if self.phase_steps >= c.close_steps:
                self._next("lift")
            return action
        action[6] = GRIPPER_CLOSED
        carry_z = self.peg[2] + 0.1 + c.carry_height  # peg top + clearance for the grasped nut
        offset = eef - nut  # where the eef sits relative to the nut's centre
        if self.phase == "lift":
            opening = float(obs["robot0_gripper_qpos"][0] - obs["robot0_gripper_qpos"][1])
            if self.phase_steps >= 6 and opening < self.closed_opening and self.regrasps < self.max_regrasps:
                self.regrasps += 1  # the fingers closed on nothing (the handle is 3.2 cm): open, go back, retry
                self._next("approach")
                action[6] = GRIPPER_OPEN
                return action
            action[:3] = move_towards(eef, np.array([eef[0], eef[1], carry_z]))
            if abs(carry_z - eef[2]) < 2 * c.reach_tolerance or self.phase_steps > c.max_phase_steps:
                self._next("carry")
            return action
        if self.phase == "carry":
            target = np.array([self.peg[0] + offset[0], self.peg[1] + offset[1], carry_z])
            action[:3] = move_towards(eef, target)
            if np.linalg.norm((nut - self.peg)[:2]) < 0.006 or self.phase_steps > 2 * c.max_phase_steps:
                self._next("lower")
            return action
        if self.phase == "lower":
            target = np.array([self.peg[0] + offset[0], self.peg[1] + offset[1], self.peg[2] + offset[2]])
            action[:3] = move_towards(eef, target)
            # the nut's bottom (centre - 1 cm) 4.5 cm below the peg's top: it is around the peg and drops the rest
            if nut[2] < self.peg[2] + 0.045 or self.phase_steps > c.max_phase_steps:
                self._next("release")
            return action
        return self._release_then_retreat(action, eef, carry_z)
