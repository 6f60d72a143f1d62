#!/usr/bin/env bash
# GPU check: a few minutes of the GPU recipe through the whole system (synchronizer, learners,
# store, Prefect flow, MLflow), then tokens/s and loss. For a machine with CUDA; it has not been
# run on this project's CPU-only machines.
#
#   scripts/gpu_check.sh                 # configs/gpt2-gpu.toml if present, else a byte-GPT recipe on cuda, bf16
#   GPU_CHECK_S=300 NPROC=2 scripts/gpu_check.sh
#
# Environment: PY (python, default .venv/bin/python), GPU_CHECK_S (training seconds, default 180),
# NPROC (learners.nproc_per_learner, default 1), CONFIG (a recipe to use instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPU_CHECK_S=${GPU_CHECK_S:-180}
NPROC=${NPROC:-1}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.local/prefect} PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
export MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
mkdir -p "$PREFECT_HOME"

"$PY" -c 'import sys, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__}, {n} CUDA device(s)" + "".join(f"; cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n)))
sys.exit(0 if n else "no CUDA GPU visible: this check needs one")'

if [[ -n "${CONFIG:-}" ]]; then
  ARGS=(--config "$CONFIG")
elif [[ -f configs/gpt2-gpu.toml ]]; then
  ARGS=(--config configs/gpt2-gpu.toml)
else  # byte-level GPT, ~20M parameters, one GPU per learner
  ARGS=(--config configs/default.toml --set learners.count=2 --set model.n_layer=6 --set model.d_model=512
        --set model.n_head=8 --set model.context=256 --set learners.batch_size=32 --set learners.lr=0.001
        --set learners.warmup_steps=100 --set synchronizer.sync_every=100 --set learners.threads=4)
fi
ARGS+=(--set 'learners.device="cuda"' --set 'learners.precision="bf16"' --set "learners.nproc_per_learner=$NPROC"
       --set "budget.wall_s=$GPU_CHECK_S" --set 'budget.tokens=1000000000000'
       --set "run.store=\"file://$OUT/store\"" --set "run.workdir=\"$OUT/runs\""
       --set "tracking.mlflow_uri=\"sqlite:///$OUT/mlflow.db\"" --set "tracking.artifact_location=\"$OUT/mlartifacts\"")

echo "command: $PY -m diloco_async.flows.cli train ${ARGS[*]}"
T0=$(date +%s)
"$PY" -m diloco_async.flows.cli train "${ARGS[@]}" | tee "$OUT/train.out"
echo "wall: $(( $(date +%s) - T0 )) s, files in $OUT"

"$PY" - "$OUT" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
summary = json.load(open(sorted(glob.glob(f"{out}/store/*/epochs/*/summary.json"))[-1]))
report = [json.loads(line) for line in open(f"{out}/train.out") if line.startswith("{")][-1]
tokens = summary.get("tokens_processed", 0)
print(f"tokens/s (all learners): {tokens / summary['wall_s']:.0f}  ({tokens} tokens in {summary['wall_s']:.0f} s)")
for lid, led in sorted(summary["learners"].items()):
    print(f"  {lid}: step {led['step']}, tokens {led.get('tokens_processed', '?')}")
print(f"eval loss: {report['eval_loss_initial']:.4f} -> {report['eval_loss_final']:.4f}; merges {summary['merges']}")
PYEOF
