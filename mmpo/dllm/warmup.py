"""Create the SFT-warmed checkpoint the RL configs start from, if it is missing.

The RL module (``mmpo.dllm.rl.DiffuGRPO``) calls :func:`ensure_warm_model` when its
``model_path`` has no model: it runs the SFT config (``configs/dllm/sft_tiny.yaml`` by
default) through the same LightningCLI as ``mmpo fit``, writing to ``model_path``. The
explicit sequence is documented in ``docs/dllm.md``; by hand::

    python -m mmpo.dllm.warmup --model-path runs/dllm/sft_tiny/model --config configs/dllm/sft_tiny.yaml
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def ensure_warm_model(model_path: str | Path, sft_config: str | Path, extra_args: list[str] | None = None) -> Path:
    """Run ``mmpo fit -c sft_config`` writing to ``model_path`` unless a model is already there.

    Args:
        model_path: folder the SFT stage saves to (``config.json`` marks it as present).
        sft_config: the SFT YAML config.
        extra_args: further LightningCLI overrides (e.g. ``["--trainer.max_steps=10"]``).
    Returns:
        ``model_path``.
    """
    model_path = Path(model_path)
    if (model_path / "config.json").is_file():
        return model_path
    if not Path(sft_config).is_file():
        raise FileNotFoundError(f"SFT config {str(sft_config)!r} not found (needed to create {str(model_path)!r})")
    from mmpo.cli import lightning_main

    log.warning("no warm model at %s: running SFT warm-up %s first", model_path, sft_config)
    lightning_main(
        [
            "fit", "-c", str(sft_config),
            f"--model.init_args.save_dir={model_path}",
            f"--trainer.default_root_dir={model_path.parent}",
            *(extra_args or []),
        ]
    )
    if not (model_path / "config.json").is_file():
        raise RuntimeError(f"SFT warm-up finished but wrote no model to {str(model_path)!r}")
    return model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="create the SFT-warmed dLLM checkpoint if it is missing")
    parser.add_argument("--model-path", default="runs/dllm/sft_tiny/model")
    parser.add_argument("--config", default="configs/dllm/sft_tiny.yaml")
    args, extra = parser.parse_known_args(argv)
    print(ensure_warm_model(args.model_path, args.config, extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
