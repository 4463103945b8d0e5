"""Per-seed numbers and paired contrasts over per-seed results.json files (bench_agents.py run), e.g.
python scripts/aggregate.py test_fresh_grpo100_lr1e-4_s*.json  (run from bench/records/tool_use_zoom_texture)."""
import json, sys
from mmpo.eval.stats import format_interval, mean_std, paired_difference

runs = [json.load(open(p)) for p in sys.argv[1:]]
runs.sort(key=lambda r: r["seed"])
print("| seed | SFT start with the tool | GRPO with the tool | GRPO without the tool | GRPO - SFT | "
      "tool-call rate / calls / turns per answer (GRPO) | training tool calls / trajectory | batch accuracy, first / last 10 steps |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in runs:
    e = r["eval"]; g = e["grpo/with_tools"]; b = r["training"]["grpo"]["batch_accuracy"]
    print(f"| {r['seed']} | {e['sft/with_tools']['accuracy']:.3f} | {g['accuracy']:.3f} | {e['grpo/without_tools']['accuracy']:.3f} | "
          f"{g['accuracy'] - e['sft/with_tools']['accuracy']:+.3f} | {g['tool_call_rate']:.3f} / {g['tool_calls_per_answer']:.3f} / "
          f"{g['turns_per_answer']:.3f} | {r['training_tool_calls']['grpo']:.3f} | {sum(b[:10]) / 10:.2f} / {sum(b[-10:]) / 10:.2f} |")
for key in ("sft/with_tools", "grpo/with_tools", "grpo/without_tools"):
    print(key, mean_std([r["eval"][key]["accuracy"] for r in runs]))
for key in ("sft/with_tools", "grpo/with_tools"):
    print(key, "calls / answer", mean_std([r["eval"][key]["tool_calls_per_answer"] for r in runs]),
          "turns / answer", mean_std([r["eval"][key]["turns_per_answer"] for r in runs]),
          "tool-call rate", mean_std([r["eval"][key]["tool_call_rate"] for r in runs]))
print()
print(f"| contrast (paired by item), seeds {[r['seed'] for r in runs]} | estimate | 95% bootstrap (seeds x items) | 95% seed-t |")
print("| --- | --- | --- | --- |")
for label, a, b in (("GRPO with the tool - SFT start with the tool", "grpo/with_tools", "sft/with_tools"),
                    ("GRPO with the tool - GRPO without the tool", "grpo/with_tools", "grpo/without_tools"),
                    ("GRPO with the tool - chance (0.25)", "grpo/with_tools", None),
                    ("SFT start with the tool - chance (0.25)", "sft/with_tools", None)):
    xs = [r["eval"][a]["correct"] for r in runs]
    ys = [r["eval"][b]["correct"] if b else [0.25] * len(x) for r, x in zip(runs, xs)]
    d = paired_difference(xs, ys)
    print(f"| {label} | {d['estimate']:+.3f} | {format_interval(d['bootstrap'])} | {format_interval(d['seed_t'])} |")
