#!/usr/bin/env bash
# A validator in audit mode in a real swarm on 127.0.0.1 (docs/CREDIT.md section 3): bootstrap,
# trainer, worker and a validator with -o audit_every_s=5 run as their own processes; a tiny job
# of 80 steps trains; the validator audits the job's books (and runs its ladder on the sampled
# credited batches) every 5 s and publishes each signed report in the DHT; at the end anyone lists
# them with `swarmrl audit JOB --published`; then anyone audits the job from the public record
# (`swarmrl audit JOB --initial-peers MADDR`: the statements peer to peer), once from the trainer and,
# after the trainer is stopped, from the validator's mirror; before it stops, `swarmrl audit --replay all`
# recomputes every version from the credited groups (the trainer keeps every version: keep_versions). Usage: [MODEL=gemma STEPS=8] bash
# scripts/demo_audit_mode.sh [WORKDIR] (default: the tiny model, 80 steps).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
S=$root/.venv/bin/swarmrl
work=${1:-$(mktemp -d)}
mkdir -p "$work" && cd "$work"
export SWARMRL_CACHE=${SWARMRL_CACHE:-$root/.cache/swarmrl}
model=${MODEL:-tiny}; steps=${STEPS:-80}
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT
ready() { for _ in $(seq 180); do [ -s "$1" ] && return 0; sleep 1; done; echo "no $1 (see $work/*.log)" >&2; exit 1; }
field() { python3 -c "import json,sys; v=json.load(open(sys.argv[1]))[sys.argv[2]]; print(v[0] if isinstance(v, list) else v)" "$1" "$2"; }
"$S" bootstrap -o ready_file='"boot.ready"' > boot.log 2>&1 &
ready boot.ready; maddr=$(field boot.ready maddrs)
"$S" keygen keys/validator.key > validator.id
vid=$(grep -o '[0-9a-f]\{40\}' validator.id | head -1)
"$S" trainer --initial-peers "$maddr" -o grpc_port=0 -o "trusted_validators=[\"$vid\"]" -o keep_versions=$((steps + 8)) -o ready_file='"trainer.ready"' > trainer.log 2>&1 &
trainer_pid=$!
"$S" worker --initial-peers "$maddr" -o base_model="$model" > worker.log 2>&1 &
"$S" validator --initial-peers "$maddr" -o audit_every_s=5 -o metrics_port=0 -o ready_file='"validator.ready"' > validator.log 2>&1 &
ready trainer.ready; ready validator.ready; endpoint=$(field trainer.ready endpoint)
printf 'name = "audit-demo"\nbase_model = "%s"\nenvironment = "arithmetic"\nsteps = %s\ngroup_size = 4\nbatch_groups = 2\nprompts_per_lease = 2\n' "$model" "$steps" > job.toml
job=$("$S" submit job.toml --trainer "$endpoint" 2>submit.log | tail -1)
echo "job $job at $endpoint; work in $work"
until "$S" status "$job" --trainer "$endpoint" --json 2>/dev/null | grep -q '"done"'; do sleep 2; done
sleep 6   # one more audit after the last step
echo "--- the validator's audits"; grep "audits:" validator.log | cut -d' ' -f2,6- || true
echo "--- its /metrics"; "$root/.venv/bin/python" -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$(field validator.ready metrics)" | grep '^swarmrl_validator_audit' || true
echo "--- swarmrl audit JOB --published"; "$S" audit "$job" --published --initial-peers "$maddr"
echo "--- swarmrl audit JOB --initial-peers MADDR (the public record; the trainer serves its statements)"
"$S" audit "$job" --initial-peers "$maddr" --sample 0
echo "--- swarmrl audit JOB --trainer HOST:PORT --replay all (every version recomputed from the credited groups)"
time "$S" audit "$job" --trainer "$endpoint" --replay all --sample 0
echo "--- the same once the trainer has stopped (the validator's mirror serves them)"
kill -TERM "$trainer_pid"; wait "$trainer_pid" || true
"$S" audit "$job" --initial-peers "$maddr" --sample 0
