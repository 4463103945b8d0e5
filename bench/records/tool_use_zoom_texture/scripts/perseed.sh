#!/bin/bash
# per-seed SFT start: tiny VLM seed S, 200 steps lr 3e-3 constant (data seed S), then 25-step chunks at lr 1e-3 (data seed S+100) until val accuracy >= 0.5
S=$1
mkdir -p runs/tex/s$S
PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 python -c "from mmpo.vlm.factory import build_tiny_vlm, tool_task_corpus; build_tiny_vlm('runs/tex/s$S/base', seed=$S, corpus=tool_task_corpus('zoom_texture', ['image_zoom_in_tool'], vlm=True))" || exit 1
bash runs/sft_chunk.sh $S 200 || exit 1
bash runs/chunks.sh $S runs/tex/s$S/sft200 1e-3 25 300 B $((S+100)) 0.5
