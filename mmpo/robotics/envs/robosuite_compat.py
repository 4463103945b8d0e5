"""Compatibility fix-ups for robosuite 1.5.2 on recent ``mujoco`` bindings (3.17 here).

1. robosuite 1.5.2's ``MjModel.get_joint_qpos_addr`` / ``get_joint_qvel_addr`` assert
``joint_type in (mjtJoint.mjJNT_HINGE, mjtJoint.mjJNT_SLIDE)``. With the installed
mujoco (3.17) ``jnt_type`` entries are ``numpy.int32`` and ``enum == np.int32`` is False
(the enum's ``__eq__`` no longer defers to numpy), so every hinge joint fails that
assertion and ``robosuite.make("Lift", ...)`` crashes. No robosuite release fixes it yet,
so we re-implement the two small lookups with the joint type cast to ``int``
(same logic as upstream, lines 508-556 of robosuite/utils/binding_utils.py).

2. ``Controller.update`` calls ``mujoco.mj_fullM(model, dst, data.qM)``; the installed
bindings dropped ``MjData.qM`` and take ``mj_fullM(model, data, dst)`` instead, so every
controller update raises ``AttributeError``. We replace ``update`` with the same body
(robosuite/controllers/parts/controller.py lines 199-233) calling whichever signature the
installed mujoco has.
"""

from __future__ import annotations

import mujoco
import numpy as np

_FREE = int(mujoco.mjtJoint.mjJNT_FREE)
_BALL = int(mujoco.mjtJoint.mjJNT_BALL)
_ONE_DOF = (int(mujoco.mjtJoint.mjJNT_HINGE), int(mujoco.mjtJoint.mjJNT_SLIDE))
_QPOS_WIDTH = {_FREE: 7, _BALL: 4}
_QVEL_WIDTH = {_FREE: 6, _BALL: 3}

_applied = False


def _address(model, name: str, address_table, widths: dict[int, int]):
    joint_id = model.joint_name2id(name)
    joint_type = int(model.jnt_type[joint_id])
    start = int(address_table[joint_id])
    if joint_type in widths:
        return (start, start + widths[joint_type])
    if joint_type not in _ONE_DOF:
        raise ValueError(f"joint {name!r} has unsupported MuJoCo joint type {joint_type}")
    return start


def _get_joint_qpos_addr(self, name: str):
    return _address(self, name, self.jnt_qposadr, _QPOS_WIDTH)


def _get_joint_qvel_addr(self, name: str):
    return _address(self, name, self.jnt_dofadr, _QVEL_WIDTH)


def _dense_mass_matrix(sim) -> np.ndarray:
    """Full (nv, nv) inertia matrix for either mj_fullM signature."""
    nv = sim.model.nv
    mass_matrix = np.zeros((nv, nv), dtype=np.float64, order="C")
    raw_data = sim.data._data
    if hasattr(raw_data, "qM"):  # mujoco < 3.4-style signature (src = qM)
        mujoco.mj_fullM(sim.model._model, mass_matrix, raw_data.qM)
    else:
        mujoco.mj_fullM(sim.model._model, raw_data, mass_matrix)
    return mass_matrix


def _controller_update(self, force: bool = False) -> None:
    # Same as robosuite 1.5.2 Controller.update except for the mass-matrix call.
    if self.new_update or force:
        if not (self.lite_physics and not force):
            self.sim.forward()
        if self.ref_name is not None:
            self.update_reference_data()
        self.joint_pos = np.array(self.sim.data.qpos[self.qpos_index])
        self.joint_vel = np.array(self.sim.data.qvel[self.qvel_index])
        mass_matrix = _dense_mass_matrix(self.sim)
        self.mass_matrix = mass_matrix[self.qvel_index, :][:, self.qvel_index]
        self.new_update = False


def apply_robosuite_compat() -> None:
    """Patch robosuite's joint-address helpers and controller update once (idempotent)."""
    global _applied
    if _applied:
        return
    from robosuite.utils import binding_utils

    binding_utils.MjModel.get_joint_qpos_addr = _get_joint_qpos_addr
    binding_utils.MjModel.get_joint_qvel_addr = _get_joint_qvel_addr
    from robosuite.controllers.parts.controller import Controller

    Controller.update = _controller_update
    _applied = True
