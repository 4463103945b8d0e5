"""Scripted experts for robosuite Lift / Can and robomimic-format demo files."""

from mmpo.robotics.demos.experts import CanExpert, ExpertConfig, LiftExpert, ScriptedExpert, make_expert
from mmpo.robotics.demos.generate import generate_demos, robomimic_env_args
from mmpo.robotics.demos.hdf5_writer import RobomimicHDF5Writer

__all__ = [
    "CanExpert",
    "ExpertConfig",
    "LiftExpert",
    "RobomimicHDF5Writer",
    "ScriptedExpert",
    "generate_demos",
    "make_expert",
    "robomimic_env_args",
]
