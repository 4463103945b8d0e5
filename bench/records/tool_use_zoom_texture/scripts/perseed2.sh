#!/bin/bash
# per-seed SFT start, seeds 2-4: tiny VLM seed S; 50-step chunks at lr 3e-3 constant (data seed S, resumed) to 200 steps,
# each evaluated on 50 val items; stop at val >= 0.8; if still below at 200: 25-step chunks at lr 1e-3 from sft200
# (data seed S+100) until val >= 0.5. Start = the last checkpoint with val accuracy in [0.2, 0.8].
S=$1; D=runs/tex/s$S
mkdir -p $D
PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 python -c "from mmpo.vlm.factory import build_tiny_vlm, tool_task_corpus; build_tiny_vlm('$D/base', seed=$S, corpus=tool_task_corpus('zoom_texture', ['image_zoom_in_tool'], vlm=True))" || exit 1
for steps in 50 100 150 200; do
  R=resume; [ $steps = 50 ] && R=
  bash runs/sft_chunk.sh $S $steps $R > $D/sft_fit_$steps.log 2>&1 || exit 1
  PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 python runs/val_eval.py $D/sft$steps 50 2>/dev/null | tail -1 >> $D/sft_val.txt
  ACC=$(tail -1 $D/sft_val.txt | sed "s/.*accuracy with tool \([0-9.]*\).*/\1/")
  if python3 -c "import sys; sys.exit(0 if $ACC >= 0.8 else 1)"; then exit 0; fi
done
bash runs/chunks.sh $S $D/sft200 1e-3 25 300 B $((S+100)) 0.5
