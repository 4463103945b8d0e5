"""Denoiser backbones eps_theta(x_k, k, s) over action chunks, and the critic MLP.

Both follow DPPO (arXiv 2409.00588, ``model/diffusion/mlp_diffusion.py``, ``unet.py``):
a residual MLP (the default for low-dim states) and a 1-D temporal UNet.
"""

from __future__ import annotations

import torch
from diffusers import UNet1DModel
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from torch import nn

ACTIVATIONS: dict[str, type[nn.Module]] = {"mish": nn.Mish, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def make_activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


class PreActivationResidualBlock(nn.Module):
    """x + W2 act(W1 act(x)): DPPO's ``TwoLayerPreActivationResNetLinear``."""

    def __init__(self, width: int, activation: str) -> None:
        super().__init__()
        self.act = make_activation(activation)
        self.linear1 = nn.Linear(width, width)
        self.linear2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear2(self.act(self.linear1(self.act(x))))


class ResidualMLP(nn.Module):
    """Linear(in, h) -> (len(hidden)-1)//2 pre-activation residual blocks -> act -> Linear(h, out).

    With hidden_dims [512, 512, 512] this is one residual block, as in DPPO's robomimic MLPs.
    Shapes: (B, in_dim) -> (B, out_dim).
    """

    def __init__(self, in_dim: int, hidden_dims: list[int] | tuple[int, ...], out_dim: int, activation: str = "mish") -> None:
        super().__init__()
        hidden_dims = list(hidden_dims)
        if not hidden_dims or len(set(hidden_dims)) != 1:
            raise ValueError(f"ResidualMLP needs equal, non-empty hidden_dims, got {hidden_dims}")
        width = hidden_dims[0]
        self.input = nn.Linear(in_dim, width)
        self.blocks = nn.Sequential(*[PreActivationResidualBlock(width, activation) for _ in range((len(hidden_dims) - 1) // 2)])
        self.act = make_activation(activation)
        self.output = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.act(self.blocks(self.input(x))))


class MLPDenoiser(nn.Module):
    """eps_theta for a flattened chunk: input [x_k (Ta*Da), time embedding, state] (DPPO ``DiffusionMLP``).

    The sinusoidal timestep embedding and its MLP are diffusers' ``Timesteps`` and
    ``TimestepEmbedding``. Shapes: x (B, Ta, Da), timesteps (B,), obs (B, obs_dim) -> (B, Ta, Da).
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int,
        *,
        hidden_dims: list[int] | tuple[int, ...] = (512, 512, 512),
        time_dim: int = 16,
        activation: str = "mish",
    ) -> None:
        super().__init__()
        self.horizon, self.action_dim = horizon, action_dim
        self.time_proj = Timesteps(time_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(time_dim, 2 * time_dim, act_fn="mish", out_dim=time_dim)
        self.body = ResidualMLP(horizon * action_dim + time_dim + obs_dim, hidden_dims, horizon * action_dim, activation)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        time_features = self.time_embed(self.time_proj(timesteps).to(x.dtype))
        features = torch.cat([x.reshape(batch, -1), time_features, obs], dim=-1)
        return self.body(features).view(batch, self.horizon, self.action_dim)


class UNetDenoiser(nn.Module):
    """eps_theta as diffusers' ``UNet1DModel`` in its temporal-ResNet ("Diffuser") configuration.

    ``UNet1DModel`` has no global-conditioning (FiLM) input, so the state is fed as extra input
    channels broadcast over the chunk's time axis (the Diffuser-style alternative to FiLM);
    everything else (residual temporal blocks, Mish, GroupNorm 8, dims (64, 128)) is the library's.
    Shapes: x (B, Ta, Da), timesteps (B,), obs (B, obs_dim) -> (B, Ta, Da).
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int,
        *,
        channels: list[int] | tuple[int, ...] = (64, 128),
        norm_groups: int = 8,
    ) -> None:
        super().__init__()
        channels = tuple(channels)
        if len(channels) < 2:
            raise ValueError(f"UNetDenoiser needs >= 2 channel levels, got {channels}")
        if horizon % (2 ** (len(channels) - 1)) != 0:
            raise ValueError(f"horizon {horizon} must be divisible by 2**(levels-1) = {2 ** (len(channels) - 1)}")
        self.unet = UNet1DModel(
            sample_size=horizon,
            in_channels=action_dim + obs_dim,
            out_channels=action_dim,
            down_block_types=("DownResnetBlock1D",) * len(channels),
            up_block_types=("UpResnetBlock1D",) * (len(channels) - 1),
            mid_block_type="MidResTemporalBlock1D",
            out_block_type="OutConv1DBlock",
            block_out_channels=channels,
            act_fn="mish",
            use_timestep_embedding=True,
            time_embedding_type="positional",
            flip_sin_to_cos=False,
            freq_shift=1,
            norm_num_groups=norm_groups,
            layers_per_block=1,
        )

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        horizon = x.shape[1]
        cond = obs.unsqueeze(-1).expand(-1, -1, horizon)
        sample = torch.cat([x.transpose(1, 2), cond], dim=1)
        return self.unet(sample, timesteps).sample.transpose(1, 2)


class ImageEncoder(nn.Module):
    """Features of a flat observation [proprio (P); image (S, S, 3) flattened (H, W, C), normalised to [-1, 1]].

    The image goes through DPPO's patch embedding ``embed2`` (``model/common/vit.py``: Conv2d(3, C, 8, stride 4),
    ReLU, Conv2d(C, C, 3, stride 2)), then ReLU and one Linear from the flattened patch grid to ``feature_dim``
    (in place of DPPO's 1-layer ViT and ``SpatialEmb``); the output is [proprio; features] (P + feature_dim).
    Shapes: (B, P + 3 S^2) -> (B, P + feature_dim).
    """

    def __init__(self, obs_dim: int, image_size: int, *, channels: int = 32, feature_dim: int = 64) -> None:
        super().__init__()
        self.image_size = int(image_size)
        self.proprio_dim = int(obs_dim) - 3 * self.image_size ** 2
        if self.proprio_dim < 0 or self.image_size < 11:
            raise ValueError(f"an image encoder needs image_size >= 11 and obs_dim >= 3 image_size^2, got "
                             f"image_size {image_size}, obs_dim {obs_dim}")
        self.patches = nn.Sequential(nn.Conv2d(3, channels, 8, stride=4), nn.ReLU(),
                                     nn.Conv2d(channels, channels, 3, stride=2), nn.ReLU())
        grid = ((self.image_size - 8) // 4 + 1 - 3) // 2 + 1
        self.project = nn.Linear(channels * grid * grid, feature_dim)
        self.out_dim = self.proprio_dim + feature_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        size = self.image_size
        proprio, pixels = obs[:, : self.proprio_dim], obs[:, self.proprio_dim:]
        image = pixels.reshape(obs.shape[0], size, size, 3).permute(0, 3, 1, 2)
        return torch.cat([proprio, self.project(self.patches(image).flatten(1))], dim=-1)


class EncodedDenoiser(nn.Module):
    """A denoiser (or velocity network) whose state input is ``encoder(obs)``: an image policy's network (the encoder
    is trained and fine-tuned with it, as DPPO's ``VisionDiffusionMLP``). Same call as the denoiser."""

    def __init__(self, encoder: ImageEncoder, denoiser: nn.Module) -> None:
        super().__init__()
        self.encoder, self.denoiser = encoder, denoiser

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        return self.denoiser(x, timesteps, self.encoder(obs))


class CriticMLP(nn.Module):
    """V(s): DPPO's ``CriticObs`` (residual MLP, Mish, [256, 256, 256]). Shapes: (B, obs_dim) -> (B,).
    ``image_encoder`` (the policy's settings): the critic encodes the image with its own :class:`ImageEncoder`
    (DPPO's ``ViTCritic`` has its own encoder too)."""

    def __init__(self, obs_dim: int, hidden_dims: list[int] | tuple[int, ...] = (256, 256, 256), activation: str = "mish",
                 image_encoder: dict | None = None) -> None:
        super().__init__()
        self.encoder = ImageEncoder(obs_dim, **image_encoder) if image_encoder else None
        self.body = ResidualMLP(self.encoder.out_dim if self.encoder else obs_dim, hidden_dims, 1, activation)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(self.encoder(obs) if self.encoder is not None else obs).squeeze(-1)
