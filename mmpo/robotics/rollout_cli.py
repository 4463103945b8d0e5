"""``mmpo rollout``: run a BC or DPPO policy checkpoint in its task and optionally record a video.

Example::

    mmpo rollout --ckpt runs/dppo_lift/checkpoints/last.ckpt --task lift --episodes 5 --video lift.mp4

Sampling is deterministic by default (the evaluation chain: fine-tuned network on the last K'
denoising steps). A frame is rendered offscreen after every control step (gymnasium's
``RenderCollection`` under the action-chunk wrapper) from robosuite's default render camera
(``frontview``) at 256x256, so the video plays in real time at the control frequency (20 fps for
Lift and Can). It is streamed to a temporary file and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np


class VideoFile:
    """An mp4 written frame by frame to a temporary sibling, renamed to ``path`` by :meth:`finish`.

    Frames are streamed (a long rollout at 256x256 would not fit in memory as a list).
    """

    def __init__(self, path: str | Path, *, fps: float) -> None:
        import imageio.v2 as imageio

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(f".{self.path.stem}.partial{self.path.suffix}")
        self.fps = float(fps)
        self.frames = 0
        self._writer = imageio.get_writer(self.partial, fps=self.fps)

    def append(self, frames: Sequence[np.ndarray]) -> None:
        for frame in frames:
            self._writer.append_data(np.asarray(frame, dtype=np.uint8))
            self.frames += 1

    def finish(self) -> None:
        self._writer.close()
        os.replace(self.partial, self.path)


def _parser() -> argparse.ArgumentParser:
    from mmpo.robotics.envs.tasks import TASKS

    parser = argparse.ArgumentParser(prog="mmpo rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="BC or DPPO checkpoint (.ckpt or .safetensors)")
    parser.add_argument("--task", default=None, type=str.lower, choices=sorted(TASKS),
                        help="a registered task (default: the checkpoint's)")
    parser.add_argument("--episodes", type=int, default=1, help="episodes to run")
    parser.add_argument("--video", default=None, help="write an mp4 of all episodes here")
    parser.add_argument("--seed", type=int, default=0, help="env seed")
    parser.add_argument("--stochastic", action="store_true", help="sample as in training (default: deterministic)")
    parser.add_argument("--sampler", default=None, choices=["ddpm", "ddim"],
                        help="deterministic chain: DDPM step means (default) or DDIM eta = 0")
    parser.add_argument("--max-episode-steps", type=int, default=None, help="time limit (default: checkpoint/task)")
    parser.add_argument("--normalizer", default=None, help="stats json (default: the checkpoint's)")
    parser.add_argument("--image-size", type=int, default=256, help="video frame side for robosuite tasks")
    parser.add_argument("--fps", type=float, default=None,
                        help="video frame rate (default: the control frequency, one frame per control step)")
    return parser


def rollout_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mmpo rollout``; prints a JSON summary and returns an exit code."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.episodes < 1:
        print(f"error: --episodes must be >= 1, got {args.episodes}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from gymnasium.wrappers import RenderCollection
    from tqdm.auto import tqdm

    from mmpo.robotics.envs import ActionChunkWrapper, Normalizer, make_env
    from mmpo.robotics.policy.io import load_policy

    torch.set_num_threads(1)
    try:
        policy, metadata = load_policy(args.ckpt)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    task = args.task or metadata.get("task")
    if task is None:
        print("error: the checkpoint records no task; pass --task", file=sys.stderr)
        return 2
    act_steps = int(metadata.get("act_steps") or policy.horizon)
    normalizer_path = args.normalizer or metadata.get("normalizer_path")
    if normalizer_path is None or not Path(normalizer_path).exists():
        print(f"error: normaliser stats {normalizer_path!r} not found; pass --normalizer PATH", file=sys.stderr)
        return 2
    normalizer = Normalizer.load(normalizer_path)
    env = make_env(task, seed=args.seed, max_episode_steps=args.max_episode_steps or metadata.get("max_episode_steps"),
                   render=args.video is not None, image_size=args.image_size)
    recorder = RenderCollection(env, pop_frames=True, reset_clean=False) if args.video is not None else None
    video = VideoFile(args.video, fps=args.fps or env.metadata["render_fps"]) if args.video is not None else None
    env = ActionChunkWrapper(recorder or env, act_steps, normalizer)
    returns, successes, lengths = [], [], []
    generator = torch.Generator().manual_seed(args.seed)
    for _ in tqdm(range(args.episodes), desc="rollout episodes", leave=False):
        obs, _ = env.reset()
        total, success, length, done = 0.0, False, 0, False
        while not done:
            obs_tensor = torch.as_tensor(np.asarray(obs), dtype=torch.float32).unsqueeze(0)
            chunk = policy.sample(obs_tensor, deterministic=not args.stochastic, generator=generator,
                                  deterministic_sampler=args.sampler).actions[0]
            obs, reward, terminated, truncated, info = env.step(chunk.numpy())
            total += float(reward)
            success = success or bool(info.get("success_any", False))
            length += int(info.get("executed_steps", act_steps))
            done = bool(terminated or truncated)
            if video is not None:
                video.append(recorder.render())  # the frames of this chunk's control steps (and the reset's)
        returns.append(total)
        successes.append(success)
        lengths.append(length)
    env.close()
    summary = {
        "task": task,
        "checkpoint": str(args.ckpt),
        "kind": metadata.get("kind"),
        "episodes": args.episodes,
        "deterministic": not args.stochastic,
        "return_mean": float(np.mean(returns)),
        "success_rate": float(np.mean(successes)),
        "episode_length_mean": float(np.mean(lengths)),
    }
    if video is not None:
        video.finish()
        summary["video"] = str(args.video)
        summary["frames"] = video.frames
        summary["fps"] = video.fps
    print(json.dumps(summary))
    return 0
