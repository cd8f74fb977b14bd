#!/usr/bin/env bash
# Train on every host of a Cloud TPU pod slice: create the TPU VM (or reuse it),
# copy this repo to all workers, install the pinned requirements with the TPU
# runtime, run launch.py on all workers at once, and bring each worker's log back.
# No coordinator flags: jax.distributed finds the other workers of the slice itself.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
  cat <<'EOF'
Usage: scripts/launch_tpu_pod.sh --name=TPU --zone=ZONE --accelerator_type=TYPE \
         --config=FILE --workdir=DIR [options] [--config.KEY=VALUE ...]

Creates the TPU VM TPU if it does not exist (reuses it if it does), copies this
repo to ~/jax-launch on every worker, installs requirements.txt plus the TPU
runtime into ~/jax-launch-venv, runs `python launch.py` on all workers, then copies
each worker's log to LOG_DIR/worker-N/. Needs the gcloud CLI, logged in.

  --name=TPU               TPU VM name, e.g. my-pod (required)
  --zone=ZONE              e.g. us-east5-a (required)
  --accelerator_type=TYPE  slice type, e.g. v5p-32, v4-32, v5litepod-16, v6e-64 (required;
                           an existing TPU of another type is refused)
  --version=VERSION        TPU VM runtime; default from the type: v6e v2-alpha-tpuv6e,
                           v5p v2-alpha-tpuv5, v5litepod/v5e v2-alpha-tpuv5-lite,
                           v4 and older tpu-ubuntu2204-base
  --project=PROJECT        Google Cloud project; default: gcloud's configured one
  --config=FILE            experiment config inside this repo, e.g. configs/default.py (required)
  --workdir=DIR            storage that EVERY worker sees as the same (required):
                           checkpoints are written by all hosts together and read
                           back on resume, so a disk local to each worker does not
                           work. A Cloud Storage URL (gs://BUCKET/run1: the workers
                           get requirements-gcs.txt too) or an absolute path on an
                           NFS/Filestore mount.
  --log_dir=DIR            local folder for the per-worker logs; default tpu_logs/TPU
  --config.KEY=VALUE       passed to launch.py as is (any number of them)
  --max_restarts=N         restarts after a crash, lost peer, hang or saved preemption, per
                           process (launch.py's supervisor; default 3, 0 = none)
  --restart_backoff_s=S
                           seconds before a restart (default 10, doubling in a crash loop)
  --dry_run                print every command, run nothing
  -h, --help               this text

Training runs in the foreground of the ssh sessions: if the connection drops the
run stops; launch it again and it resumes from the newest checkpoint. Ctrl-C
stops waiting and still collects the logs.

Example:
  scripts/launch_tpu_pod.sh --name=my-pod --zone=us-east5-a --accelerator_type=v5p-32 \
    --config=configs/default.py --workdir=gs://my-bucket/run1 --config.train.steps=2000
EOF
}

NAME='' ZONE='' ACCELERATOR_TYPE='' VERSION='' PROJECT='' CONFIG='' WORKDIR='' LOG_DIR=''
OVERRIDES=()
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry_run) DRY_RUN=1 ;;
    --name=*) NAME=${1#*=} ;;
    --zone=*) ZONE=${1#*=} ;;
    --accelerator_type=*) ACCELERATOR_TYPE=${1#*=} ;;
    --version=*) VERSION=${1#*=} ;;
    --project=*) PROJECT=${1#*=} ;;
    --config=*) CONFIG=${1#*=} ;;
    --workdir=*) WORKDIR=${1#*=} ;;
    --log_dir=*) LOG_DIR=${1#*=} ;;
    --max_restarts=*|--restart_backoff_s=*) OVERRIDES+=("$1") ;;  # The supervisor's, passed to launch.py.
    --config.*=*) OVERRIDES+=("$1") ;;
    *) bad_argument "$1" ;;
  esac
  shift
done

require name "$NAME" 'the TPU VM to create or reuse, e.g. --name=my-pod'
require zone "$ZONE" 'where the TPU lives, e.g. --zone=us-east5-a'
require accelerator_type "$ACCELERATOR_TYPE" 'the slice, e.g. --accelerator_type=v5p-32'
require config "$CONFIG" 'the experiment config, e.g. --config=configs/default.py'
require workdir "$WORKDIR" 'storage every worker sees, e.g. --workdir=gs://my-bucket/run1'
tpu_name='^[a-z]([-a-z0-9]*[a-z0-9])?$' slice_type='^v[0-9][a-z0-9]*-[0-9]+$'
[[ $NAME =~ $tpu_name ]] ||
  die "--name=$NAME: TPU names are lowercase letters, digits and dashes, starting with a letter."
[[ $ACCELERATOR_TYPE =~ $slice_type ]] ||
  die "--accelerator_type=$ACCELERATOR_TYPE: expected a slice type like v5p-32, v4-32 or v5litepod-16."
if [[ -z $VERSION ]]; then
  # Google's table of TPU software versions for JAX.
  case $ACCELERATOR_TYPE in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "no default runtime for --accelerator_type=$ACCELERATOR_TYPE: pass --version (see https://cloud.google.com/tpu/docs/runtimes)." ;;
  esac
fi

# The config travels with the repo, so it must be inside it; launch.py runs from the copy's root.
CONFIG_PATH=$(config_file "$CONFIG")
case $CONFIG_PATH in
  "$REPO"/*) CONFIG=${CONFIG#"$REPO"/} ;;
  /*) die "--config=$CONFIG is outside this repo ($REPO), and only the repo is copied to the workers." ;;
esac
[[ -f $REPO/$(config_file "$CONFIG") ]] ||
  die "--config=$CONFIG: no file $REPO/$(config_file "$CONFIG") (give the path inside the repo, e.g. configs/default.py)."
EXTRA_REQUIREMENTS=''
case $WORKDIR in
  gs://*) EXTRA_REQUIREMENTS=' -r ~/jax-launch/requirements-gcs.txt' ;;  # gcsfs: trainer/base/storage.py.
  /*) ;;
  *) die "--workdir=$WORKDIR must be a gs:// URL or an absolute path on storage every worker mounts at the same" \
    "place." ;;
esac

# jax[tpu] at the jax version pinned in requirements.txt (0.10.2): its extra pulls
# libtpu, the TPU runtime (libtpu==0.0.42.* for jax 0.10.2), which requirements.txt,
# pinned for CPU, leaves out. One pip call so both resolve together.
JAX_VERSION=$(sed -n 's/^jax==\([0-9][0-9.]*\).*/\1/p' "$REPO/requirements.txt")
[[ -n $JAX_VERSION ]] || die "no 'jax==VERSION' line in $REPO/requirements.txt."

LOG_DIR=${LOG_DIR:-tpu_logs/$NAME}
need_tool gcloud 'install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) and run gcloud auth login.'
TPU_VM=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
if [[ -n $PROJECT ]]; then WHERE+=(--project="$PROJECT"); fi

# 1. Create the TPU VM, or reuse it if it exists with the requested type.
show "${TPU_VM[@]}" describe "$NAME" "${WHERE[@]}" '--format=value(acceleratorType)'
if ((DRY_RUN)); then
  printf '+ %s  # only if the describe above finds no TPU %s\n' "$(quote "${TPU_VM[@]}" create "$NAME" "${WHERE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$VERSION")" "$NAME"
else
  existing=$("${TPU_VM[@]}" describe "$NAME" "${WHERE[@]}" '--format=value(acceleratorType)' 2>/dev/null) || existing=''
  if [[ -z $existing ]]; then
    run "${TPU_VM[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR_TYPE" --version="$VERSION"
  elif [[ ${existing##*/} != "$ACCELERATOR_TYPE" ]]; then
    die "TPU $NAME in $ZONE exists as ${existing##*/}, not $ACCELERATOR_TYPE: choose another --name, or delete it with" \
      "gcloud compute tpus tpu-vm delete $NAME --zone=$ZONE."
  else
    echo "Reusing TPU $NAME ($existing) in $ZONE."
  fi
fi

# 2. A clean copy of the repo (no git history, virtualenvs, caches or run outputs),
#    replacing the previous one on every worker.
STAGE=${TMPDIR:-/tmp}
STAGE=${STAGE%/}/jax-launch-tpu-$NAME
run rm -rf "$STAGE"
run mkdir -p "$STAGE/jax-launch"
run_line "tar -C $(quote "$REPO") --exclude=.git --exclude='.venv*' --exclude=__pycache__ --exclude=.pytest_cache \
--exclude=tpu_logs --exclude=workdir --exclude=workdirs --exclude=runs -cf - . | tar -C $(quote "$STAGE/jax-launch") -xf -"
run "${TPU_VM[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all \
  --command='rm -rf ~/jax-launch ~/jax-launch-logs && mkdir -p ~/jax-launch-logs'
run "${TPU_VM[@]}" scp --recurse "$STAGE/jax-launch" "$NAME:" "${WHERE[@]}" --worker=all

# 3. Install on every worker. The TPU VM images are Ubuntu 22.04 with Python 3.10,
#    and jax 0.10 needs 3.11+, so python3.11 comes from apt when python3 is older.
install="set -e; PY=python3; if ! python3 -c \"import sys; sys.exit(sys.version_info < (3, 11))\"; then \
sudo apt-get -o DPkg::Lock::Timeout=300 update -qq \
&& sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq python3.11 python3.11-venv; \
PY=python3.11; fi; [ -x ~/jax-launch-venv/bin/python ] || \$PY -m venv ~/jax-launch-venv; \
~/jax-launch-venv/bin/pip install -q -r ~/jax-launch/requirements.txt$EXTRA_REQUIREMENTS \"jax[tpu]==$JAX_VERSION\""
run "${TPU_VM[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$install"

# 4. Train: the same command on every worker at once. Each tees its output to
#    ~/jax-launch-logs/worker-N.log, N from the TPU metadata (what jax uses too).
train="set -o pipefail; w=\$(curl -sf -H \"Metadata-Flavor: Google\" \
http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname); \
cd ~/jax-launch && ~/jax-launch-venv/bin/python launch.py \
$(quote "--config=$CONFIG" "--workdir=$WORKDIR" ${OVERRIDES[@]+"${OVERRIDES[@]}"}) 2>&1 | tee ~/jax-launch-logs/worker-\$w.log"
status=0 interrupted=0
trap 'interrupted=1' INT
run "${TPU_VM[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$train" || status=$?
trap - INT

# 5. Bring the logs back, one folder per worker, whether the run succeeded or not.
count_workers="$(quote "${TPU_VM[@]}" describe "$NAME" "${WHERE[@]}" '--format=value(networkEndpoints[].ipAddress)') \
| tr ';' '\n' | grep -c ."
# shellcheck disable=SC2034  # n_workers is read by the eval'd loop below.
run_line "n_workers=\$($count_workers)" || n_workers=0
run_line "for ((w = 0; w < n_workers; w++)); do mkdir -p $(quote "$LOG_DIR")/worker-\$w && \
$(quote "${TPU_VM[@]}" scp "$NAME:jax-launch-logs/worker-")\$w.log $(quote "$LOG_DIR")/worker-\$w/ \
$(quote "${WHERE[@]}") --worker=\$w; done" || echo "$SCRIPT: some worker logs could not be copied back." >&2
if ((!DRY_RUN)); then
  echo "Per-worker logs: $LOG_DIR/worker-N/worker-N.log; metrics and checkpoints: $WORKDIR"
fi
if ((interrupted)); then exit 130; fi
exit "$status"
