"""Robot policies (BC, DPPO, Gaussian PPO) on robosuite / gymnasium; needs the ``robotics`` extra."""

from mmpo.robotics._extra import require_robotics

require_robotics()  # without the extra: one line naming it (MissingExtraError), not a traceback from an env module
