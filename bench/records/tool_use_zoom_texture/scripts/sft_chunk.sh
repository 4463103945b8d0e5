#!/bin/bash
# usage: sft_chunk.sh SEED STEPS [RESUME]  -> runs/tex/s$SEED/sft$STEPS (constant lr 3e-3 after a 20-step warm-up)
SEED=$1; STEPS=$2; RESUME=$3
D=runs/tex/s$SEED
EXTRA=()
if [ -n "$RESUME" ]; then EXTRA=(--ckpt_path $D/ckpt/last.ckpt); fi
PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 mmpo fit -c configs/agent/zoom_sft_tiny.yaml \
  --seed_everything=$SEED --trainer.max_steps=$STEPS --trainer.limit_val_batches=0 --trainer.enable_progress_bar=false \
  --trainer.log_every_n_steps=10 --model.init_args.optim.lr_schedule=constant \
  --model.init_args.model_path=$D/base --model.init_args.output_dir=$D/sft$STEPS \
  '--data.init_args.tasks=[zoom_texture]' --data.init_args.seed=$SEED --data.init_args.train_size=4000 \
  --trainer.default_root_dir=$D/sft_run --trainer.logger.init_args.save_dir=$D/sft_run \
  --trainer.callbacks.init_args.dirpath=$D/ckpt --trainer.callbacks.init_args.every_n_train_steps=50 "${EXTRA[@]}"
