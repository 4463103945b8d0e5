"""Multi-turn vs single-turn rollout cost at the same generated tokens (issue 39: at most 1.3x).

Side ``multi``: :class:`mmpo.vlm.multiturn.MultiTurnEngine` (``--schedule continuous``, the default: continuous
batching across turns; ``turns``: the turn-synchronous schedule with the KV cache kept across turns) runs
``--turns`` model turns per trajectory; a scripted environment answers every turn but the last with a short tool
message (``result k``), so the later turns also prefill the environment's tokens, the cost multi-turn adds. A turn ends at the model's
end-of-turn token (its logit raised by ``--eos-bias`` so turns are short; a turn cut by ``--tokens-per-turn``
would end the trajectory). Each rollout starts from the same seed, so every repeat draws the same tokens.
Side ``single``: the same engine's one-turn :meth:`~mmpo.vlm.rollout.HFGenerateEngine.generate` with the
end-of-turn token suppressed and ``max_new_tokens`` = the multi side's model tokens per trajectory (measured by a
probe run first), so both sides generate the same number of model tokens up to rounding (both counts recorded);
the ratios are per rollout and per generated token. Each side also counts its decoder forwards per rollout (the
prefills and the decode steps, each over the batch's active rows): with the turn-synchronous schedule the batch
decodes each turn until its longest turn ends, so a rollout of several turns runs more sequential steps than one turn
of the same tokens; continuous batching runs 1 + the longest trajectory's model tokens.

Each side runs in its own subprocess on the same tiny text LM (``build_tiny_text_lm``, built once), one torch
thread, ``--repeats`` timed rollouts after one warm-up; the sides alternate A B B A over ``--rounds`` rounds. The
ratio multi / single is reported per round and as the median, for wall and CPU seconds per rollout.

    python bench/bench_multiturn_cost.py --rounds 3 --out bench/records/multiturn_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class ScriptedToolEnvironment:
    """Answers each model turn with one tool message ``result k`` until ``answers`` turns were answered; the next
    turn ends the episode."""

    tools: list = []

    def __init__(self, answers: int) -> None:
        self.answers, self.steps = answers, 0

    def reset(self, row: dict[str, Any]) -> str:
        self.steps = 0
        return row["problem"]

    def step(self, assistant_message: str):
        from mmpo.tools.env import StepResult

        self.steps += 1
        if self.steps > self.answers:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"result {self.steps}"}], reward=0.0, info={"tool_calls": 1})


def ratio_summary(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per-round multi / single ratios of wall and CPU seconds per rollout and per generated token, and their medians."""
    out: dict[str, Any] = {}
    for key in ("wall_s", "cpu_s"):
        ratios = [r["multi"][key] / r["single"][key] for r in rounds]
        out[key] = {"per_round": ratios, "median": statistics.median(ratios)}
        per_token = [(r["multi"][key] / r["multi"]["generated_tokens"]) / (r["single"][key] / r["single"]["generated_tokens"])
                     for r in rounds]
        out[f"{key}_per_token"] = {"per_round": per_token, "median": statistics.median(per_token)}
    return out


def _side(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.multiturn import MultiTurnEngine
    from mmpo.vlm.rollout import HFGenerateEngine

    torch.set_num_threads(1)
    model, processor = load_vlm(args.model)
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        # multi: short turns that end themselves; single: one turn that runs its whole budget
        biased.bias[model.generation_config.eos_token_id] = args.eos_bias if args.side == "multi" else -40.0
    model.lm_head = biased
    model.eval()
    engine = HFGenerateEngine(model, processor)
    rows = make_items("long_arithmetic", args.prompts, seed=0)
    multi = MultiTurnEngine(engine, max_turns=args.turns, max_total_tokens=10 * args.turns * args.tokens_per_turn,
                            max_tokens_per_turn=args.tokens_per_turn, keep_cache=True, schedule=args.schedule)

    def rollout():
        if args.side == "multi":
            envs = [ScriptedToolEnvironment(args.turns - 1) for _ in range(args.prompts * args.samples)]
            return multi.generate(rows, envs, num_samples=args.samples)
        return engine.generate(rows, num_samples=args.samples, max_new_tokens=args.single_tokens)

    forwards = [0]  # decoder forwards (a prefill or one decode step of the batch's active rows each)
    # on the first decoder layer: the lean decode loop runs the layers itself, not the decoder module
    model.model.layers[0].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    with torch.no_grad():
        torch.manual_seed(0)
        warm = rollout()  # warm-up
        warm_forwards, forwards[0] = forwards[0], 0
        walls, cpus, generated = [], [], int(warm.completion_mask.sum())
        turns = float(warm.extras["turns"].float().mean()) if "turns" in warm.extras else 1.0
        longest = int(warm.completion_mask.sum(-1).max())  # model tokens of the longest trajectory
        for _ in range(args.repeats):
            torch.manual_seed(0)
            wall, cpu = time.perf_counter(), time.process_time()
            result = rollout()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            generated = int(result.completion_mask.sum())
    if not walls:  # the probe: how many model tokens the multi side generates
        return {"generated_tokens": generated, "trajectories": len(warm), "turns_mean": turns,
                "decoder_forwards": warm_forwards, "longest_trajectory_tokens": longest}
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "generated_tokens": generated,
            "turns_mean": turns, "decoder_forwards": forwards[0] / len(walls), "longest_trajectory_tokens": longest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per side per round (median)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=64, help="a model turn's token cap")
    parser.add_argument("--eos-bias", type=float, default=2.0, help="logit bias of the end-of-turn token (multi)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt (G)")
    parser.add_argument("--schedule", choices=("continuous", "turns"), default="continuous",
                        help="the multi side's MultiTurnEngine schedule")
    parser.add_argument("--out", default=None, help="JSON record to write")
    parser.add_argument("--side", choices=("multi", "single"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--single-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(_side(args)))
        return 0
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_text_lm

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_text_lm(Path(tmp) / "model", corpus=corpus(["long_arithmetic"], n=50), vocab_size=400)
        common = [f"--{k}={v}" for k, v in (("turns", args.turns), ("tokens-per-turn", args.tokens_per_turn),
                                              ("prompts", args.prompts), ("samples", args.samples),
                                              ("eos-bias", args.eos_bias), ("schedule", args.schedule),
                                              ("model", model))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

        def run(side: str, repeats: int, single_tokens: int = 0) -> dict[str, float]:
            done = subprocess.run([sys.executable, __file__, f"--side={side}", f"--repeats={repeats}",
                                   f"--single-tokens={single_tokens}", *common], env=env, check=True,
                                  capture_output=True, text=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        probe = run("multi", 0)
        single_tokens = max(1, round(probe["generated_tokens"] / probe["trajectories"]))
        print(f"multi side: {probe['generated_tokens']} model tokens over {probe['trajectories']} trajectories, "
              f"{probe['turns_mean']:.2f} turns each; single side: {single_tokens} tokens per trajectory", flush=True)
        rounds = []
        for index in range(args.rounds):
            order = ("multi", "single", "single", "multi") if index % 2 == 0 else ("single", "multi", "multi", "single")
            runs: dict[str, list[dict[str, float]]] = {"multi": [], "single": []}
            for side in order:
                runs[side].append(run(side, args.repeats, single_tokens))
            rounds.append({side: {key: statistics.mean(r[key] for r in results) for key in results[0]}
                           for side, results in runs.items()})
            print(f"round {index}: " + ", ".join(f"{side} {v['wall_s']:.3f} s wall / {v['cpu_s']:.3f} s CPU "
                                                 f"({v['generated_tokens']:.0f} tokens, {v['decoder_forwards']:.0f} decoder forwards)"
                                                 for side, v in rounds[-1].items()),
                  flush=True)
    summary = {"settings": {k: v for k, v in vars(args).items() if k not in ("side", "model", "out", "single_tokens")},
               "probe": probe, "single_tokens_per_trajectory": single_tokens,
               "load_average": os.getloadavg(), "rounds": rounds, "ratio": ratio_summary(rounds)}
    r = summary["ratio"]
    print(f"multi / single: per rollout wall {r['wall_s']['median']:.2f}x, CPU {r['cpu_s']['median']:.2f}x; per "
          f"generated token wall {r['wall_s_per_token']['median']:.2f}x, CPU {r['cpu_s_per_token']['median']:.2f}x "
          "(medians over rounds; goal <= 1.3x)")
    if args.out:
        from mmpo.files import atomic_write_json

        atomic_write_json(Path(args.out), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
