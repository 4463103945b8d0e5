"""The start rule: the last checkpoint (in training order) with validation accuracy in [0.2, 0.8]; exit 1 if none."""
import re, sys
from pathlib import Path
d = Path(f"runs/tex/s{sys.argv[1]}")
rows = []
for name in ("sft_val.txt", "B_val.txt"):
    p = d / name
    if p.exists():
        for line in p.read_text().splitlines():
            m = re.match(r"(\S+) val accuracy with tool ([0-9.]+)", line)
            if m:
                rows.append((m.group(1), float(m.group(2))))
ok = [ck for ck, acc in rows if 0.2 <= acc <= 0.8]
print(rows, file=sys.stderr)
if not ok:
    sys.exit(1)
print(ok[-1])
