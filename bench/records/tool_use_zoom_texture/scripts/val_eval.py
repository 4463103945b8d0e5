import sys, json
from pathlib import Path
sys.path.insert(0, "bench")
import bench_agents as b
ck = Path(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 50
r = b._evaluate(ck, "zoom_texture", ["image_zoom_in_tool"], n, 64, ck.parent / f"val_{ck.name}_{n}", split="val")
print(ck, "val accuracy with tool", r["accuracy"], {k: r.get(k) for k in ("tool_call_rate", "turns_per_answer")})
json.dump(r, open(ck.parent / f"val_{ck.name}_{n}.json", "w"))
