"""Robot policies (BC, DPPO, Gaussian PPO) on robosuite / gymnasium; needs the ``robotics`` extra."""

from mmpo._extras import require_extra

# Without the extra: one line naming it (MissingExtraError), not a ModuleNotFoundError from an env module.
require_extra("mmpo.robotics", "robotics")
