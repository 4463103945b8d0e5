"""Is the STL Reacher task satisfiable, and what does TGPO's stage reward prefer? A scripted controller (inverse
kinematics of a Cartesian waypoint, joint-space PD torques) follows three kinds of path on the STL Reacher tasks
(mmpo/robotics/envs/stl_envs.py) under the midpoint allocation, over seeded initial states:

- ``arc``: to g1 by step 20, then straight to g2 in joint space (the elbow held, the shoulder turning: the
  fingertip follows the goals' circle), the direct path;
- ``chord``: to g1, then along the straight line to g2 over steps 20-30, then hold;
- ``none``: hold the start (a lower bound of the stage return).

It prints the STL satisfaction rate, the mean robustness, how often the fingertip enters the obstacle and the mean
stage-reward return (TGPO's training signal) per task and path.

    OMP_NUM_THREADS=1 python bench/diagnose_tgpo_reacher.py --tasks stl_reacher2 stl_reacher2_inner --episodes 10
"""

from __future__ import annotations

import argparse

import numpy as np

L1, L2 = 0.1, 0.11  # Reacher-v5's link lengths (reacher.xml: body1 at 0.1, fingertip at 0.11 on it)


def ik(point: np.ndarray, elbow: float) -> np.ndarray:
    """Joint angles placing the fingertip at ``point`` (elbow sign ``elbow``)."""
    c = np.clip((point @ point - L1**2 - L2**2) / (2 * L1 * L2), -1.0, 1.0)
    q1 = elbow * np.arccos(c)
    return np.array([np.arctan2(point[1], point[0]) - np.arctan2(L2 * np.sin(q1), L1 + L2 * np.cos(q1)), q1])


def waypoints(path: str, g1: np.ndarray, g2: np.ndarray, start: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(until step, fingertip target) pairs."""
    if path == "none":
        return [(10**6, start)]
    if path == "arc":
        return [(20, g1), (10**6, g2)]
    return [(20, g1)] + [(21 + i, g1 + (g2 - g1) * (i + 1) / 10) for i in range(10)] + [(10**6, g2)]


def episode(env, path: str, seed: int, kp: float = 2.0, kd: float = 0.1) -> tuple[float, bool, float]:
    """(robustness, obstacle entered, stage return) of one scripted episode."""
    env.reset(seed=seed)
    goals = [np.asarray(sub.reach.center) for sub in env.decomposition.subgoals]
    obstacle = env.formula.children[1].child.child  # G[0,H](not obstacle)
    plan = waypoints(path, goals[0], goals[1], env._traj[0][:2].copy())
    total, info = 0.0, {}
    for t in range(env.horizon):
        target = next(p for until, p in plan if t < until)
        state = env._traj[-1]
        q, qd = np.arctan2(state[4:6], state[2:4]), state[6:8]
        error = (ik(target, 1.0 if q[1] >= 0 else -1.0) - q + np.pi) % (2 * np.pi) - np.pi
        _, reward, _, _, info = env.step(np.clip(kp * error - kd * qd, -1.0, 1.0))
        total += reward
    tips = np.stack(env._traj)[:, :2]
    entered = bool((np.linalg.norm(tips - np.asarray(obstacle.center), axis=1) < obstacle.radius).any())
    return info["stl_robustness"], entered, total


def main() -> None:
    from mmpo.robotics.envs.make import make_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["stl_reacher2", "stl_reacher2_inner"])
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    for task in args.tasks:
        env = make_env(task, seed=0).unwrapped
        for path in ("arc", "chord", "none"):
            rows = np.array([episode(env, path, seed) for seed in range(args.episodes)], dtype=np.float64)
            print(f"{task} (distance_scale {env.distance_scale:g}), {path:5s} path: satisfied {np.mean(rows[:, 0] > 0):.2f}, "
                  f"robustness {rows[:, 0].mean():+.4f}, obstacle entered {int(rows[:, 1].sum())}/{args.episodes}, "
                  f"stage return {rows[:, 2].mean():.3f}", flush=True)
        env.close()


if __name__ == "__main__":
    main()
