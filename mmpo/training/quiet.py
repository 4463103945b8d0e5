"""Silence known, harmless Lightning notices that every ``mmpo fit`` printed.

Each filter matches one message exactly (text, category, emitting module), so any other warning
or log line still shows:

- LightningCLI's "args parameter is intended to run from within Python" warning: ``mmpo`` passes
  its own argv to ``LightningCLI(args=...)`` on purpose.
- the "💡 Tip: ... try installing litlogger" log line (an advert, logged at INFO on every fit) and
  its "... litmodels" sibling (logged when the Trainer adds its default ``ModelCheckpoint``).
- torch's ``isinstance(treespec, LeafSpec)`` FutureWarning raised from Lightning's own
  ``lightning.pytorch.utilities._pytree`` (Lightning's code, not ours; nothing for a user to change).
- Lightning's device lines when there is no such device (``GPU available: False, used: False``,
  ``TPU available: False, using: 0 TPU cores``; a line naming a device that is there still shows), its
  ```Trainer.fit` stopped: `max_steps=N` reached.`` (the step bar already ends at ``step N/N``),
  ``Seed set to N`` (the seed is in the run's config.yaml), the ``val_check_interval=1`` notice and the notice
  that a module's own ``NonFiniteGuardState`` replaces the Trainer's (both asked for).

:func:`hf_progress_bars_off` hides transformers' / huggingface_hub's "Loading weights" / "Writing model shards"
bars while a fit runs, so the step bar is the run's one progress line.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

CLI_ARGS_WARNING = r"LightningCLI's args parameter is intended"
PYTREE_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
PYTREE_MODULE = r"lightning\.pytorch\.utilities\._pytree"
LIGHTNING_TIPS = (
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
    "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels]",
)
# info lines that say nothing on a CPU run or repeat what the step bar and config.yaml show (exact texts)
LIGHTNING_NOISE = (
    "GPU available: False, used: False",
    "TPU available: False, using: 0 TPU cores",
    "`Trainer.fit` stopped: `max_steps=",
    "Loading `train_dataloader` to estimate number of stepping batches.",
    "`Trainer(val_check_interval=1)` was configured so validation will run after every batch.",
    # mmpo modules return their own NonFiniteGuardState (mmpo.training.nonfinite); replacing the Trainer's is intended
    "The following callbacks returned in `LightningModule.configure_callbacks` will override existing callbacks "
    "passed to Trainer: NonFiniteGuardState",
)
SEED_LOGGER = "lightning.fabric.utilities.seed"
SEED_MESSAGE = "Seed set to "
# lightning_utilities' rank_zero_info logs through whichever of these Lightning imported last
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class DropLightningTips(logging.Filter):
    """Drops the log records that start with one of ``LIGHTNING_TIPS`` or ``LIGHTNING_NOISE``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith((*LIGHTNING_TIPS, *LIGHTNING_NOISE))


class DropSeedLine(logging.Filter):
    """Drops Lightning's ``Seed set to N`` (``[rank: k] Seed set to N`` under several processes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return SEED_MESSAGE not in record.getMessage()


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Hide transformers' (and huggingface_hub's) tqdm bars inside the block; restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def quiet_lightning_notices() -> None:
    """Install the message-specific filters (idempotent)."""
    warnings.filterwarnings("ignore", message=CLI_ARGS_WARNING)
    warnings.filterwarnings("ignore", message=PYTREE_WARNING, category=FutureWarning, module=PYTREE_MODULE)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLightningTips) for f in logger.filters):
            logger.addFilter(DropLightningTips())
    seed_logger = logging.getLogger(SEED_LOGGER)
    if not any(isinstance(f, DropSeedLine) for f in seed_logger.filters):
        seed_logger.addFilter(DropSeedLine())
