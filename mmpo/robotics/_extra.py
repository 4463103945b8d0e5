"""mmpo.robotics needs the ``robotics`` extra (``pip install "mmpo[robotics]"``).

``mmpo/robotics/__init__.py`` calls :func:`require_robotics` first, so any ``import mmpo.robotics...``
without the extra raises :class:`mmpo._extras.MissingExtraError` with one line that names the extra
and what is missing, instead of a ``ModuleNotFoundError`` from deep inside an env wrapper.
"""

from __future__ import annotations

from mmpo._extras import require_extra

EXTRA = "robotics"

# The modules mmpo.robotics imports that only the extra installs (import name -> distribution name).
# robomimic and imageio are in the extra too, but mmpo.robotics does not need them to import:
# robomimic is used by the tests only, imageio only by `mmpo rollout --video` (imported there, lazily).
ROBOTICS_MODULES: dict[str, str] = {
    "robosuite": "robosuite",
    "mujoco": "mujoco",
    "gymnasium": "gymnasium",
    "h5py": "h5py",
}


def require_robotics() -> None:
    """Raise :class:`~mmpo._extras.MissingExtraError` unless the ``robotics`` extra's packages are found."""
    require_extra("mmpo.robotics", EXTRA, ROBOTICS_MODULES)
