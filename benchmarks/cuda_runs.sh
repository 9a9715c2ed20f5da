#!/bin/bash
# CUDA figures, for a machine with a GPU: `remat run --check` (bitwise against eager, or
# within tolerance with Inductor regions; allocated and reserved peaks, time ratio) on
# BERT-base and ResNet-152, then `remat bench` sweeps against the usual checkpointing
# baselines. The run and alloc sections take about 6 minutes on an H100, the bench 3.
#   benchmarks/cuda_runs.sh OUTDIR [run|alloc|graph|bench|all]
# Uses the `python3` on PATH with remat importable from this checkout (PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: cuda_runs.sh OUTDIR [run|alloc|graph|bench|all]}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
R="python3 -m remat.cli"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt"
run() {  # name, then remat run arguments
  local name=$1; shift
  $R run --device cuda --check --json --pairs 10 "$@" >"$out/run-$name.json" 2>"$out/run-$name.err"
  echo "run $name: exit $?"
}
case "${2:-all}" in
  all|run)
    run bert-b8-none --model bert --batch-size 8 --budget none
    run bert-b8-0.6 --model bert --batch-size 8 --budget 0.6
    run bert-b8-0.6-adamw-det --model bert --batch-size 8 --budget 0.6 --optimizer adamw --deterministic
    run bert-b32-none --model bert --batch-size 32 --budget none
    run bert-b32-none-det --model bert --batch-size 32 --budget none --deterministic
    run bert-b32-0.5-det --model bert --batch-size 32 --budget 0.5 --deterministic
    run resnet152-b4-0.6 --model resnet152 --batch-size 4 --budget 0.6 --deterministic
    run resnet152-b8-0.6 --model resnet152 --batch-size 8 --budget 0.6 --deterministic
    run bert-b8-0.33-inductor --model bert --batch-size 8 --budget 0.33 --backend inductor --pairs 5 ;;&
  all|graph)   # the step replayed as one CUDA graph
    run resnet152-b8-0.6-graph --model resnet152 --batch-size 8 --budget 0.6 --deterministic --cuda-graph
    run bert-b8-0.6-graph --model bert --batch-size 8 --budget 0.6 --deterministic --cuda-graph
    run bert-b32-0.5-graph --model bert --batch-size 32 --budget 0.5 --deterministic --cuda-graph ;;&
  all|alloc)   # the caching allocator's reserved peak with expandable segments (less fragmentation)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run bert-b8-none-expandable --model bert --batch-size 8 --budget none
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run bert-b8-0.6-expandable --model bert --batch-size 8 --budget 0.6 ;;&
  all|bench)
    $R bench --device cuda --model bert --batch-sizes 8,32 --budgets 0.5,min --baselines hf,sequential --pairs 5 --out "$out/bench-bert" 2>"$out/bench-bert.err"
    echo "bench bert: exit $?"
    $R bench --device cuda --model resnet152 --batch-sizes 8,16 --budgets 0.6,0.7 --baselines sequential --pairs 5 --out "$out/bench-resnet152" 2>"$out/bench-resnet152.err"
    echo "bench resnet152: exit $?" ;;
esac
