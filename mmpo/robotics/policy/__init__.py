"""Diffusion policies over action chunks (DDPM/DDIM via diffusers) and DPPO's per-step math."""

from mmpo.robotics.policy.diffusion import BACKBONES, DiffusionPolicy, PolicySample
from mmpo.robotics.policy.networks import CriticMLP, MLPDenoiser, ResidualMLP, UNetDenoiser
from mmpo.robotics.policy.schedule import DenoisingSchedule, make_ddim_scheduler, make_ddpm_scheduler

__all__ = [
    "BACKBONES",
    "CriticMLP",
    "DenoisingSchedule",
    "DiffusionPolicy",
    "MLPDenoiser",
    "PolicySample",
    "ResidualMLP",
    "UNetDenoiser",
    "make_ddim_scheduler",
    "make_ddpm_scheduler",
]
