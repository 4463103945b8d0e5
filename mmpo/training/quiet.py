"""Silence known, harmless Lightning notices that every ``mmpo fit`` printed.

Each filter matches one message exactly (text, category, emitting module), so any other warning
or log line still shows:

- LightningCLI's "args parameter is intended to run from within Python" warning: ``mmpo`` passes
  its own argv to ``LightningCLI(args=...)`` on purpose.
- the "💡 Tip: ... try installing litlogger" log line (an advert, logged at INFO on every fit) and
  its "... litmodels" sibling (logged when the Trainer adds its default ``ModelCheckpoint``).
- torch's ``isinstance(treespec, LeafSpec)`` FutureWarning raised from Lightning's own
  ``lightning.pytorch.utilities._pytree`` (Lightning's code, not ours; nothing for a user to change).
"""

from __future__ import annotations

import logging
import warnings

CLI_ARGS_WARNING = r"LightningCLI's args parameter is intended"
PYTREE_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
PYTREE_MODULE = r"lightning\.pytorch\.utilities\._pytree"
LIGHTNING_TIPS = (
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
    "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels]",
)
# lightning_utilities' rank_zero_info logs through whichever of these Lightning imported last
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class DropLightningTips(logging.Filter):
    """Drops the log records that start with one of ``LIGHTNING_TIPS``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(LIGHTNING_TIPS)


def quiet_lightning_notices() -> None:
    """Install the message-specific filters (idempotent)."""
    warnings.filterwarnings("ignore", message=CLI_ARGS_WARNING)
    warnings.filterwarnings("ignore", message=PYTREE_WARNING, category=FutureWarning, module=PYTREE_MODULE)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLightningTips) for f in logger.filters):
            logger.addFilter(DropLightningTips())
