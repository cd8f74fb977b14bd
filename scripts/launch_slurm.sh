#!/usr/bin/env bash
# Submit a training run to SLURM: fill in scripts/slurm_train.sbatch, save the
# filled copy next to the logs, and sbatch it. One process per node (driving all
# of its GPUs) or one process per GPU; jax.distributed detects the processes from
# SLURM's environment.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

usage() {
  cat <<'EOF'
Usage: scripts/launch_slurm.sh --gpus_per_node=N --config=FILE --workdir=DIR [options] [--config.KEY=VALUE ...]

Fills in scripts/slurm_train.sbatch, writes it to LOG_DIR/JOB_NAME.sbatch and
submits it with sbatch; every task runs `srun python launch.py ...`. Run it on a
login node, from a folder on storage the compute nodes share.

  --nodes=N            nodes to use (default 1)
  --gpus_per_node=N    GPUs to use on each node (required)
  --mode=MODE          per_node (default): one process per node drives all its GPUs
                         (--ntasks-per-node=1 --gpus-per-task=N);
                       per_gpu: one process per GPU
                         (--ntasks-per-node=N --gpus-per-task=1)
  --partition=NAME     SLURM partition; default: the cluster's default
  --time=LIMIT         wall-clock limit, e.g. 04:00:00 or 2-00:00:00; default: the partition's
  --job_name=NAME      default jax-launch
  --cpus_per_task=N    CPUs per process for data loading; default: the cluster's (often 1)
  --config=FILE        experiment config, e.g. configs/default.py (required)
  --workdir=DIR        on storage all nodes share (required); checkpoints are written
                       by all processes together and read back on resume
  --python=PATH        interpreter with the requirements and jax[cuda12], reachable
                       from the compute nodes; default: .venv/bin/python of this repo
                       if present, else python3
  --log_dir=DIR        default WORKDIR/logs: JOB_NAME-JOBID.out for the batch script,
                       JOB_NAME-JOBID-NODE-taskN.log for each process
  --config.KEY=VALUE   passed to launch.py as is (any number of them)
  --max_restarts=N     restarts after a crash, lost peer, hang or saved preemption, per
                       process (launch.py's supervisor; default 3, 0 = none)
  --restart_backoff_s=S
                       seconds before a restart (default 10, doubling in a crash loop)
  --distributed_timeout_s=S
                       seconds launch.py waits for every process to join (default 300)
  --elastic_min_nodes=M
                       elastic (docs/supervisor.md, "Elastic runs"): the job is submitted
                       with --no-kill; when nodes are lost and the others, having waited
                       --distributed_timeout_s for them, end short of peers, a new srun
                       runs on the nodes left, at the same global batch, while at least M
                       remain (default 0: not elastic)
  --dry_run            print the filled-in script and the sbatch command, submit nothing
  -h, --help           this text

Example:
  scripts/launch_slurm.sh --nodes=2 --gpus_per_node=8 --partition=gpu --time=04:00:00 \
    --config=configs/default.py --workdir=/shared/runs/llama1 --config.train.steps=5000
EOF
}

NODES=1 GPUS_PER_NODE='' MODE=per_node PARTITION='' TIME='' JOB_NAME=jax-launch CPUS_PER_TASK=''
CONFIG='' WORKDIR='' PYTHON='' LOG_DIR='' ELASTIC_MIN_NODES=0
OVERRIDES=()
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry_run) DRY_RUN=1 ;;
    --nodes=*) NODES=${1#*=} ;;
    --gpus_per_node=*) GPUS_PER_NODE=${1#*=} ;;
    --mode=*) MODE=${1#*=} ;;
    --partition=*) PARTITION=${1#*=} ;;
    --time=*) TIME=${1#*=} ;;
    --job_name=*) JOB_NAME=${1#*=} ;;
    --cpus_per_task=*) CPUS_PER_TASK=${1#*=} ;;
    --config=*) CONFIG=${1#*=} ;;
    --workdir=*) WORKDIR=${1#*=} ;;
    --python=*) PYTHON=${1#*=} ;;
    --log_dir=*) LOG_DIR=${1#*=} ;;
    --elastic_min_nodes=*) ELASTIC_MIN_NODES=${1#*=} ;;
    --max_restarts=*|--restart_backoff_s=*|--distributed_timeout_s=*) OVERRIDES+=("$1") ;;  # launch.py's own.
    --config.*=*) OVERRIDES+=("$1") ;;
    *) bad_argument "$1" ;;
  esac
  shift
done

require gpus_per_node "$GPUS_PER_NODE" 'how many GPUs to use on each node, e.g. --gpus_per_node=8'
require config "$CONFIG" 'the experiment config, e.g. --config=configs/default.py'
require workdir "$WORKDIR" 'shared storage for checkpoints and metrics, e.g. --workdir=/shared/runs/run1'
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "--nodes=$NODES: expected a whole number >= 1."
[[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "--gpus_per_node=$GPUS_PER_NODE: expected a whole number >= 1."
[[ -z $CPUS_PER_TASK || $CPUS_PER_TASK =~ ^[1-9][0-9]*$ ]] ||
  die "--cpus_per_task=$CPUS_PER_TASK: expected a whole number >= 1."
case $MODE in
  per_node) NTASKS_PER_NODE=1 GPUS_PER_TASK=$GPUS_PER_NODE ;;
  per_gpu) NTASKS_PER_NODE=$GPUS_PER_NODE GPUS_PER_TASK=1 ;;
  *) die "--mode=$MODE: expected per_node (one process per node) or per_gpu (one process per GPU)." ;;
esac
if [[ ! $ELASTIC_MIN_NODES =~ ^(0|[1-9][0-9]*)$ ]] || ((ELASTIC_MIN_NODES > NODES)); then
  die "--elastic_min_nodes=$ELASTIC_MIN_NODES: expected a whole number from 1 to --nodes=$NODES (0: not elastic)."
fi
if ((ELASTIC_MIN_NODES)); then  # Every step, the smaller ones too, is told the size the config is written for.
  OVERRIDES+=("--elastic_full_processes=$((NODES * NTASKS_PER_NODE))")
fi
plain='^[A-Za-z0-9_.:/+@%,=-]+$'
for option in "job_name=$JOB_NAME" "partition=$PARTITION" "time=$TIME"; do
  [[ -z ${option#*=} || ${option#*=} =~ $plain ]] || die "--$option: no spaces or shell characters, please."
done
check_config "$CONFIG"
WORKDIR=$(absolute "$WORKDIR")
LOG_DIR=$(absolute "${LOG_DIR:-$WORKDIR/logs}")
# These paths go into #SBATCH lines, which SLURM reads without shell quoting.
for path in "$LOG_DIR" "$PWD"; do
  [[ $path =~ $plain ]] || die "$path: SLURM's #SBATCH lines cannot hold paths with spaces or shell characters."
done
PYTHON=${PYTHON:-$(default_python)}

# Values for the @NAME@ placeholders: #SBATCH ones as they are (an empty one drops
# its line), shell ones quoted.
fill_value() {
  case $1 in
    JOB_NAME) printf '%s' "$JOB_NAME" ;;
    NODES) printf '%s' "$NODES" ;;
    NTASKS) printf '%s' "$((NODES * NTASKS_PER_NODE))" ;;
    NTASKS_PER_NODE) printf '%s' "$NTASKS_PER_NODE" ;;
    GPUS_PER_TASK) printf '%s' "$GPUS_PER_TASK" ;;
    CPUS_PER_TASK) printf '%s' "$CPUS_PER_TASK" ;;
    PARTITION) printf '%s' "$PARTITION" ;;
    TIME) printf '%s' "$TIME" ;;
    CHDIR) printf '%s' "$PWD" ;;
    LOG_DIR) printf '%s' "$LOG_DIR" ;;
    MODE) printf '%s' "$MODE" ;;
    NO_KILL) if ((ELASTIC_MIN_NODES)); then printf -- '--no-kill'; fi ;;
    ELASTIC_MIN_NODES) printf '%s' "$ELASTIC_MIN_NODES" ;;
    PYTHON) quote "$PYTHON" ;;
    LAUNCH) quote "$REPO/launch.py" ;;
    TRAIN_ARGS) quote "--config=$CONFIG" "--workdir=$WORKDIR" ${OVERRIDES[@]+"${OVERRIDES[@]}"} ;;
    *) die "internal: slurm_train.sbatch has an unknown placeholder @$1@." ;;
  esac
}
gpu_env_settings

filled_script() {
  local line rest name value setting placeholder='@([A-Z_]+)@'
  while IFS= read -r line || [[ -n $line ]]; do
    if [[ $line == '# @GPU_ENV@' ]]; then
      for setting in "${GPU_ENV[@]}"; do printf 'export %s=%s\n' "${setting%%=*}" "$(quote "${setting#*=}")"; done
      continue
    fi
    # Left to right, so a value is never searched for placeholders itself.
    rest=$line line=''
    while [[ $rest =~ $placeholder ]]; do
      name=${BASH_REMATCH[1]}
      value=$(fill_value "$name")
      if [[ -z $value && $rest == '#SBATCH '* ]]; then continue 2; fi
      line=$line${rest%%"@$name@"*}$value
      rest=${rest#*"@$name@"}
    done
    printf '%s\n' "$line$rest"
  done <"$REPO/scripts/slurm_train.sbatch"
}

JOB_FILE=$LOG_DIR/$JOB_NAME.sbatch
need_tool sbatch 'run this on a SLURM login node.'
run mkdir -p "$LOG_DIR"
if ((DRY_RUN)); then
  printf "+ cat > %s <<'SBATCH_EOF'\n" "$(quote "$JOB_FILE")"
  filled_script
  printf 'SBATCH_EOF\n'
  show sbatch --parsable "$JOB_FILE"
  exit 0
fi
filled_script >"$JOB_FILE"
echo "Wrote $JOB_FILE"
show sbatch --parsable "$JOB_FILE"
job_id=$(sbatch --parsable "$JOB_FILE")
job_id=${job_id%%;*}
processes=$((NODES * NTASKS_PER_NODE))
echo "Submitted job $job_id: $NODES node(s) x $NTASKS_PER_NODE process(es) x $GPUS_PER_TASK GPU(s) = $processes process(es)."
echo "Batch log:   $LOG_DIR/$JOB_NAME-$job_id.out"
if ((ELASTIC_MIN_NODES)); then
  echo "Elastic:     on lost nodes it goes on with those left while at least $ELASTIC_MIN_NODES remain; one line each in the batch log."
fi
echo "Task logs:   $LOG_DIR/$JOB_NAME-$job_id-NODE-taskN.log (task 0 prints the progress lines)"
echo "Follow with: squeue -j $job_id; tail -f $LOG_DIR/$JOB_NAME-$job_id-*-task0.log"
