"""Algorithm state objects carried through Lightning checkpoints (EPO's entropy history, SFPO's switch)."""

from __future__ import annotations

from typing import Any


class CheckpointedState:
    """LightningModule mixin (put it before the module class): every ``(key, attribute)`` of
    ``checkpointed_state`` names an object with ``state_dict()`` / ``load_state_dict()`` saved under
    ``checkpoint[key]`` and restored on resume (a checkpoint without the key leaves it as built)."""

    checkpointed_state: tuple[tuple[str, str], ...] = ()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        for key, attribute in self.checkpointed_state:
            checkpoint[key] = getattr(self, attribute).state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        for key, attribute in self.checkpointed_state:
            if key in checkpoint:
                getattr(self, attribute).load_state_dict(checkpoint[key])
