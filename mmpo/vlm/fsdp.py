"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a Qwen-VL policy and its reference model.

Layout (one data-parallel mesh dimension, no tensor parallelism):

- every decoder layer of the language model is its own FSDP unit (all-gathered for its forward
  and backward, resharded in between);
- the root unit holds the rest: embeddings, final norm, ``lm_head`` and the whole vision tower.
  The vision tower stays in the root on purpose: a rank whose micro-batch has no image never runs
  it, and a per-block unit would then all-gather / reduce-scatter on some ranks only (a hang).
  The root unit runs on every forward, and ``set_reduce_scatter_unused_params(True)`` makes it
  reduce-scatter zeros for the vision weights a text-only rank did not use, so every rank joins
  the same collectives (DDP's ``find_unused_parameters`` for FSDP2).

mmpo's log-prob path calls the backbone (``model.model``) and the ``lm_head`` weight directly, not
``model.forward``; :func:`as_root_forward` runs such a function under the root unit's FSDP
pre/post-forward hooks (``register_fsdp_forward_method``), so its weights are gathered and its
gradients reduce-scattered as for a forward call.

Every rank must run the same FSDP units the same number of times per step (each unit forward is an
all-gather, each backward a reduce-scatter). A choice that changes the number of backbone passes is
made by all ranks together (:func:`all_ranks_agree`): the shared-prompt forward
(:mod:`mmpo.vlm.shared_prompts`) runs the backbone twice, the plain forward once, and a rank with an
image prompt shared by several completions beside a text-only rank would otherwise run twice the
collectives (a hang in the first backward, after all-gathers exchanged between different layers).

Generation (HF ``generate``) runs on full weights: :func:`full_weights` all-gathers every unit once
and keeps it gathered until the block ends, so the token-by-token decoding makes no collective
call and ranks may stop after different numbers of tokens (verl's hybrid engine and TRL gather
the full weights for generation in the same way).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

ROOT_CALL = "mmpo_fsdp_root_call"
_RESHARD_FLAGS = "mmpo_fsdp_reshard_after_forward"
_GATHER_DEPTH = "mmpo_fsdp_gather_depth"
_MESH = "mmpo_fsdp_mesh"

T = TypeVar("T")


def fsdp_root(model: nn.Module) -> nn.Module:
    """The module FSDP2 makes its root unit: the transformers model (under a peft wrapper for LoRA)."""
    from mmpo.training.lora import unwrap

    return unwrap(model)


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` was sharded by :func:`shard_vlm`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(fsdp_root(model), FSDPModule)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's decoder layers (``model.get_decoder().layers``) of an HF VLM."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"{type(model).__name__} has no decoder layers at get_decoder().layers: FSDP2 sharding "
                        "here supports HF Qwen-VL style models")
    return layers


def _call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    # FSDP2 hooks the root call's output tensors for backward; a view output would lose the hook to
    # an in-place op (FSDP2 warns on every call), so views are returned as copies (small: (N, T) each)
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t,
                    function(*args, **kwargs))


def shard_vlm(model: nn.Module, mesh: Any, *, frozen: bool = False,
              mp_policy: Any | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over the 1-D data-parallel ``mesh``; returns it.

    Args:
        model: an HF VLM (``...ForConditionalGeneration``), or a peft LoRA model of one (sharded
            through the VLM it wraps, :func:`fsdp_root`).
        mesh: a 1-D ``DeviceMesh`` (the data-parallel ranks).
        frozen: a model that never trains (the KL reference): its root is resharded after every
            forward too (there is no backward to keep it gathered for).
        mp_policy: an optional ``MixedPrecisionPolicy`` (None: compute in the weights' dtype).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if is_sharded(model):
        raise RuntimeError(f"{type(model).__name__} is already sharded")
    wrapper, model = model, fsdp_root(model)
    settings: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    units: list[tuple[nn.Module, bool]] = []
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True, **settings)
        units.append((layer, True))
    # the root is gathered again right away by backward: keep it gathered after a training forward
    root_reshard = bool(frozen)
    fully_shard(model, reshard_after_forward=root_reshard, **settings)
    units.append((model, root_reshard))
    model.set_reduce_scatter_unused_params(True)  # text-only micro-batches: zeros for the vision tower
    # plain attributes (not submodules): the units and their settings, for full_weights()
    object.__setattr__(model, _RESHARD_FLAGS, units)
    object.__setattr__(model, _GATHER_DEPTH, 0)
    object.__setattr__(model, _MESH, mesh)
    setattr(model, ROOT_CALL, _call)
    register_fsdp_forward_method(model, ROOT_CALL)
    return wrapper


def as_root_forward(model: nn.Module, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``, run as a forward of ``model``'s FSDP root unit when sharded."""
    call = getattr(fsdp_root(model), ROOT_CALL, None)
    if call is None:
        return function(*args, **kwargs)
    return call(function, *args, **kwargs)


def all_ranks_agree(model: nn.Module, flag: bool) -> bool:
    """True when ``flag`` is True on every rank of ``model``'s FSDP2 mesh; ``flag`` itself when not sharded.

    Collective when sharded (one scalar all-reduce): every rank must call it at the same point. For a
    choice that changes which FSDP units run (and so which collectives), e.g. the shared-prompt forward
    (:mod:`mmpo.vlm.shared_prompts`), so that every rank makes the same one."""
    if not is_sharded(model):
        return bool(flag)
    import torch.distributed as dist

    mesh = getattr(fsdp_root(model), _MESH)
    value = torch.tensor([1 if flag else 0], device=mesh.device_type)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return bool(value.item())


@contextmanager
def full_weights(model: nn.Module) -> Iterator[None]:
    """Keep every FSDP unit of ``model`` gathered (full weights on every rank) inside the block.

    A no-op for a model that is not sharded; nested blocks gather once. Every rank must enter and
    leave the outermost block together (the gather and the reshard are collective calls); inside
    it, forwards and ``generate`` make no collective call.
    """
    if not is_sharded(model):
        yield
        return
    model = fsdp_root(model)
    depth = getattr(model, _GATHER_DEPTH)
    units: list[tuple[Any, bool]] = getattr(model, _RESHARD_FLAGS)
    if depth == 0:
        for unit, _ in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
    object.__setattr__(model, _GATHER_DEPTH, depth + 1)
    try:
        yield
    finally:
        object.__setattr__(model, _GATHER_DEPTH, depth)
        if depth == 0:
            for unit, reshard in units:
                unit.set_reshard_after_forward(reshard, recurse=False)
                unit.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of ``model``'s :func:`fsdp_root` on CPU on rank 0 (empty elsewhere)
    when sharded; its ``state_dict()`` otherwise. Collective when sharded: every rank must call it.
    A LoRA model's keys are the transformers model's (``...q_proj.base_layer.weight``,
    ``...q_proj.lora_A.default.weight``), without peft's ``base_model.model.`` prefix."""
    if not is_sharded(model):
        return fsdp_root(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(fsdp_root(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A reduction over sharded tensors (e.g. a gradient norm of DTensor gradients) as a plain tensor
    holding the value over every rank's shard; other tensors are returned as they are."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
