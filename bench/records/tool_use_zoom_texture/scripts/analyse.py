import json, re, sys, glob
out = sys.argv[1]
for seed_dir in sorted(glob.glob(f"{out}/zoom_texture/s*")):
    line = [seed_dir.split("/")[-1]]
    for ck in ("sft", "grpo"):
        p = f"{seed_dir}/eval/{ck}/with_tools/predictions/synth_zoom_texture.jsonl"
        rows = [json.loads(l) for l in open(p)]
        box_ok = read_ok = 0; answers = {}
        for r in rows:
            cell = re.search(r"cell (\[[^\]]*\])", r["prompt"]).group(1)
            call = r["messages"][0][1]["content"]
            m = re.search(r'"bbox_2d": (\[[^\]]*\])', call)
            ok = bool(m) and json.loads(m.group(1)) == json.loads(cell)
            box_ok += ok; read_ok += ok and r["correct"][0]
            a = r["extracted"][0]; answers[a] = answers.get(a, 0) + 1
        line.append(f"{ck}: box exact {box_ok}/{len(rows)}, right given the box {read_ok}/{box_ok}, right given a wrong box {sum(r['correct'][0] for r in rows) - read_ok}/{len(rows) - box_ok}")
    print(" | ".join(line))
