"""Robot environments for diffusion-policy RL (DPPO, arXiv 2409.00588).

robosuite Lift / Can set up as robomimic does, gymnasium Hopper, action-chunk execution,
min-max normalisation, simulator-fault handling and subprocess vector envs.
See docs/robotics_envs.md.
"""

from mmpo.robotics.envs.chunking import ActionChunkWrapper
from mmpo.robotics.envs.faults import SimulatorFaultError, SimulatorFaultWrapper, fault_count, find_fault_wrapper
from mmpo.robotics.envs.make import make_env
from mmpo.robotics.envs.normalizer import Normalizer, stats_path_for
from mmpo.robotics.envs.tasks import OBS_KEYS, TASKS, TaskSpec, expert_tasks, get_task, register_task
from mmpo.robotics.envs.vector import make_vector_env, measure_steps_per_s, merged_info

__all__ = [
    "OBS_KEYS",
    "TASKS",
    "ActionChunkWrapper",
    "Normalizer",
    "SimulatorFaultError",
    "SimulatorFaultWrapper",
    "TaskSpec",
    "expert_tasks",
    "fault_count",
    "find_fault_wrapper",
    "get_task",
    "make_env",
    "make_vector_env",
    "measure_steps_per_s",
    "merged_info",
    "register_task",
    "stats_path_for",
]
