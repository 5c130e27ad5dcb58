#!/usr/bin/env bash
# The lent-GPU session in one command: sections by priority, each under its own time cap,
# each writing its JSON to $OUT as soon as it ends (a session cut short keeps what ran).
# Observe mode only: nothing here sets a clock, a power limit or MIG, or resets the GPU.
#
#   scripts/gpu-session.sh                 # on the GPU machine, from the source tree
#   scripts/gpu-session.sh --dry-run-cpu   # rehearsal on a CPU: tiny models, no NVML
#
# OUT (default ./gpu-session-out), PYTHON (default python3) and SECTIONS (default
# "preflight profile host gpu") may be set in the environment.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-session-out}
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-preflight profile host gpu}
DRY=()
if [ "${1:-}" = "--dry-run-cpu" ]; then
  DRY=(--dry-run-cpu)
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--dry-run-cpu]" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# section NAME CAP_S COMMAND...: run it under `timeout`, keep its log, its last line as
# NAME.json, and one line of NAME's status in sections.jsonl.
section() {
  local name=$1 cap=$2
  shift 2
  case " $SECTIONS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (at most ${cap} s)"
  local start rc
  start=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 1 "$OUT/$name.log" >"$OUT/$name.json"
  printf '{"section": "%s", "rc": %d, "seconds": %d}\n' \
    "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$OUT/sections.jsonl"
}

section preflight 60 "$PY" -c '
import json, platform, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "triton": tv, "gpu": gpu}))'
section profile 300 "$PY" -m wattserve.bench.gpu_profile "${DRY[@]}"
section host 120 "$PY" -m wattserve.daemon.cli bench host
section gpu 480 "$PY" -m wattserve.daemon.cli bench gpu --out-dir "$OUT" "${DRY[@]}" \
  --max-seconds 400
