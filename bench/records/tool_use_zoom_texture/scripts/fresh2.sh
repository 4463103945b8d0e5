#!/bin/bash
# second pre-registered replication, one fresh seed S (10-19): start built as seeds 2-9 (perseed2.sh), start rule
# pick_start2.py, GRPO 100 steps lr 1e-4, test eval (200 items). Run from the repository root with the scripts copied
# into runs/, the venv's python and mmpo on PATH.
S=$1; D=runs/tex/s$S
export OMP_NUM_THREADS=1 PYTHONPATH=.
echo "start $(date -u +%H:%M:%S)"
bash runs/perseed2.sh $S || { echo "perseed2 failed $(date -u +%H:%M:%S)"; exit 1; }
echo "sft done $(date -u +%H:%M:%S)"
START=$(python runs/pick_start2.py $S) || { echo "no start for seed $S: excluded $(date -u +%H:%M:%S)"; exit 0; }
echo "start checkpoint $START"
rm -rf runs/tex/starts/s$S; cp -r $START runs/tex/starts/s$S
nice -n 5 python bench/bench_agents.py run --task zoom_texture --seeds $S --sft-start 'runs/tex/starts/s{seed}' --rl-steps 100 --rl-lr 1e-4 --algos grpo --eval-size 200 --out runs/test_fresh2_grpo100 || { echo "bench failed $(date -u +%H:%M:%S)"; exit 1; }
echo "done $(date -u +%H:%M:%S)"
