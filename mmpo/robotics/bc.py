"""Behaviour-cloning pre-training of a diffusion policy (DDPM epsilon MSE + EMA 0.995).

``mmpo fit -c configs/robotics/bc_lift.yaml`` trains :class:`BCModule` on the action chunks of
:class:`ChunkDataModule` (a demo HDF5 in robomimic's layout; generate one with
``mmpo demos --task lift --out data/lift_demos.hdf5``). Setup as DPPO's pre-training
(arXiv 2409.00588, ``agent/pretrain/train_diffusion_agent.py``): AdamW, cosine LR with warm-up,
EMA of the weights with decay 0.995; the EMA copy is the policy that fine-tuning and evaluation use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, default_collate, random_split

from mmpo.algos.config import step_seed
from mmpo.data.resumable import ResumableSampler, ResumableTrainData
from mmpo.training.optim import make_optimizer
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.robotics.policy import DiffusionPolicy
from mmpo.robotics.policy.io import save_policy_safetensors

EMA_PREFIX = "ema_policy.module."


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """EMA copy via torch's ``AveragedModel``: after each update, ema <- decay * ema + (1 - decay) * param.

    The first ``update_parameters`` call copies the weights (done here, so the EMA starts at the
    initial weights, as DPPO's ``EMA`` helper does).
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay}")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    ema.update_parameters(model)
    ema.requires_grad_(False)
    return ema


class ChunkDataModule(ResumableTrainData, pl.LightningDataModule):
    """(observation, action chunk) batches from a demo HDF5 through ``mmpo.robotics.data.ChunkDataset``.

    The training order is a per-epoch permutation seeded by ``seed + epoch`` and the data position
    is saved in checkpoints (``mmpo.data.resumable``), so a resumed fit sees the same batches as
    an uninterrupted one.

    Args:
        dataset_path: demo file in robomimic's HDF5 layout (ours or robomimic's low_dim.hdf5).
        horizon: Ta, action-chunk length.
        batch_size: minibatch size (DPPO robomimic pre-training: 256).
        val_fraction: share of chunks held out for the validation loss (0 = no validation).
        normalizer_path: min-max stats json; default ``<dataset_path>.stats.json``.
        num_workers: DataLoader workers (0 on shared CPUs).
        seed: seed of the train/validation split and of the per-epoch shuffle.
        on_nonfinite: a demo with a NaN/inf observation or action is an error naming it ("error") or is
            skipped with a warning ("skip"; the count is ``skipped_demos``).
    """

    train_collate_fn = staticmethod(default_collate)

    def __init__(
        self,
        dataset_path: str,
        horizon: int = 4,
        batch_size: int = 256,
        val_fraction: float = 0.0,
        normalizer_path: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
        on_nonfinite: str = "error",
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.dataset_path = dataset_path
        self.horizon = horizon
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.on_nonfinite = on_nonfinite
        self.normalizer_path = normalizer_path or f"{dataset_path}.stats.json"
        self.drop_last = False
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._train_sampler: ResumableSampler | None = None
        self._pending_position: tuple[int, int] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from mmpo.robotics.data import ChunkDataset
        from mmpo.robotics.envs import Normalizer, stats_path_for
        from mmpo.robotics.envs.tasks import ROBOMIMIC_LOW_DIM_KEYS

        if not Path(self.dataset_path).exists():
            raise FileNotFoundError(
                f"demo dataset {self.dataset_path!r} not found; generate it first, e.g. "
                f"`mmpo demos --task lift --num-demos 100 --out {self.dataset_path}`"
            )
        if not Path(self.normalizer_path).exists():
            raise FileNotFoundError(
                f"normaliser stats {self.normalizer_path!r} not found (written by `mmpo demos` beside the dataset)"
            )
        normalizer = Normalizer.load(self.normalizer_path)
        if Path(self.normalizer_path) == stats_path_for(self.dataset_path):
            # the stats file beside the data must describe that data (not a previous dataset's)
            normalizer.check_belongs_to(self.dataset_path, self.normalizer_path)
        # the stats name the observation keys of their task (a camera task's frame among them); older stats: low-dim
        keys = normalizer.metadata.get("obs_keys") or ROBOMIMIC_LOW_DIM_KEYS
        dataset = ChunkDataset(self.dataset_path, horizon=self.horizon, normalizer=normalizer,
                               on_nonfinite=self.on_nonfinite, obs_keys=tuple(keys))
        if len(dataset) == 0:
            raise ValueError(f"demo dataset {self.dataset_path!r} holds no chunks")
        num_val = int(round(len(dataset) * self.val_fraction))
        if num_val > 0:
            generator = torch.Generator().manual_seed(self.seed)
            self.train_set, self.val_set = random_split(dataset, [len(dataset) - num_val, num_val], generator=generator)
        else:
            self.train_set = dataset

    def _training_rows(self) -> Dataset:
        self.setup()
        return self.train_set

    def _num_train_rows(self) -> int | None:
        return None if self.train_set is None else len(self.train_set)

    def _train_dataset(self) -> Dataset:
        return self._training_rows()

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


def _unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        obs, actions = batch["obs"], batch["actions"]
    else:
        obs, actions = batch[0], batch[1]
    return obs.float().reshape(obs.shape[0], -1), actions.float()


class BCModule(NonFiniteGuardMixin, pl.LightningModule):
    """DDPM behaviour cloning of a :class:`~mmpo.robotics.policy.DiffusionPolicy` (arXiv 2006.11239, 2409.00588).

    Args:
        obs_dim, action_dim, horizon: policy input/output sizes (lift: 19, 7, 4).
        backbone, denoising_steps, hidden_dims, time_dim, activation, unet_channels: see DiffusionPolicy
            (hidden_dims default [512, 512, 512], unet_channels default [64, 128], as DPPO lift/can).
        lr, lr_min, warmup_steps, weight_decay: AdamW + linear warm-up then cosine decay to lr_min.
        ema_decay: EMA decay of the weights (DPPO: 0.995).
        task, act_steps, max_episode_steps: environment settings stored in the checkpoint for
            DPPO fine-tuning and ``mmpo rollout``.
        normalizer_path: stats json stored in the checkpoint (default: the datamodule's).
        export_safetensors: also write the EMA policy as ``<log_dir>/policy.safetensors`` at the end.
        seed: seed of each batch's timesteps and noise (mixed with the batch index and rank).
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights, EMA
            and optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        image_encoder: a camera task's image encoder settings (``image_size`` = the task's, optional ``channels``,
            ``feature_dim``; :class:`~mmpo.robotics.policy.networks.ImageEncoder`); None for state observations.
            Diffusion policies only.
    """

    policy_class: type[torch.nn.Module] = DiffusionPolicy
    """The policy trained (:class:`~mmpo.robotics.flow_bc.FlowBCModule`: the flow-matching policy)."""
    kind = "bc"
    """The checkpoint's ``robotics`` kind."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int = 4,
        *,
        backbone: str = "mlp",
        denoising_steps: int = 20,
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
        image_encoder: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        if not 1 <= act_steps <= horizon:
            raise ValueError(f"act_steps must be in [1, horizon={horizon}], got {act_steps}")
        self.policy = self.policy_class(
            obs_dim, action_dim, horizon, backbone=backbone, denoising_steps=denoising_steps,
            hidden_dims=list(hidden_dims or (512, 512, 512)), time_dim=time_dim, activation=activation,
            unet_channels=list(unet_channels or (64, 128)),
            **({"image_encoder": dict(image_encoder)} if image_encoder else {}),
        )
        self.ema_policy = make_ema(self.policy, ema_decay)

    # ------------------------------------------------------------------ training
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and self.hparams.normalizer_path is None:
            self.hparams.normalizer_path = getattr(datamodule, "normalizer_path", None)
        if datamodule is not None and getattr(datamodule, "horizon", self.hparams.horizon) != self.hparams.horizon:
            raise ValueError(
                f"data.horizon={datamodule.horizon} != model.horizon={self.hparams.horizon}; set both to the same Ta"
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        obs, actions = _unpack_batch(batch)
        generator = self._noise_generator(self.trainer.fit_loop.total_batch_idx) if self._trainer is not None else None
        loss = self.policy.bc_loss(obs, actions, generator=generator)
        self.log("losses/bc", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=obs.shape[0])
        return loss

    def _noise_generator(self, batch_index: int, stream: int = 0) -> torch.Generator:
        """Timesteps and noise of one batch, seeded by (seed + stream, batch index, rank): a resumed fit
        draws what an uninterrupted one would (torch's global RNG also feeds DataLoader start-up, which
        differs after a resume), and every validation uses the same noise (stream 1)."""
        seed = step_seed(self.hparams.seed + stream, batch_index, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here rather than in on_train_batch_end: Lightning runs the checkpoint callback's
        # on_train_batch_end first, so a checkpoint written there would miss this step's EMA update.
        if not self.nonfinite.skipping:  # a skipped (non-finite) step leaves the EMA as it was too
            self.ema_policy.update_parameters(self.policy)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        obs, actions = _unpack_batch(batch)
        loss = self.ema_policy.module.bc_loss(obs, actions, generator=self._noise_generator(batch_idx, stream=1))
        self.log("losses/bc_val_ema", loss, prog_bar=True, batch_size=obs.shape[0])
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        return make_optimizer(self.policy.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay,
                              warmup_steps=min(self.hparams.warmup_steps, total), schedule="cosine",
                              total_steps=total, min_lr_ratio=self.hparams.lr_min / self.hparams.lr)

    # ------------------------------------------------------------------ checkpoints
    def robotics_metadata(self) -> dict[str, Any]:
        hp = self.hparams
        return {
            "kind": self.kind,
            "policy_config": self.policy.policy_config,
            "policy_prefix": EMA_PREFIX,
            "ft_steps": 0,
            "task": hp.task,
            "act_steps": hp.act_steps,
            "max_episode_steps": hp.max_episode_steps,
            "normalizer_path": hp.normalizer_path,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["robotics"] = self.robotics_metadata()

    def on_train_end(self) -> None:
        if self.hparams.export_safetensors and self.trainer.log_dir and self.trainer.is_global_zero:
            path = Path(self.trainer.log_dir) / "policy.safetensors"
            save_policy_safetensors(self.ema_policy.module, self.robotics_metadata(), path)
