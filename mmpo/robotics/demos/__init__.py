"""Scripted experts for robosuite Lift / Can / Square and robomimic-format demo files."""

from mmpo.robotics.demos.experts import (
    CanExpert,
    ExpertConfig,
    LiftExpert,
    ScriptedExpert,
    SquareExpert,
    make_expert,
)
from mmpo.robotics.demos.generate import generate_demos, robomimic_env_args
from mmpo.robotics.demos.hdf5_writer import RobomimicHDF5Writer

__all__ = [
    "CanExpert",
    "ExpertConfig",
    "LiftExpert",
    "RobomimicHDF5Writer",
    "ScriptedExpert",
    "SquareExpert",
    "generate_demos",
    "make_expert",
    "robomimic_env_args",
]
