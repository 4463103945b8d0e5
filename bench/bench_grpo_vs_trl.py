"""mmpo's GRPO step against TRL's ``GRPOTrainer`` on the same tiny Qwen2.5-VL, side by side (issue 13), or with
``--kind text`` on the same tiny Qwen3 text LM (issue 38: text prompts of the ``long_arithmetic`` task, no image).

Both sides load the same saved tiny model and processor, train on the same rows (synthetic
``count_shapes`` prompts with one image each, the same system prompt and rewards: accuracy 0.9 +
format 0.1), 2 prompts x G = 8 completions per step, completions forced to exactly ``--tokens``
tokens (``min_new_tokens`` = ``max_new_tokens``), beta 0, one optimizer step per batch, lr 1e-5,
clip 0.2, token-mean loss (TRL's ``dapo``). Each run is its own subprocess with one thread
(OMP/MKL 1, ``torch.set_num_threads(1)``); the runs are interleaved A B B A ... per round.

Per run: wall and CPU seconds of each step after ``--warmup`` steps (CPU: the process, plus mmpo's reward
worker process), the share of the step spent decoding (inside ``model.generate``, or mmpo's lean decoding loop
``HFGenerateEngine._lean_decode``; mmpo's one prefill per prompt is outside both), completion tokens per second, and
peak RSS (VmHWM; mmpo's reward worker separately). Printed: medians over steps, then the median
over rounds, and the ratio mmpo / TRL. A parity run prints TRL's ``compute_loss`` and mmpo's loss and
gradients on one fixed batch (so speed is never bought with a different loss).

TRL is optional (``pip install -e .[bench]`` or a separate target dir):

    python bench/bench_grpo_vs_trl.py --tokens 32 128 --rounds 3 --trl-path PATH/TO/trl_pkgs
    python bench/bench_grpo_vs_trl.py --kind text --tokens 32 128 --rounds 3 --trl-path PATH/TO/trl_pkgs

``--trl-path`` is put on PYTHONPATH of the TRL and parity subprocesses only.
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

from mmpo.files import atomic_write_json
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig

REPO = Path(__file__).resolve().parents[1]
G = 8
PROMPTS = 2
LR = 1e-5
CLIP = 0.2
REWARD_WEIGHTS = {"accuracy": 0.9, "format": 0.1}
TASK = {"vlm": "count_shapes", "text": "long_arithmetic"}


# ----------------------------------------------------------------------------- shared by both workers


def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def _rows(steps: int, kind: str = "vlm") -> list[dict]:
    from mmpo.data.synthetic import make_items

    return make_items(TASK[kind], PROMPTS * steps, seed=0)


def _vm_hwm_kib(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _cpu_s_of(pid: int | None) -> float:
    """utime + stime of another process (mmpo's reward worker), from /proc; 0 when none runs."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StepClock:
    """Wall / CPU seconds per step and seconds inside the decoders: ``model.generate`` and the other methods
    named in ``decoders`` ((object, method name) pairs: mmpo's lean decoding loop), wrapped on the instances."""

    def __init__(self, model, extra_cpu=lambda: 0.0, decoders=()) -> None:
        self.steps: list[dict] = []
        self._extra_cpu = extra_cpu
        self._gen = 0.0
        for owner, name in [(model, "generate"), *decoders]:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, decode):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return decode(*args, **kwargs)
            finally:
                self._gen += time.perf_counter() - start

        return timed

    def begin(self) -> None:
        self._gen = 0.0
        self._t = (time.perf_counter(), time.process_time() + self._extra_cpu())

    def end(self) -> None:
        wall = time.perf_counter() - self._t[0]
        cpu = time.process_time() + self._extra_cpu() - self._t[1]
        self.steps.append({"wall_s": wall, "cpu_s": cpu, "generate_s": self._gen})


def _summary(clock: StepClock, warmup: int, tokens: int, extra: dict) -> dict:
    timed = clock.steps[warmup:]
    med = {key: statistics.median(s[key] for s in timed) for key in ("wall_s", "cpu_s", "generate_s")}
    return {**med, "generation_share": med["generate_s"] / med["wall_s"],
            "tokens_per_s": PROMPTS * G * tokens / med["wall_s"], "vm_hwm_mib": _vm_hwm_kib() / 1024,
            "steps": clock.steps, **extra}


# ----------------------------------------------------------------------------- mmpo


def run_mmpo(model_dir: str, tokens: int, steps: int, warmup: int, kind: str = "vlm") -> dict:
    _single_thread()
    import lightning as L
    from torch.utils.data import DataLoader

    from mmpo.algos.grpo import GRPOModule
    from mmpo.rewards.worker import get_reward_worker

    module = GRPOModule(model_dir, sampling=SamplingConfig(num_generations=G, max_new_tokens=tokens, temperature=1.0),
                        optim=OptimConfig(lr=LR, mu=1),
                        loss=LossConfig(beta=0.0, name="ppo", clip_low=CLIP, clip_high=CLIP, agg="token-mean"),
                        rewards=RewardConfig(weights=REWARD_WEIGHTS))
    module.model.generation_config.min_new_tokens = tokens  # forced equal lengths (as TRL's side)
    worker = get_reward_worker()
    clock = StepClock(module.model, extra_cpu=lambda: _cpu_s_of(worker.pid),
                      decoders=[(module.engine, "_lean_decode")])

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            clock.begin()

        def on_train_batch_end(self, *args):
            clock.end()

    rows = _rows(steps, kind)
    batches = [rows[i : i + PROMPTS] for i in range(0, len(rows), PROMPTS)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock()])
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda x: x))
    lengths = module.last_metrics.get("response/length_mean")
    worker_hwm = _vm_hwm_kib(worker.pid) / 1024 if worker.pid else 0.0
    return _summary(clock, warmup, tokens, {"length_mean": lengths, "reward_worker_vm_hwm_mib": worker_hwm,
                                            "vision_cut_frac": module.last_metrics.get("response/vision_cut_frac")})


# ----------------------------------------------------------------------------- TRL


def _trl_reward(name: str):
    from mmpo.rewards.builtin import accuracy_reward, format_reward

    fn = {"accuracy": accuracy_reward, "format": format_reward}[name]

    def reward(prompts, completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return fn(texts, [{"answer": a} for a in answer]).tolist()

    reward.__name__ = name
    return reward


def _trl_dataset(rows: list[dict]):
    from datasets import Dataset

    from mmpo.data import SYSTEM_PROMPT

    if not rows[0].get("images"):  # text: TRL's conversational prompts with plain-string contents
        return Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": row["problem"]}],
                                   "answer": row["answer"]} for row in rows])
    return Dataset.from_list([{
        "prompt": [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                   {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["problem"]}]}],
        "image": row["images"][0], "answer": row["answer"],
    } for row in rows])


def _trl_trainer(model_dir: str, tokens: int, steps: int, out_dir: str, rows: list[dict]):
    from trl import GRPOConfig, GRPOTrainer

    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(model_dir)
    if not hasattr(processor, "image_processor"):  # a text LM: TRL takes its tokenizer
        processor = getattr(processor, "tokenizer", processor)
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PROMPTS * G, num_generations=G, gradient_accumulation_steps=1,
        max_completion_length=tokens, generation_kwargs={"min_new_tokens": tokens}, temperature=1.0, beta=0.0,
        learning_rate=LR, epsilon=CLIP, loss_type="dapo", num_iterations=1, max_steps=steps, logging_steps=10,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, shuffle_dataset=False,
        reward_weights=[REWARD_WEIGHTS["accuracy"], REWARD_WEIGHTS["format"]], disable_tqdm=True,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL defaults to True; mmpo does not checkpoint: like for like
    )
    return GRPOTrainer(model=model, processing_class=processor, args=config, train_dataset=_trl_dataset(rows),
                       reward_funcs=[_trl_reward("accuracy"), _trl_reward("format")])


def run_trl(model_dir: str, tokens: int, steps: int, warmup: int, kind: str = "vlm") -> dict:
    _single_thread()
    from transformers import TrainerCallback

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trl_trainer(model_dir, tokens, steps, out_dir, _rows(steps, kind))
        clock = StepClock(trainer.model)

        class Clock(TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                clock.begin()

            def on_step_end(self, *args, **kwargs):
                clock.end()

        trainer.add_callback(Clock())
        trainer.train()
        logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
        length = logged[-1]["completions/mean_length"] if logged else None
        return _summary(clock, warmup, tokens, {"length_mean": length})


# ----------------------------------------------------------------------------- loss parity


def run_parity(model_dir: str, tokens: int, kind: str = "vlm") -> dict:
    """TRL's ``compute_loss`` and mmpo's loss (the trainer's own parts: ``sequence_log_probs`` +
    core ``policy_loss``, on-policy) and their gradients, on one fixed mmpo rollout."""
    _single_thread()
    import torch

    from mmpo.algos.grpo import GRPOModule
    from mmpo.core import compute_advantages_with_metrics, policy_loss

    rows = _rows(1, kind)
    module = GRPOModule(model_dir, sampling=SamplingConfig(num_generations=G, max_new_tokens=tokens),
                        loss=LossConfig(beta=0.0, clip_low=CLIP, clip_high=CLIP, agg="token-mean"),
                        optim=OptimConfig(lr=LR))
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    rewards = torch.linspace(0.0, 1.0, len(rollout))  # fixed, distinct rewards: non-zero advantages
    advantages, _ = compute_advantages_with_metrics("grpo", rewards, rollout.group_ids, eps=1e-4)  # TRL's eps
    module.model.train()
    log_probs, _ = module.sequence_log_probs(module.model, rollout)
    mask = rollout.completion_mask.float()
    ours, _ = policy_loss("ppo", log_probs, log_probs.detach(), advantages, mask, agg="token-mean",
                          clip_low=CLIP, clip_high=CLIP)
    ours.backward()
    ours_grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.grad is not None}

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trl_trainer(model_dir, tokens, 1, out_dir, rows)
        prompts = rollout.prompt_inputs
        inputs = {
            "prompt_ids": prompts["input_ids"], "prompt_mask": prompts["attention_mask"],
            "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
            "advantages": advantages, "old_per_token_logps": None,
            "num_items_in_batch": rollout.completion_mask.sum(),
        }
        if "pixel_values" in prompts:
            inputs.update({
                "pixel_values": prompts["pixel_values"], "image_grid_thw": prompts["image_grid_thw"],
                "num_images": prompts["image_counts"].tolist(),
                "mm_token_type_ids": torch.cat([prompts["mm_token_type_ids"],
                                                torch.zeros_like(rollout.completion_ids)], 1),
            })
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one step, no accumulation
        theirs = trainer.compute_loss(trainer.model, inputs)
        theirs.backward()
        their_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    worst = max(float((ours_grads[n] - their_grads[n]).abs().max() / their_grads[n].abs().max().clamp(min=1e-12))
                for n in their_grads)
    ours, theirs = float(ours.detach()), float(theirs.detach())
    return {"mmpo_loss": ours, "trl_loss": theirs, "loss_abs_diff": abs(ours - theirs),
            "max_rel_grad_diff": worst, "params_compared": len(their_grads),
            "completion_tokens": int(rollout.completion_mask.sum())}


# ----------------------------------------------------------------------------- driver


def _spawn(side: str, model_dir: str, tokens: int, steps: int, warmup: int, trl_path: str | None,
           kind: str = "vlm") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    paths = [str(REPO)] + ([trl_path] if trl_path and side in ("trl", "parity") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, __file__, "--worker", side, "--model", model_dir,
                               "--tokens", str(tokens), "--steps", str(steps), "--warmup", str(warmup),
                               "--kind", kind, "--out", out.name], env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{side} run failed:\n{done.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def _build_model(root: Path, kind: str = "vlm") -> str:
    from mmpo.vlm.factory import build_tiny_text_lm, build_tiny_vlm

    build = build_tiny_text_lm if kind == "text" else build_tiny_vlm
    return str(build(root / "tiny", seed=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--kind", choices=["vlm", "text"], default="vlm",
                        help="vlm: the tiny Qwen2.5-VL on image prompts; text: the tiny Qwen3 text LM on text prompts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (ABBA order), >= 1")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--trl-path", default=None, help="a directory holding trl (added to the TRL runs' path)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--worker", choices=["mmpo", "trl", "parity"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        tokens = args.tokens[0]
        result = (run_parity(args.model, tokens, args.kind) if args.worker == "parity" else
                  {"mmpo": run_mmpo, "trl": run_trl}[args.worker](args.model, tokens, args.steps, args.warmup,
                                                                  args.kind))
        atomic_write_json(args.out, result, indent=None)
        return 0
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    print(f"load average {os.getloadavg()}, python {sys.version.split()[0]}", flush=True)
    record: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _build_model(Path(tmp), args.kind)
        for tokens in args.tokens:
            parity = _spawn("parity", model_dir, tokens, 1, 0, args.trl_path, args.kind)
            print(f"[{tokens} tokens] parity: mmpo loss {parity['mmpo_loss']:.9f}  TRL loss {parity['trl_loss']:.9f}  "
                  f"|diff| {parity['loss_abs_diff']:.1e}  max rel grad diff {parity['max_rel_grad_diff']:.1e} "
                  f"({parity['params_compared']} tensors)", flush=True)
            runs = {"mmpo": [], "trl": []}
            for round_ in range(args.rounds):
                order = ("mmpo", "trl") if round_ % 2 == 0 else ("trl", "mmpo")  # A B | B A | A B ...
                for side in order:
                    result = _spawn(side, model_dir, tokens, args.steps, args.warmup, args.trl_path, args.kind)
                    runs[side].append(result)
                    print(f"[{tokens} tokens] round {round_} {side:4s}: {result['wall_s']:.3f} s/step wall, "
                          f"{result['cpu_s']:.3f} CPU-s, generate {result['generation_share']:.0%}, "
                          f"length {result['length_mean']}, VmHWM {result['vm_hwm_mib']:.0f} MiB", flush=True)
            record["runs"][tokens] = {"parity": parity, **runs}
            med = {side: {key: statistics.median(r[key] for r in runs[side])
                          for key in ("wall_s", "cpu_s", "generation_share", "tokens_per_s", "vm_hwm_mib")}
                   for side in runs}
            worker = statistics.median(r["reward_worker_vm_hwm_mib"] for r in runs["mmpo"])
            print(f"\n| {tokens} tokens | mmpo | TRL | mmpo / TRL |\n|---|---|---|---|")
            for key, label in (("wall_s", "s / step (wall)"), ("cpu_s", "CPU-s / step"),
                               ("generation_share", "generation share"), ("tokens_per_s", "completion tokens / s"),
                               ("vm_hwm_mib", "peak RSS VmHWM (MiB)")):
                a, b = med["mmpo"][key], med["trl"][key]
                print(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
            print(f"(mmpo's reward worker process: VmHWM {worker:.0f} MiB, not in the row above; mmpo's processes "
                  f"together {med['mmpo']['vm_hwm_mib'] + worker:.0f} MiB vs TRL's "
                  f"{med['trl']['vm_hwm_mib']:.0f} MiB)\n", flush=True)
    if args.json:
        atomic_write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
