"""Typed, grouped settings of the robot RL modules (``DPPOModule``, ``SFPODPPOModule``, ``GaussianPPOModule``,
``ReinFlowModule``, ``FPOModule``, ``DSRLModule``).

The groups that the VLM modules share come from mmpo.training.config (``optim``: :class:`OptimConfig`,
``critic``: :class:`CriticConfig`); the ones only a robot run has are here. LightningCLI (jsonargparse)
parses them from nested YAML, with the module's defaults for the fields a config leaves out::

    model:
      class_path: mmpo.robotics.dppo.DPPOModule
      init_args:
        bc_checkpoint: runs/bc_lift/checkpoints/last.ckpt
        env: {num_envs: 8, n_steps: 75}
        chain: {ft_steps: 10, clip_base: 0.001, clip_final: 0.01}
        optim: {lr: 1.0e-4, mu: 10, minibatch_size: 1500}
        critic: {lr: 1.0e-3}

On the command line: ``--model.init_args.optim.lr=1e-5``. Each dataclass checks its own fields in
``__post_init__``; checks across groups (the loss against the chain, ``env_groups`` against the
checkpoint) stay with the module. Checkpoints keep the groups as plain dicts; a checkpoint saved
before the groups (flat names: ``actor_lr``, ``update_epochs``, ...) is read back through
:func:`grouped_hparams` (the old -> new table is docs/dppo.md's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mmpo.training.config import _require

EVAL_SAMPLERS: tuple[str | None, ...] = (None, "ddpm", "ddim")
LOG_PROB_REDUCTIONS: tuple[str, ...] = ("sum", "mean")


@dataclass(frozen=True)
class EnvConfig:
    """The vectorised robot env and how each iteration's rollout steps it.

    Attributes:
        task: registered task (lift, can, ...); None = the BC checkpoint's.
        act_steps: executed actions of each chunk (1 <= act_steps <= horizon); None = the checkpoint's, else the horizon.
        max_episode_steps: episode time limit in env steps; None = the checkpoint's, else the task's.
        normalizer_path: min-max stats json of observations and actions; None = the checkpoint's.
        num_envs: envs stepped in parallel (env i seeded seed + i; DPPO lift: 50).
        n_steps: chunk steps per env per iteration (DPPO lift: 300).
        reset_at_iteration: reset every env at each iteration's start (robomimic True, Gym False).
        skip_final_autoreset: with reset_at_iteration, an env whose episode ends on the rollout's last chunk step is not auto-reset (the next iteration resets it anyway); the run is unchanged.
        asynchronous: one subprocess per env (True) or in-process envs (False).
        env_groups: 1 = one batched policy call on all envs per chunk step; g > 1 = pipelined collection over g groups of consecutive envs (docs/dppo.md).
        prefetch_reset: with reset_at_iteration and subprocess envs, send the next iteration's reset to the workers during the PPO update; the run is unchanged.
        max_worker_restarts: env worker processes that may die and be restarted during the fit before the run stops.
    """

    task: str | None = None
    act_steps: int | None = None
    max_episode_steps: int | None = None
    normalizer_path: str | None = None
    num_envs: int = 50
    n_steps: int = 300
    reset_at_iteration: bool = True
    skip_final_autoreset: bool = True
    asynchronous: bool = True
    env_groups: int = 1
    prefetch_reset: bool = False
    max_worker_restarts: int = 3

    def __post_init__(self) -> None:
        _require(self.num_envs >= 1, f"num_envs must be >= 1, got {self.num_envs}")
        _require(self.n_steps >= 1, f"n_steps must be >= 1, got {self.n_steps}")
        _require(1 <= self.env_groups <= self.num_envs,
                 f"env_groups must be in [1, num_envs={self.num_envs}], got {self.env_groups}")
        _require(self.act_steps is None or self.act_steps >= 1, f"act_steps must be >= 1 or None, got {self.act_steps}")
        _require(self.max_episode_steps is None or self.max_episode_steps >= 1,
                 f"max_episode_steps must be >= 1 or None, got {self.max_episode_steps}")
        _require(self.max_worker_restarts >= 0, f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")


@dataclass(frozen=True)
class DenoisingChainConfig:
    """The fine-tuned part of the diffusion policy's denoising chain and its PPO clip range (DPPO's own settings).

    Attributes:
        ft_steps: K', the last denoising steps that a trainable copy of the network runs (default 10 of K = 20).
        gamma_denoise: advantage discount over denoising steps: step i of K' gets gamma_denoise^(K'-1-i).
        clip_base: PPO clip range of the noisiest fine-tuned step.
        clip_final: PPO clip range of the final step.
        clip_rate: exponential rate of the clip range from clip_base to clip_final over the K' steps.
        min_sampling_std: std floor of every rollout denoising step.
        noise_clip: each denoising step's standard-normal noise is clipped to [-noise_clip, noise_clip].
        min_logprob_std: std floor of the log-probs of the PPO ratio.
        logprob_min: lower clamp of the elementwise log-probs.
        logprob_max: upper clamp of the elementwise log-probs.
        rollout_ddim_steps: None = the BC policy's own DDPM chain; n = a DDIM (eta = 1) chain of n strided steps with the same network (ft_steps counts its steps).
    """

    ft_steps: int = 10
    gamma_denoise: float = 0.99
    clip_base: float = 0.001
    clip_final: float = 0.01
    clip_rate: float = 3.0
    min_sampling_std: float = 0.1
    noise_clip: float = 3.0
    min_logprob_std: float = 0.1
    logprob_min: float = -5.0
    logprob_max: float = 2.0
    rollout_ddim_steps: int | None = None

    def __post_init__(self) -> None:
        _require(self.ft_steps >= 1, f"ft_steps must be >= 1, got {self.ft_steps}")
        _require(0 <= self.gamma_denoise <= 1, f"gamma_denoise must be in [0, 1], got {self.gamma_denoise}")
        _require(self.clip_base > 0 and self.clip_final > 0,
                 f"clip_base and clip_final must be > 0, got {self.clip_base}, {self.clip_final}")
        _require(self.noise_clip > 0, f"noise_clip must be > 0, got {self.noise_clip}")
        _require(self.logprob_min < self.logprob_max,
                 f"logprob_min must be < logprob_max, got {self.logprob_min}, {self.logprob_max}")
        _require(self.rollout_ddim_steps is None or self.rollout_ddim_steps >= 1,
                 f"rollout_ddim_steps must be >= 1 or None, got {self.rollout_ddim_steps}")


@dataclass(frozen=True)
class ReturnsConfig:
    """Rewards to advantages: reward scaling, then GAE over chunk steps (mmpo.core.gae; verl's ``gamma`` / ``lam``).

    Attributes:
        gamma: env-level discount over chunk steps (robomimic 0.999).
        lam: GAE lambda (robomimic 0.95).
        reward_scale_running: divide rewards by the std of a running discounted return (DPPO's RunningRewardScaler).
        reward_scale_const: constant every env reward is multiplied by first.
        reward_scale_gamma: discount of the running return whose std scales rewards.
    """

    gamma: float = 0.999
    lam: float = 0.95
    reward_scale_running: bool = True
    reward_scale_const: float = 1.0
    reward_scale_gamma: float = 0.99

    def __post_init__(self) -> None:
        _require(0 <= self.gamma <= 1, f"gamma must be in [0, 1], got {self.gamma}")
        _require(0 <= self.lam <= 1, f"lam must be in [0, 1], got {self.lam}")
        _require(0.0 <= self.reward_scale_gamma <= 1.0,
                 f"reward_scale_gamma must be in [0, 1], got {self.reward_scale_gamma}")


@dataclass(frozen=True)
class PPOLossConfig:
    """The actor's policy loss and the update's trust region.

    Attributes:
        name: core policy loss: ppo (DPPO's), or gppo, cispo, aspo (their clip bounds are the per-denoising-step clip range), sapo, gpg (no clip); docs/dppo.md says why the others do not apply.
        settings: further keyword settings of the loss (e.g. sapo's tau_pos / tau_neg; not the clip bounds).
        target_kl: stop an iteration's update passes once a minibatch's approx_kl exceeds it; None = never.
    """

    name: str = "ppo"
    settings: dict[str, Any] | None = None
    target_kl: float | None = 1.0

    def __post_init__(self) -> None:
        _require(self.target_kl is None or self.target_kl > 0, f"target_kl must be > 0 or None, got {self.target_kl}")


@dataclass(frozen=True)
class EvalConfig:
    """The deterministic evaluation during a fit.

    Attributes:
        every: evaluate every this many iterations and at the last (0 = never).
        episodes: episodes per evaluation.
        sampler: None = the policy's own chain (DDPM step means for a DDPM policy); "ddpm" = the same for a DDPM policy; "ddim" = DDIM eta = 0 over the same timesteps with the same networks.
        ddpm_std_floor: the DDPM evaluation chain: None = the mean of every step (bench/RESULTS.md); 1e-3 = the official DPPO evaluation (noise with std max(std, 1e-3) on every step but the last).
    """

    every: int = 10
    episodes: int = 50
    sampler: str | None = None
    ddpm_std_floor: float | None = None

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"every must be >= 0 (0 = never), got {self.every}")
        _require(self.episodes >= 1, f"episodes must be >= 1, got {self.episodes}")
        _require(self.sampler in EVAL_SAMPLERS, f"unknown sampler {self.sampler!r}; valid: {list(EVAL_SAMPLERS)}")
        _require(self.ddpm_std_floor is None or self.ddpm_std_floor >= 0,
                 f"eval_ddpm_std_floor must be >= 0 or None, got {self.ddpm_std_floor}")


@dataclass(frozen=True)
class GaussianPolicyConfig:
    """The Gaussian baseline's one policy step (it has no denoising chain).

    Attributes:
        clip_coef: PPO clip range of the ratio.
        ent_coef: entropy bonus coefficient on the executed chunk's Gaussian entropy (0 = none).
        log_prob_reduction: sum (default) or mean over the executed chunk's act_steps x Da entries, for the PPO ratio, approx_kl and the entropy bonus (mean = the DPPO paper's Gaussian baseline).
        noise_clip: the sampling noise is clipped to [-noise_clip, noise_clip] std.
    """

    clip_coef: float = 0.01
    ent_coef: float = 0.0
    log_prob_reduction: str = "sum"
    noise_clip: float = 3.0

    def __post_init__(self) -> None:
        _require(self.clip_coef > 0, f"clip_coef must be > 0, got {self.clip_coef}")
        _require(self.ent_coef >= 0, f"ent_coef must be >= 0, got {self.ent_coef}")
        _require(self.log_prob_reduction in LOG_PROB_REDUCTIONS,
                 f"log_prob_reduction must be one of {LOG_PROB_REDUCTIONS}, got {self.log_prob_reduction!r}")
        _require(self.noise_clip > 0, f"noise_clip must be > 0, got {self.noise_clip}")


@dataclass(frozen=True)
class ReinFlowConfig:
    """ReinFlow's noise-injected flow chain and its PPO ratio (ReinFlow/ReinFlow, ``cfg/robomimic/finetune/{lift,can,
    square}/ft_ppo_reflow_mlp_img.yaml`` unless noted; ``model/flow/ft_ppo/ppoflow.py``).

    Attributes:
        min_std, max_std: the noise network's std range [min_std, max_std] (0.08, 0.14); min_std is also the sampling floor.
        noise_hidden_dims: the noise network's hidden widths ([256, 256, 256]).
        noise_activation: its activation (Tanh, ``explore_net_activation_type``).
        clip: the PPO clip range of the chain's ratio (``clip_ploss_coef`` 0.01).
        ent_coef: coefficient of the chain's entropy-rate bonus (0.01, ``agent/finetune/reinflow/train_ppo_agent.py``).
        logprob_min, logprob_max: clamp of the normalised chain log-probs, old and new (-1, 1).
        noise_clip: the injected standard-normal noise is clipped to +-noise_clip (``randn_clip_value`` 3).
        include_initial: count log N(x_0; 0, I) in the chain log-prob (``account_for_initial_stochasticity`` true).
        noise_time_conditioned: feed the noise network the velocity network's (detached) time embedding of each
            Euler step besides the state (``use_time_independent_noise: false``, the Transport and Gym configs; needs
            the mlp backbone); false: the state alone (Lift / Can / Square).
    """

    min_std: float = 0.08
    max_std: float = 0.14
    noise_hidden_dims: list[int] = dataclasses.field(default_factory=lambda: [256, 256, 256])
    noise_activation: str = "tanh"
    clip: float = 0.01
    ent_coef: float = 0.01
    logprob_min: float = -1.0
    logprob_max: float = 1.0
    noise_clip: float = 3.0
    include_initial: bool = True
    noise_time_conditioned: bool = False

    def __post_init__(self) -> None:
        _require(0 < self.min_std <= self.max_std, f"need 0 < min_std <= max_std, got {self.min_std}, {self.max_std}")
        _require(len(self.noise_hidden_dims) >= 1 and min(self.noise_hidden_dims) >= 1,
                 f"noise_hidden_dims must be a non-empty list of widths >= 1, got {self.noise_hidden_dims}")
        _require(self.clip > 0, f"clip must be > 0, got {self.clip}")
        _require(self.ent_coef >= 0, f"ent_coef must be >= 0, got {self.ent_coef}")
        _require(self.logprob_min < self.logprob_max,
                 f"logprob_min must be < logprob_max, got {self.logprob_min}, {self.logprob_max}")
        _require(self.noise_clip > 0, f"noise_clip must be > 0, got {self.noise_clip}")


FPO_OUTPUT_MODES: tuple[str, ...] = ("u", "u_but_supervise_as_eps")


@dataclass(frozen=True)
class FPOConfig:
    """FPO's flow-matching-loss ratio (akanazawa/fpo ``playground/src/flow_policy/fpo.py``, ``FpoConfig``).

    Attributes:
        mc_samples: (noise, time) draws per action whose CFM losses form the ratio (``n_samples_per_action`` 8).
        clip: the PPO clip range of the ratio (``clipping_epsilon`` 0.05).
        output_mode: the CFM loss: "u_but_supervise_as_eps" (FPO's default: the noise recovered from the predicted
            velocity is supervised) or "u" (the velocity).
        discretize_t: draw the times from the sampler's Euler times i/K (``discretize_t_for_training`` true);
            false: uniform in [0, 1).
    """

    mc_samples: int = 8
    clip: float = 0.05
    output_mode: str = "u_but_supervise_as_eps"
    discretize_t: bool = True

    def __post_init__(self) -> None:
        _require(self.mc_samples >= 1, f"mc_samples must be >= 1, got {self.mc_samples}")
        _require(self.clip > 0, f"clip must be > 0, got {self.clip}")
        _require(self.output_mode in FPO_OUTPUT_MODES,
                 f"output_mode must be one of {FPO_OUTPUT_MODES}, got {self.output_mode!r}")


DSRL_ALGORITHMS: tuple[str, ...] = ("dsrl_sac", "dsrl_na")


@dataclass(frozen=True)
class DSRLConfig:
    """DSRL's SAC in the latent-noise space of a frozen policy (ajwagen/dsrl ``cfg/robomimic/dsrl_lift.yaml``
    ``train``; ``algorithm: dsrl_sac`` on stable-baselines3's SAC, ``algorithm: dsrl_na`` on the ``DSRL`` class of
    the authors' stable-baselines3 fork).

    Attributes:
        algorithm: ``dsrl_sac`` (noise-action: the critics see the noise w) or ``dsrl_na`` (noise-aliased: a critic
            Q_A(s, a) on the executed action chunk learns by TD, a noise critic Q_W(s, w) is distilled from it on
            w ~ N(0, I), and the actor climbs Q_W).
        action_magnitude: dsrl_sac: the latent noise w lies in [-m, m]^(Ta Da): w = m tanh(u) (``action_magnitude``
            1.5). Unused by dsrl_na, whose actor plays w = tanh(u) in the env's normalised action box [-1, 1]^(Ta Da)
            (its SAC policy is built on the chunked env's action space; ``action_magnitude`` is read only by the
            noise-action env wrapper).
        noise_critic_grad_steps: dsrl_na: distillation steps of Q_W after every ``utd`` SAC steps, each on a fresh
            batch (``noise_critic_grad_steps`` 10).
        gamma: SAC's discount per chunk step (``discount`` 0.99).
        tau: Polyak rate of the target critics (``tau`` 0.005), updated after every gradient step.
        utd: gradient steps per vector-env chunk step (``utd`` 30; ``train_freq`` 1).
        hidden_dims: actor and critic MLP widths (``layer_size`` 2048 x ``num_layers`` 3).
        layer_norm: LayerNorm after every hidden Linear (``use_layer_norm`` true); activation Tanh.
        n_critics: Q networks; the backup takes their min (``n_critics`` 2, ``critic_backup_combine_type: min``).
        init_ent_coef: initial entropy coefficient alpha (stable-baselines3 ``ent_coef: auto``: 1.0).
        learn_ent_coef: tune alpha towards ``target_entropy`` (``ent_coef: -1`` = auto).
        target_entropy: the entropy target (``target_ent`` 0.0); None = -(Ta Da) (stable-baselines3's "auto").
        warmup_chunk_steps: vector-env chunk steps that play w ~ N(0, I) (dsrl_sac: clipped to [-m, m]) before the
            actor acts and before any update (``init_rollout_steps`` 1501).
        buffer_size: replay capacity in transitions (oldest overwritten).
        reward_offset: subtracted from every env step's reward (robomimic ``reward_offset`` 1); applied per chunk
            step as act_steps x offset.
        ddim_steps: a DDPM diffusion BC policy is steered through a DDIM (eta = 0) chain of this many strided steps of
            its K timesteps (``use_ddim: true``, ``ddim_steps: 8``); None: DDIM over all K. Flow policies: unused.
    """

    algorithm: str = "dsrl_sac"
    action_magnitude: float = 1.5
    noise_critic_grad_steps: int = 10
    gamma: float = 0.99
    tau: float = 0.005
    utd: int = 30
    hidden_dims: list[int] = dataclasses.field(default_factory=lambda: [2048, 2048, 2048])
    layer_norm: bool = True
    n_critics: int = 2
    init_ent_coef: float = 1.0
    learn_ent_coef: bool = True
    target_entropy: float | None = 0.0
    warmup_chunk_steps: int = 1501
    buffer_size: int = 1_000_000
    reward_offset: float = 1.0
    ddim_steps: int | None = 8

    def __post_init__(self) -> None:
        _require(self.ddim_steps is None or self.ddim_steps >= 1, f"ddim_steps must be >= 1 or None, got {self.ddim_steps}")
        _require(self.algorithm in DSRL_ALGORITHMS,
                 f"dsrl.algorithm must be one of {list(DSRL_ALGORITHMS)}, got {self.algorithm!r}")
        _require(self.action_magnitude > 0, f"action_magnitude must be > 0, got {self.action_magnitude}")
        _require(self.noise_critic_grad_steps >= 1,
                 f"noise_critic_grad_steps must be >= 1, got {self.noise_critic_grad_steps}")
        _require(0 <= self.gamma <= 1, f"gamma must be in [0, 1], got {self.gamma}")
        _require(0 < self.tau <= 1, f"tau must be in (0, 1], got {self.tau}")
        _require(self.utd >= 1, f"utd must be >= 1, got {self.utd}")
        _require(len(self.hidden_dims) >= 1 and min(self.hidden_dims) >= 1,
                 f"hidden_dims must be a non-empty list of widths >= 1, got {self.hidden_dims}")
        _require(self.n_critics >= 1, f"n_critics must be >= 1, got {self.n_critics}")
        _require(self.init_ent_coef > 0, f"init_ent_coef must be > 0, got {self.init_ent_coef}")
        _require(self.warmup_chunk_steps >= 0, f"warmup_chunk_steps must be >= 0, got {self.warmup_chunk_steps}")
        _require(self.buffer_size >= 1, f"buffer_size must be >= 1, got {self.buffer_size}")


TGPO_SAMPLERS: tuple[str, ...] = ("mh", "uniform")


@dataclass(frozen=True)
class TGPOConfig:
    """TGPO's policy network and its high-level search over time allocations (mmpo.robotics.tgpo; docs/tgpo.md
    marks which values the paper gives and which are this implementation's choice).

    Attributes:
        hidden_dims: widths of the policy's mean ResidualMLP (equal widths).
        activation: its activation.
        init_std: the Gaussian policy's initial std; min_std: its floor.
        sampler: how each episode's allocation tau is drawn in training: "mh" (Metropolis-Hastings chains, one per
            env, driven by the critic V(s0, tau)) or "uniform" (the ablation: uniform over the feasible set).
        temperature: T of the MH acceptance min(1, exp((V(tau') - V(tau)) / T)).
        proposal_std: std (env steps) of the MH random-walk proposal tau' = project(round(tau + std * eps)).
        mh_steps: MH steps per env at each reset.
        eval_candidates: allocations drawn uniformly at evaluation; each env keeps the one with the best V(s0, tau).
    """

    hidden_dims: list[int] | None = None
    activation: str = "mish"
    init_std: float = 0.5
    min_std: float = 0.05
    sampler: str = "mh"
    temperature: float = 1.0
    proposal_std: float = 2.0
    mh_steps: int = 1
    eval_candidates: int = 16

    def __post_init__(self) -> None:
        _require(self.hidden_dims is None or (len(self.hidden_dims) >= 1 and min(self.hidden_dims) >= 1),
                 f"hidden_dims must be a non-empty list of widths >= 1 or None, got {self.hidden_dims}")
        _require(0 < self.min_std <= self.init_std,
                 f"need 0 < min_std <= init_std, got min_std={self.min_std}, init_std={self.init_std}")
        _require(self.sampler in TGPO_SAMPLERS, f"sampler must be one of {TGPO_SAMPLERS}, got {self.sampler!r}")
        _require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        _require(self.proposal_std > 0, f"proposal_std must be > 0, got {self.proposal_std}")
        _require(self.mh_steps >= 1, f"mh_steps must be >= 1, got {self.mh_steps}")
        _require(self.eval_candidates >= 1, f"eval_candidates must be >= 1, got {self.eval_candidates}")


# The flat init arguments of DPPOModule before the groups: old name -> (group, field).
DPPO_FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{name: ("env", name) for name in ("task", "act_steps", "max_episode_steps", "normalizer_path", "num_envs",
                                       "n_steps", "reset_at_iteration", "skip_final_autoreset", "asynchronous",
                                       "env_groups", "prefetch_reset")},
    "max_env_worker_restarts": ("env", "max_worker_restarts"),
    **{name: ("chain", name) for name in ("ft_steps", "gamma_denoise", "clip_base", "clip_final", "clip_rate",
                                         "min_sampling_std", "noise_clip", "min_logprob_std", "logprob_min",
                                         "logprob_max", "rollout_ddim_steps")},
    "gamma": ("returns", "gamma"),
    "gae_lambda": ("returns", "lam"),
    **{name: ("returns", name) for name in ("reward_scale_running", "reward_scale_const", "reward_scale_gamma")},
    "loss": ("loss", "name"),
    "loss_settings": ("loss", "settings"),
    "target_kl": ("loss", "target_kl"),
    "actor_lr": ("optim", "lr"),
    "weight_decay": ("optim", "weight_decay"),
    "max_grad_norm": ("optim", "max_grad_norm"),
    "update_epochs": ("optim", "mu"),
    "batch_size": ("optim", "minibatch_size"),
    "critic_lr": ("critic", "lr"),
    "vf_coef": ("critic", "vf_coef"),
    "n_critic_warmup_itr": ("critic", "warmup_iterations"),
    "critic_hidden_dims": ("critic", "hidden_dims"),
    "eval_every": ("evaluation", "every"),
    "eval_episodes": ("evaluation", "episodes"),
    "eval_sampler": ("evaluation", "sampler"),
    "eval_ddpm_std_floor": ("evaluation", "ddpm_std_floor"),
}
"""Old flat DPPOModule argument -> (group, field); ``bc_checkpoint``, ``num_iterations``, ``seed``,
``env_factory`` and ``max_consecutive_skips`` stayed where they were."""

# GaussianPPOModule's own flat arguments went into its ``gaussian`` group (noise_clip with them: it has no chain).
GAUSSIAN_FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{old: new for old, new in DPPO_FLAT_NAMES.items() if new[0] != "chain"},
    **{name: ("gaussian", name) for name in ("clip_coef", "ent_coef", "log_prob_reduction", "noise_clip")},
}


def grouped_hparams(hparams: Mapping[str, Any], flat_names: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """``hparams`` (a checkpoint's ``hyper_parameters``) with every old flat name of ``flat_names`` moved into its
    group's dict; the groups already there and every other key are kept. ``max_grad_norm: None`` (no clipping)
    becomes 0.0, the new form of "off"; a flat name the module no longer has (a Gaussian checkpoint's saved chain
    settings) is dropped."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in hparams.items():
        if _is_flat(key, value, flat_names):
            group, field = flat_names[key]
            if key == "max_grad_norm" and value is None:
                value = 0.0
            groups.setdefault(group, {})[field] = value
        elif key in DPPO_FLAT_NAMES and key not in flat_names and key != "loss":
            continue
        else:
            out[key] = value
    for group, fields in groups.items():
        out[group] = {**(out.get(group) or {}), **fields}
    return out


def has_flat_hparams(hparams: Mapping[str, Any], flat_names: Mapping[str, tuple[str, str]]) -> bool:
    """Whether ``hparams`` holds an old flat name (``loss`` counts only as a string: the group is a dict)."""
    return any(_is_flat(key, value, flat_names) for key, value in hparams.items())


def _is_flat(key: str, value: Any, flat_names: Mapping[str, tuple[str, str]]) -> bool:
    """``key: value`` is an old flat argument (``loss`` was the loss name; now it is a group's dict)."""
    return key in flat_names and not (key == flat_names[key][0] and isinstance(value, Mapping))


def merged_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Robot module init arguments from ``layers``, later layers winning; a config group (a dict of fields or a
    config instance) in several layers is merged field by field: ``merged_settings(defaults, {"env": {"num_envs":
    4}})`` keeps the other env fields of ``defaults``. Groups come out as dicts (the modules take them)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = {**out[key], **value}
            else:
                out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def refuse_chain_evaluation(evaluation: EvalConfig, why: str) -> None:
    """Refuse DPPO's denoising-chain evaluation settings (``sampler``, ``ddpm_std_floor``) for a policy without that
    chain (Gaussian, flow): ``ValueError("[<set ones>] <why>")``."""
    chain_only = [f"evaluation.{name}" for name in ("sampler", "ddpm_std_floor") if getattr(evaluation, name) is not None]
    if chain_only:
        raise ValueError(f"{chain_only} {why}")
