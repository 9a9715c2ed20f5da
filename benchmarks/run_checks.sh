#!/usr/bin/env bash
# The measurements recorded in docs/RESULTS.md, "Rewriter and runtime".
# Each line of docs/run/runs.jsonl is one `remat run --json` object (or a failure record).
set -u
cd "$(dirname "$0")/.."
out=docs/run/runs.jsonl
for cfg in "bert 8" "resnet152 4"; do
  set -- $cfg
  for budget in none 0.6 0.4 0.2; do
    echo "== $1 batch $2 budget $budget" >&2
    if ! .venv/bin/remat run --model "$1" --batch-size "$2" --budget "$budget" --check --steps 1 --pairs 5 --json >> "$out" 2> docs/run/last.err; then
      printf '{"model": "%s", "batch_size": %s, "budget": "%s", "failed": %s}\n' "$1" "$2" "$budget" \
        "$(tail -1 docs/run/last.err | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')" >> "$out"
    fi
  done
done
