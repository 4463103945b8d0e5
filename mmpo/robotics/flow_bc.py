"""Behaviour cloning of a flow-matching action-chunk policy (conditional flow matching + EMA 0.995).

``mmpo fit -c configs/robotics/flow_bc_lift.yaml`` trains :class:`FlowBCModule` on the same demos, chunk dataset,
networks, optimizer, EMA and checkpoint layout as the diffusion BC (:class:`~mmpo.robotics.bc.BCModule`); only
the policy differs: a :class:`~mmpo.robotics.policy.flow.FlowPolicy` trained by rectified-flow matching
(ReinFlow/ReinFlow ``model/flow/reflow.py``: t ~ U[0, 1), x_t = t a + (1 - t) x_0, MSE to a - x_0) and sampled
with K Euler steps. Its checkpoints load with :func:`mmpo.robotics.policy.io.load_policy` (kind ``flow_bc``) and
start ReinFlow (:mod:`mmpo.robotics.reinflow`) and FPO (:mod:`mmpo.robotics.fpo`).
"""

from __future__ import annotations

from mmpo.robotics.bc import BCModule
from mmpo.robotics.policy.flow import FlowPolicy
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS


class FlowBCModule(BCModule):
    """Flow-matching BC of a :class:`~mmpo.robotics.policy.flow.FlowPolicy`.

    Args: as :class:`~mmpo.robotics.bc.BCModule`; ``denoising_steps`` is the number K of Euler steps of the
    sampler (ReinFlow's name; default 4, its robomimic state config ``cfg/robomimic/finetune/transport/
    ft_ppo_reflow_mlp.yaml``). Training does not depend on K (t is continuous); K is stored for sampling.
    """

    policy_class = FlowPolicy
    kind = "flow_bc"

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int = 4,
        *,
        backbone: str = "mlp",
        denoising_steps: int = 4,
        hidden_dims: list[int] | None = None,
        time_dim: int = 16,
        activation: str = "mish",
        unet_channels: list[int] | None = None,
        lr: float = 1e-4,
        lr_min: float = 1e-5,
        warmup_steps: int = 100,
        weight_decay: float = 1e-6,
        ema_decay: float = 0.995,
        task: str = "lift",
        act_steps: int = 4,
        max_episode_steps: int | None = None,
        normalizer_path: str | None = None,
        export_safetensors: bool = True,
        seed: int = 0,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        super().__init__(
            obs_dim, action_dim, horizon, backbone=backbone, denoising_steps=denoising_steps, hidden_dims=hidden_dims,
            time_dim=time_dim, activation=activation, unet_channels=unet_channels, lr=lr, lr_min=lr_min,
            warmup_steps=warmup_steps, weight_decay=weight_decay, ema_decay=ema_decay, task=task, act_steps=act_steps,
            max_episode_steps=max_episode_steps, normalizer_path=normalizer_path,
            export_safetensors=export_safetensors, seed=seed, max_consecutive_skips=max_consecutive_skips,
        )
