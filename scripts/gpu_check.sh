#!/usr/bin/env bash
# The GPU check: the demo task with vLLM rollout on one GPU, in about ten minutes once installed.
#
# Real `streamrl train` runs, each reported with its throughput and its vLLM-vs-trainer
# log-prob mismatch (mean |trainer - rollout| log-prob per trained token, `train/logprob_mismatch`):
#
#   1. on-policy  runtime.mode=sync, rollout.engine=vllm, $SYNC_STEPS steps. The engine holds
#                 exactly the weights being trained at every step, so the mismatch measures vLLM's
#                 kernels against the trainer's forward and nothing else.
#   2. demo       the default asynchronous job (a Ray process per role, max_staleness=1,
#                 in-flight weight updates) with rollout.engine=vllm, $DEMO_STEPS steps, held-out
#                 accuracy before and after. The rollout role gets half of the GPU; the trainer
#                 the other half when its role can train on a GPU (`trainer.device`), else the CPU.
#   3. bf16       as 1 with model.dtype=bfloat16: trainer and vLLM in bf16 (the mismatch shows
#                 bf16's drift against run 1's fp32).
#   4. mixed      as 1 with model.dtype=bfloat16 trainer.mixed_precision=true: bf16 compute over
#                 fp32 master weights and optimizer state in the trainer, vLLM in bf16.
#   5. nccl       as 2 for $NCCL_STEPS steps with runtime.weights.channel=collective and
#                 collective_backend=nccl (trainer and engine on GPUs; gloo in the dry run).
#   6. lora       as 1 with trainer.lora.rank=16 (alpha 32, lr 1e-3): only the adapters train and
#                 vLLM loads the merged weights each step (its mismatch should be run 1's).
#
# FSDP2: the trainer role shards over ranks only with `trainer.world_size` >= 2, one GPU each,
# and the rollout needs a GPU of its own; on fewer than 3 GPUs (or a streamrl whose trainer has
# no `world_size`) the check trains in one process and says so. The output names what ran where.
#
# It fails loudly when there is no GPU (nvidia-smi, then torch.cuda.is_available() in the
# environment it uses). Results: printed last, and in runs/gpu-check-<time>/gpu_check.json.
#
# Usage: scripts/gpu_check.sh [--cpu-dry-run] [--no-install] [--help]
#   --cpu-dry-run  the same two runs on the CPU, few small steps, with .venv (make install-vllm):
#                  checks the script and the pipeline on a machine without a GPU
#   --no-install   fail instead of installing when the environment lacks vLLM
# Environment (defaults in brackets):
#   GPU_CHECK_PYTHON   interpreter to use [.venv's if it has vLLM and sees a GPU, else
#                      .cache/venv-gpu/bin/python, created with vllm==$VLLM_VERSION and streamrl]
#   VLLM_VERSION [0.32.0]  VLLM_DTYPE [auto = the trainer's]
#   SYNC_STEPS [10; 2 in the dry run]  DEMO_STEPS [60; 3 in the dry run]
#   NCCL_STEPS [10; 2 in the dry run]
#   GPU_CHECK_BUDGET_S [600; 1500 in the dry run]: all runs together; a run still going then is
#                      stopped and the check fails
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_DTYPE=${VLLM_DTYPE:-auto}
DRY_RUN=0
INSTALL=1

say() { echo "gpu_check: $*"; }
die() {
    echo "gpu_check: FAILED: $*" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($#)); do
    case "$1" in
        --cpu-dry-run) DRY_RUN=1 ;;
        --no-install) INSTALL=0 ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# --- 1. A GPU, or a CPU dry run ------------------------------------------------------------
NUM_GPUS=0
if ((DRY_RUN)); then
    SYNC_STEPS=${SYNC_STEPS:-2}
    DEMO_STEPS=${DEMO_STEPS:-3}
    NCCL_STEPS=${NCCL_STEPS:-2}
    BUDGET_S=${GPU_CHECK_BUDGET_S:-1500} # two cores shared with other work start vLLM slowly
    say "CPU DRY RUN: no GPU is used or checked; the numbers below are not GPU numbers"
else
    SYNC_STEPS=${SYNC_STEPS:-10}
    DEMO_STEPS=${DEMO_STEPS:-60}
    NCCL_STEPS=${NCCL_STEPS:-10}
    BUDGET_S=${GPU_CHECK_BUDGET_S:-600}
    command -v nvidia-smi >/dev/null || die "no GPU: nvidia-smi is not installed (no NVIDIA driver)"
    NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    ((NUM_GPUS > 0)) || die "no GPU: nvidia-smi lists none"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader |
        sed 's/^/gpu_check: GPU /'
fi

# --- 2. The Python environment -------------------------------------------------------------
has_vllm() { "$1" -c 'import streamrl, vllm' >/dev/null 2>&1; }
sees_gpu() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }

if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
    PY=$GPU_CHECK_PYTHON
elif ((DRY_RUN)) || { has_vllm .venv/bin/python && sees_gpu .venv/bin/python; }; then
    PY=.venv/bin/python
else
    PY=.cache/venv-gpu/bin/python
fi
if ! has_vllm "$PY"; then
    ((DRY_RUN)) && die "$PY cannot import vLLM: run 'make install-vllm' first"
    ((INSTALL)) || die "$PY cannot import streamrl and vLLM (and --no-install was given)"
    [[ $PY == .cache/venv-gpu/bin/python ]] || die "$PY cannot import streamrl and vLLM"
    say "installing vllm==$VLLM_VERSION (with its CUDA build of torch) and streamrl into .cache/venv-gpu"
    python3 -m venv .cache/venv-gpu
    "$PY" -m pip install --quiet --upgrade pip
    # vLLM first: it pins the torch it was built against; streamrl accepts any torch >= 2.6.
    "$PY" -m pip install --quiet "vllm==$VLLM_VERSION"
    "$PY" -m pip install --quiet -e .
    has_vllm "$PY" || die "the install finished but $PY still cannot import streamrl and vLLM"
fi
if ((!DRY_RUN)); then
    sees_gpu "$PY" || die "no GPU for torch: torch.cuda.is_available() is False in $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
fi
say "python: $PY ($("$PY" -c 'import torch, vllm; print(f"torch {torch.__version__}, vllm {vllm.__version__}")' 2>/dev/null))"

# --- 3. What this streamrl can do, and the two runs' settings ------------------------------
has_key() { "$PY" -m streamrl.cli config show "$1" >/dev/null 2>&1; }
TRAINER_DEVICE=cpu
SYNC_ARGS=()
DEMO_ARGS=()
COMMON=(rollout.engine=vllm "rollout.vllm.dtype=$VLLM_DTYPE" run.progress=false run.tensorboard=false)
if ((DRY_RUN)); then
    COMMON+=(rollout.batch_prompts=8 rollout.group_size=4 data.num_eval=32 rollout.vllm.kv_cache_gib=0.25)
    has_key trainer.device=cpu && COMMON+=(trainer.device=cpu)
else
    # vLLM's start-up check wants this share of the GPU free; the KV cache is sized explicitly
    # (rollout.vllm.kv_cache_gib), so it takes little more than the model and that cache.
    COMMON+=("rollout.vllm.engine_kwargs={gpu_memory_utilization: 0.3}")
    if has_key trainer.device=cuda; then
        TRAINER_DEVICE=cuda
        SYNC_ARGS+=(trainer.device=cuda)
        DEMO_ARGS+=(trainer.device=cuda)
    fi
fi
if ! has_key trainer.world_size=2; then
    FSDP_NOTE="not run: this streamrl's trainer role has no trainer.world_size (no FSDP2 ranks)"
elif ((DRY_RUN)); then
    FSDP_NOTE="not run in the CPU dry run"
elif [[ $TRAINER_DEVICE == cuda ]] && ((NUM_GPUS >= 3)); then
    FSDP_NOTE="run: trainer.world_size=2 (two FSDP2 ranks, a GPU each) in the demo run"
else
    FSDP_NOTE="not run: FSDP2 needs trainer.world_size >= 2 ranks with a GPU each, plus a GPU for the rollout; this machine has $NUM_GPUS"
fi
if ((DRY_RUN)); then
    DEMO_PLACEMENT="rollout (vLLM) and trainer on the CPU"
elif [[ $FSDP_NOTE == run:* ]]; then
    DEMO_ARGS+=(trainer.world_size=2 runtime.ray.roles.trainer.num_gpus=2 runtime.ray.roles.rollout.num_gpus=1)
    DEMO_PLACEMENT="rollout (vLLM) on one GPU, trainer on two GPUs (FSDP2)"
elif [[ $TRAINER_DEVICE == cuda ]]; then
    DEMO_ARGS+=(runtime.ray.roles.rollout.num_gpus=0.5 runtime.ray.roles.trainer.num_gpus=0.5)
    DEMO_PLACEMENT="rollout (vLLM) and trainer share GPU 0 (half each)"
else
    DEMO_ARGS+=(runtime.ray.roles.rollout.num_gpus=0.5)
    DEMO_PLACEMENT="rollout (vLLM) on half of GPU 0; trainer on the CPU (this streamrl's trainer role has no trainer.device)"
fi
if ((DRY_RUN)); then
    SYNC_PLACEMENT="vLLM and trainer in one process on the CPU"
else
    SYNC_PLACEMENT="vLLM on GPU 0 and trainer on $TRAINER_DEVICE, in one process"
fi

OUT=runs/gpu-check-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
STARTED=$SECONDS

# report NAME WHERE: print a finished run's numbers and keep them in $OUT/NAME.json.
report() {
    "$PY" - "$OUT/$1" "$2" <<'PYEOF'
import json
import statistics
import sys
from pathlib import Path

run_dir, where = Path(sys.argv[1]), sys.argv[2]
summary = json.loads((run_dir / "summary.json").read_text())
records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
steps = [m for m in records if "train/loss" in m]
if not steps:
    sys.exit(f"gpu_check: FAILED: the {run_dir.name} run logged no training step")
# The mismatch is over trained tokens; a step whose samples all had zero advantage has none.
mismatch = [m["train/logprob_mismatch"] for m in steps if m.get("train/trained_tokens", 1) > 0]
rollout_s = sum(m.get("time/rollout_busy_s", 0.0) for m in steps)
r = {
    "where": where,
    "mode": summary["mode"],
    "steps": len(steps),
    "rl_tokens_per_s": summary["tokens_per_s"],
    "rollout_tokens_per_s": sum(m["response/tokens"] for m in steps) / rollout_s if rollout_s else None,
    "logprob_mismatch_mean": statistics.fmean(mismatch) if mismatch else None,
    "logprob_mismatch_max": max(mismatch) if mismatch else None,
    "eval_accuracy_before": summary["initial_eval_accuracy"],
    "eval_accuracy_after": summary["final_eval_accuracy"],
    "rl_wall_s": summary["rl_wall_time_s"],
}
(run_dir.parent / f"{run_dir.name}.json").write_text(json.dumps(r, indent=2) + "\n")


def num(value, spec):
    return "n/a" if value is None else format(value, spec)


print(f"gpu_check: {run_dir.name} ({r['mode']}, {r['steps']} steps, {r['rl_wall_s']:.0f} s): {where}")
print(
    f"gpu_check:   throughput {num(r['rl_tokens_per_s'], '.0f')} tokens/s end to end, "
    f"{num(r['rollout_tokens_per_s'], '.0f')} tokens/s while generating"
)
print(
    "gpu_check:   vLLM vs trainer log-prob mismatch per step: "
    f"mean {num(r['logprob_mismatch_mean'], '.2e')}, max {num(r['logprob_mismatch_max'], '.2e')}"
)
if r["eval_accuracy_before"] is not None:
    print(
        f"gpu_check:   held-out accuracy {num(r['eval_accuracy_before'], '.3f')} before, "
        f"{num(r['eval_accuracy_after'], '.3f')} after"
    )
PYEOF
}

# run NAME WHERE ARGS...: one `streamrl train` into $OUT/NAME within what is left of the budget,
# then its report.
run() {
    local name=$1 where=$2 left rc=0
    shift 2
    left=$((BUDGET_S - (SECONDS - STARTED)))
    ((left > 0)) || die "the ${BUDGET_S}s budget is spent before the $name run"
    say "$name run: streamrl train $* (at most ${left}s; log $OUT/$name.log)"
    timeout --kill-after=20 "$left" "$PY" -m streamrl.cli train "$@" "run.run_dir=$OUT/$name" \
        >"$OUT/$name.log" 2>&1 || rc=$?
    if ((rc != 0)); then
        tail -n 40 "$OUT/$name.log" >&2
        ((rc == 124)) && die "the $name run did not finish within the ${BUDGET_S}s budget"
        die "the $name run exited with $rc (log: $OUT/$name.log)"
    fi
    report "$name" "$where"
}

ON_POLICY=("${COMMON[@]}" "${SYNC_ARGS[@]}" runtime.mode=sync "trainer.steps=$SYNC_STEPS" trainer.eval_every=0)
run on-policy "$SYNC_PLACEMENT" "${ON_POLICY[@]}"
run demo "$DEMO_PLACEMENT" "${COMMON[@]}" "${DEMO_ARGS[@]}" "trainer.steps=$DEMO_STEPS"
run bf16 "$SYNC_PLACEMENT, bf16" "${ON_POLICY[@]}" model.dtype=bfloat16
run mixed "$SYNC_PLACEMENT, bf16 compute over fp32 master weights" "${ON_POLICY[@]}" \
    model.dtype=bfloat16 trainer.mixed_precision=true
if ((DRY_RUN)); then
    run nccl "$DEMO_PLACEMENT, weights by gloo broadcast (the dry run's stand-in for NCCL)" \
        "${COMMON[@]}" "${DEMO_ARGS[@]}" "trainer.steps=$NCCL_STEPS" \
        runtime.weights.channel=collective runtime.weights.collective_backend=gloo
elif [[ $TRAINER_DEVICE == cuda ]]; then
    run nccl "$DEMO_PLACEMENT, weights by NCCL broadcast" "${COMMON[@]}" "${DEMO_ARGS[@]}" \
        "trainer.steps=$NCCL_STEPS" runtime.weights.channel=collective \
        runtime.weights.collective_backend=nccl
else
    say "nccl run: not run (the trainer is on the CPU; NCCL needs both ends on GPUs)"
fi
run lora "$SYNC_PLACEMENT, LoRA rank 16, merged weights to vLLM" "${ON_POLICY[@]}" \
    trainer.lora.rank=16 trainer.lora.alpha=32 algorithm.lr=1e-3
say "FSDP2: $FSDP_NOTE"
"$PY" - "$OUT" "$DRY_RUN" "$FSDP_NOTE" "$((SECONDS - STARTED))" <<'PYEOF'
import json
import sys
from pathlib import Path

out, dry_run, fsdp, wall = sys.argv[1:]
names = ("on-policy", "demo", "bf16", "mixed", "nccl", "lora")
runs = {n: json.loads((Path(out) / f"{n}.json").read_text()) for n in names if (Path(out) / f"{n}.json").is_file()}
report = {"dry_run_on_cpu": dry_run == "1", "fsdp2": fsdp, "wall_s": int(wall), "runs": runs}
(Path(out) / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
PYEOF
say "done in $((SECONDS - STARTED)) s: $OUT/gpu_check.json"
