#!/usr/bin/env bash
# Train on one machine with several NVIDIA GPUs: ONE launch.py process drives all
# of them (jax sees every local GPU in one process, so there is nothing for
# jax.distributed to join), with the XLA and memory settings of scripts/gpu_env.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

usage() {
  cat <<'EOF'
Usage: scripts/launch_gpu_node.sh --config=FILE --workdir=DIR [options] [--config.KEY=VALUE ...]

Runs `python launch.py` once, on all (or the chosen) GPUs of this machine.

  --config=FILE      experiment config, e.g. configs/default.py (required)
  --workdir=DIR      checkpoints, metrics and TensorBoard logs; rerun to resume (required)
  --gpus=LIST        GPU indices to use, e.g. 0,1,2,3 (sets CUDA_VISIBLE_DEVICES);
                     default: every GPU this shell can see
  --python=PATH      interpreter with the requirements and jax's CUDA plugin
                     (pip install "jax[cuda12]==<jax pin in requirements.txt>");
                     default: .venv/bin/python of this repo if present, else python3
  --config.KEY=VALUE passed to launch.py as is (any number of them)
  --max_restarts=N   restarts after a crash, lost peer, hang or saved preemption, per
                     process (launch.py's supervisor; default 3, 0 = none)
  --restart_backoff_s=S
                     seconds before a restart (default 10, doubling in a crash loop)
  --dry_run          print the exports and the command, run nothing
  -h, --help         this text

Environment set for the run (kept if you already exported them): JAX_PLATFORMS=cuda,
XLA_FLAGS with --xla_gpu_enable_latency_hiding_scheduler=true and
--xla_gpu_enable_command_buffer=-CUDNN (your XLA_FLAGS come after and win), XLA_CLIENT_MEM_FRACTION=0.90. Why each: scripts/gpu_env.sh.

Example:
  scripts/launch_gpu_node.sh --gpus=0,1,2,3 --config=configs/default.py \
    --workdir=/data/runs/llama1 --config.train.batch_size=64
EOF
}

GPUS='' CONFIG='' WORKDIR='' PYTHON=''
OVERRIDES=()
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry_run) DRY_RUN=1 ;;
    --gpus=*) GPUS=${1#*=} ;;
    --config=*) CONFIG=${1#*=} ;;
    --workdir=*) WORKDIR=${1#*=} ;;
    --python=*) PYTHON=${1#*=} ;;
    --max_restarts=*|--restart_backoff_s=*) OVERRIDES+=("$1") ;;  # The supervisor's, passed to launch.py.
    --config.*=*) OVERRIDES+=("$1") ;;
    *) bad_argument "$1" ;;
  esac
  shift
done

require config "$CONFIG" 'the experiment config, e.g. --config=configs/default.py'
require workdir "$WORKDIR" 'where checkpoints and metrics go, e.g. --workdir=/data/runs/run1'
check_config "$CONFIG"
gpu_list='^[0-9]+(,[0-9]+)*$'
if [[ -n $GPUS && ! $GPUS =~ $gpu_list ]]; then
  die "--gpus=$GPUS: expected GPU indices separated by commas, e.g. --gpus=0,1,2,3."
fi
PYTHON=${PYTHON:-$(default_python)}
need_tool "$PYTHON" 'pass --python=/path/to/venv/bin/python (a venv with requirements.txt and jax[cuda12]).'

gpu_env_settings
if [[ -n $GPUS ]]; then GPU_ENV=("CUDA_VISIBLE_DEVICES=$GPUS" "${GPU_ENV[@]}"); fi
for setting in "${GPU_ENV[@]}"; do
  printf '+ export %s=%s\n' "${setting%%=*}" "$(quote "${setting#*=}")"
  export "${setting?}"
done

# launch.py by absolute path: it finds its packages next to itself, and relative
# --config and --workdir paths keep meaning the current folder.
command=("$PYTHON" "$REPO/launch.py" "--config=$CONFIG" "--workdir=$WORKDIR" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
show "${command[@]}"
if ((DRY_RUN)); then exit 0; fi
exec "${command[@]}"
