#!/usr/bin/env bash
# Prepared GPU check for the vLLM worker backend (issue 10). Run on a machine with an NVIDIA GPU:
#   bash scripts/gpu_check.sh            (env: STEPS=5 MIN_LORA_RATIO=0.9 OUT=runs/gpu-check)
# 1. makes .venv-vllm (scripts/vllm_env.sh picks the CUDA `vllm` package where nvidia-smi lists a GPU)
# 2. throughput on Gemma 3 270M: vLLM vs transformers tok/s, multi-LoRA 1/2/4 adapters over base
#    (fails below MIN_LORA_RATIO), adapter hot-swap latency
# 3. cross-engine log-prob gap: vLLM-sampled rollouts re-scored by the validator's transformers
#    prefill (fails on any false positive)
# 4. a short local swarm with vLLM workers (`swarmrl up --backend vllm`): reward first/last steps
#    (fails if the run fails or an honest worker is banned); per-worker tok/s is each worker's
#    swarmrl_worker_tokens_per_second metric (step 2 measures one worker's engine alone)
# Exits non-zero at the first failed check; prints every figure it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-5}
MIN_LORA_RATIO=${MIN_LORA_RATIO:-0.9}
OUT=${OUT:-runs/gpu-check}
PY=.venv/bin/python

nvidia-smi -L | grep -q GPU || { echo "gpu_check: no GPU (nvidia-smi -L lists none)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
test -x "$PY" || make venv
bash scripts/vllm_env.sh
.venv-vllm/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
mkdir -p "$OUT"

echo "== throughput (Gemma 3 270M)"
$PY benchmarks/vllm_throughput.py --model gemma --prompts 16 --n 8 --new-tokens 128 --rounds 3 \
    --hf-threads "$(nproc)" | tee "$OUT/throughput.txt"
awk -v min="$MIN_LORA_RATIO" '/^multi-LoRA/ { r = $NF + 0; if (r < min) { bad = 1; print "FAIL: " $0 " < " min } }
    END { exit bad }' "$OUT/throughput.txt"

echo "== cross-engine log-prob gap (vLLM samples, transformers re-scores)"
$PY benchmarks/vllm_logprob_gap.py --model gemma --rollouts 512 --hf-threads "$(nproc)" | tee "$OUT/gap.txt"
grep -q "vLLM-sampled: .* false positives 0," "$OUT/gap.txt" || { echo "FAIL: false positives" >&2; exit 1; }

echo "== local swarm with vLLM workers"
$PY -m swarmrl.node.cli.main up --backend vllm --red-team all --steps "$STEPS" --out "$OUT/swarm" | tee "$OUT/swarm.txt"
$PY - "$OUT/swarm" <<'PYEOF'
import json, sys
from pathlib import Path
summary = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
for key in ("steps", "seconds", "reward_first", "reward_last", "honest_banned"):
    print(f"{key}: {summary.get(key)}")
sys.exit(1 if summary.get("honest_banned", 0) else 0)
PYEOF
echo "gpu_check: all checks passed"
