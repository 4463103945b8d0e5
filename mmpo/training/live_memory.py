"""Peak bytes of tensor storage alive during a block of torch code, on any device (CPU included).

``torch.cuda.max_memory_allocated`` has no CPU counterpart, and process RSS mixes torch's tensors
with the allocator's caching, libraries and Python objects. This counts what the memory budget of
``mmpo estimate`` counts: every storage an ATen operator allocates inside the block (a
``TorchDispatchMode`` sees each operator, forward, backward, checkpoint recomputation and optimizer
step alike) until it is freed (a weak-reference finalizer on the storage), plus the storages that
already exist when the block starts and that the caller names (weights, a reference copy).

torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` does the same bookkeeping per module
but refuses a module called twice in one iteration (gradient accumulation, a no-grad pass before the
training pass) and no-grad reference modules, both of which a GRPO step has; hence this small one.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes(existing=model.parameters()) as live: ...``; then ``live.peak`` (bytes).

    Args:
        existing: tensors alive before the block that count towards its memory (their storages once each).
        device: the device type whose storages are counted ("cpu", "cuda").
    """

    def __init__(self, existing: Iterable[torch.Tensor] = (), device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in existing:
            self._track(tensor)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _track(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device:
            return
        storage = tensor.untyped_storage()
        if storage in self._seen:  # a view, an in-place result, or a tensor counted already
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        weakref.finalize(storage, self._free, nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._track(tensor)
        return out
