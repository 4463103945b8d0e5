#!/bin/bash
# usage: chunks.sh SEED FROM_HF LR CHUNK MAXSTEPS TAG DATASEED -> runs/tex/s$SEED/$TAG_$steps, val eval (50 items) after each chunk
SEED=$1; FROM=$2; LR=$3; CHUNK=$4; MAX=$5; TAG=$6; DSEED=$7; THRESH=${8:-0.8}
D=runs/tex/s$SEED
for ((steps=CHUNK; steps<=MAX; steps+=CHUNK)); do
  EXTRA=()
  if [ $steps -gt $CHUNK ]; then EXTRA=(--ckpt_path $D/ckpt_$TAG/last.ckpt); fi
  PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 mmpo fit -c configs/agent/zoom_sft_tiny.yaml \
    --seed_everything=$SEED --trainer.max_steps=$steps --trainer.limit_val_batches=0 --trainer.enable_progress_bar=false \
    --trainer.log_every_n_steps=5 --model.init_args.optim.lr_schedule=constant --model.init_args.optim.lr=$LR \
    --model.init_args.model_path=$FROM --model.init_args.output_dir=$D/${TAG}_$steps \
    '--data.init_args.tasks=[zoom_texture]' --data.init_args.seed=$DSEED --data.init_args.train_size=4000 \
    --trainer.default_root_dir=$D/${TAG}_run --trainer.logger.init_args.save_dir=$D/${TAG}_run \
    --trainer.callbacks.init_args.dirpath=$D/ckpt_$TAG --trainer.callbacks.init_args.every_n_train_steps=$CHUNK "${EXTRA[@]}" > $D/${TAG}_fit_$steps.log 2>&1 || exit 1
  PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 python runs/val_eval.py $D/${TAG}_$steps 50 2>/dev/null | tail -1 >> $D/${TAG}_val.txt
  ACC=$(tail -1 $D/${TAG}_val.txt | sed "s/.*accuracy with tool \([0-9.]*\).*/\1/"); if python3 -c "import sys; sys.exit(0 if $ACC >= $THRESH else 1)"; then exit 0; fi
done
