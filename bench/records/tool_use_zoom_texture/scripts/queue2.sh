#!/bin/bash
# one of two workers: claims the next unclaimed seed of 10-19 (mkdir is atomic) and runs fresh2.sh on it
for S in 10 11 12 13 14 15 16 17 18 19; do
  mkdir runs/claims/s$S 2>/dev/null || continue
  bash runs/fresh2.sh $S > runs/logs/fresh2_$S.log 2>&1
done
