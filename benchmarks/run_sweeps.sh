#!/bin/bash
# The sweeps behind docs/RESULTS.md "Experiments", in the order they were run
# (most important figures first): bench1 and maxbatch side by side, then bench2.
# Every bench step adds to the same results.json (--resume skips runs already there),
# so an interrupted sweep loses little.
# One intra-op thread: the 2-core machine is shared, and with 2 OpenMP threads per
# process competing with other jobs a ResNet-152 step ran 2-10x slower than with 1.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=.venv/bin/python
R="$PY -m remat.cli"
BERT="--model bert --budgets 0.5,0.3,min --baselines hf,sequential --pairs 3 --out docs/bench/bert --resume"
RESNET="--model resnet152 --budgets 0.5,0.3,min --baselines hf,sequential --pairs 3 --out docs/bench/resnet152 --resume"
# After batch 2: no "min" for ResNet-152 (its plan there ran 40x slower than eager; see RESULTS.md)
RESNET_NOMIN="--model resnet152 --budgets 0.5,0.3 --baselines hf,sequential --pairs 3 --out docs/bench/resnet152 --resume"
# remat planned at a baseline's measured peak (equal memory), and at a reachable fraction
RESNET_EQ="--model resnet152 --budgets =sequential,0.7 --baselines none --pairs 3 --out docs/bench/resnet152 --resume"
BERT_EQ="--model bert --budgets =sequential --baselines none --pairs 3 --out docs/bench/bert --resume"
case "${1:-all}" in
  all|bench1)
    $R bench $BERT --batch-sizes 4,8
    $R bench $RESNET --batch-sizes 2   # batch 4 was stopped in its remat@min set-up
    $R bench $RESNET_NOMIN --batch-sizes 4 ;;&
  all|maxbatch)   # ran beside bench1
    $R maxbatch --model bert --cap 2.5GiB --start 2 --max-batch 64 --out docs/bench/bert
    $R maxbatch --model resnet152 --cap 2.25GiB --start 2 --max-batch 64 --out docs/bench/resnet152 ;;&
  all|bench2)
    $R bench $RESNET_NOMIN --batch-sizes 4
    $R bench $RESNET_EQ --batch-sizes 2,4
    $R bench $BERT_EQ --batch-sizes 8
    $R bench $RESNET_NOMIN --batch-sizes 8
    $R bench $BERT --batch-sizes 16
    $R bench $RESNET_EQ --batch-sizes 8
    $R bench $BERT_EQ --batch-sizes 16
    $R bench $RESNET_NOMIN --batch-sizes 16
    $R bench $BERT --batch-sizes 32
    $R bench --model bert --budgets 0.5 --baselines compile --pairs 3 --out docs/bench/bert --resume --batch-sizes 4
    $R bench --model resnet152 --budgets 0.5 --baselines compile --pairs 3 --out docs/bench/resnet152 --resume --batch-sizes 2 ;;
esac
