"""A multi-process group restarts together (issue 39, item 5): scripts/launch_local.py, 2 processes x 4 devices.

kill -9 of one process's launch.py (its supervisor, so its training child dies with it): the survivor's supervisor
restarts its own child after the lost peer, and launch_local starts the killed launch.py again instead of stopping
the survivor mid-start-up (which ended in a C++ abort, exit 137). Both resume from the same checkpoint and finish.
A frozen member (SIGSTOP of process 1's training child, which freezes its own hang watch and its peer heartbeat):
process 0 names it lost, process 1's supervisor ends it on its own timer over the heartbeat, and the group restarts
and resumes from the same checkpoint. A join that times out after every process checked in is one line with the
exit the supervisor retries. Under SLURM (scripts/slurm_train.sbatch, run with a fake srun that starts its tasks on this
host with SLURM's variables, so jax detects the cluster): a killed member's supervisor restarts it, the survivor names
it in one line (exit 75; it was a Gloo traceback, classed a crash) and restarts its own; both resume from the same
checkpoint. An elastic SLURM job (--elastic_min_nodes) that loses a node's task for good runs a second srun on the
node left, which trains on as 1 of the run's 2 processes; what it does with each other ending (a node gone without
a status, one SLURM took out of the job, too few left, a user error) is checked with a stand-in for launch.py.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import pytest

from conftest import REPO, free_port, launcher_env, make_text_dir, watch_command, xla_flags
from parallel import distributed
from trainer.supervision import supervisor

STEPS = 16  # The kill or freeze sent once the log shows step 7 races the run: 9 steps of margin on a fast machine.
# LAUNCH_TEST_FAULT kills process 1 inside its step 7 itself, with no race against the log: 10 steps keep checkpoint 5
# before the kill and 10 after it. Each step of 2 x 4 devices costs about 0.3 s of CPU (gloo over loopback).
INJECTED_STEPS = 10


def _launch_py_of(launcher_pid: int, process_id: int) -> int:
  for child in pathlib.Path(f'/proc/{launcher_pid}/task/{launcher_pid}/children').read_text().split():
    if f'--process_id={process_id}' in pathlib.Path(f'/proc/{child}/cmdline').read_text():
      return int(child)
  raise AssertionError(f'no launch.py of process {process_id} under {launcher_pid}')


def test_kill_9_of_one_supervisor_restarts_the_group_and_it_resumes_together(tmp_path):
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  workdir = tmp_path / 'run'
  killed = []

  def on_line(proc, line):
    if not killed and re.match(r'\[0\] .*step 7/', line):  # Process 0 logs the steps.
      os.kill(_launch_py_of(proc.pid, 1), signal.SIGKILL)
      killed.append(line)

  result, lines = watch_command(
      [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes=2', '--devices_per_process=4',
       '--config=configs/tiny.py', f'--workdir={workdir}', f'--config.train.steps={STEPS}',
       '--config.ckpt.every_steps=5', '--config.ckpt.async_save=False', '--config.log.every_steps=1',
       f'--config.data.text_dir={text_dir}', '--max_restarts=2', '--restart_backoff_s=1'],
      launcher_env(LAUNCH_MAX_RESTARTS='2'), on_line, 500)
  assert killed, result.stderr[-3000:]
  assert result.returncode == 0, result.stderr[-5000:]
  for noise in ('Fatal Python error', 'Aborted'):
    assert noise not in result.stderr, result.stderr[-5000:]
  assert sum(l.startswith('launch_local.py: restarting: the launch.py of process 1 was killed by SIGKILL')
             for _, l in lines) == 1
  records = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [r['cause'] for r in records] == ['lost peer', 'finished'], records
  assert records[1]['resumed_step'] == 5  # The checkpoint both processes had when process 1 was lost.
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())[-1] == STEPS


def _training_child_of(launch_py_pid: int) -> int:
  [child] = pathlib.Path(f'/proc/{launch_py_pid}/task/{launch_py_pid}/children').read_text().split()
  return int(child)


def test_a_frozen_member_is_ended_by_its_supervisor_and_the_group_resumes_together(tmp_path):
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  workdir = tmp_path / 'run'
  frozen = []

  def on_line(proc, line):
    if not frozen and re.match(r'\[0\] .*step 7/', line):
      os.kill(_training_child_of(_launch_py_of(proc.pid, 1)), signal.SIGSTOP)
      frozen.append(line)

  result, lines = watch_command(
      [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes=2', '--devices_per_process=4',
       '--config=configs/tiny.py', f'--workdir={workdir}', f'--config.train.steps={STEPS}',
       '--config.ckpt.every_steps=5', '--config.ckpt.async_save=False', '--config.log.every_steps=1',
       '--config.train.hang_timeout_s=30', f'--config.data.text_dir={text_dir}', '--max_restarts=2',
       '--restart_backoff_s=1'],
      launcher_env(LAUNCH_MAX_RESTARTS='2'), on_line, 900)  # A hang guard only.
  assert frozen, result.stderr[-3000:]
  assert result.returncode == 0, result.stderr[-5000:]
  for noise in ('Fatal Python error', 'Aborted', 'Traceback'):
    assert noise not in result.stderr, result.stderr[-5000:]
  # The frozen process's own supervisor ends it, in one line; process 0 names the lost process.
  hang = [l for _, l in lines if l.startswith('[1] launch.py: hang: attempt 1: no progress for')]
  assert len(hang) == 1 and 'limit 30s' in hang[0], result.stderr[-5000:]
  assert not any(l.startswith('[0] launch.py: hang:') for _, l in lines)
  assert any(re.match(r'\[0\] .*process 1 of 2 .*was lost', l) for _, l in lines), result.stderr[-5000:]
  records = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [r['cause'] for r in records] == ['lost peer', 'finished'], records
  assert records[1]['resumed_step'] == 5  # The checkpoint both processes had when process 1 froze.
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())[-1] == STEPS


# srun on one host: its --ntasks (else FAKE_NTASKS) tasks with SLURM's variables, spread over the nodes of its
# --nodelist (names only: every task runs here), each task's output appended to FAKE_LOGS/taskN.log, its own options
# appended to FAKE_LOGS/srun.calls, --kill-on-bad-exit as SLURM documents it (a task ending non-zero ends the others:
# SIGTERM here) and SLURM's exit code: the highest of its tasks'.
_FAKE_SRUN = r'''#!/usr/bin/env bash
set -uo pipefail
kill_on_bad=0 ntasks=$FAKE_NTASKS nodes=localhost worst=0 own=()
while [[ $1 == --* ]]; do
  own+=("$1")
  case $1 in
    --kill-on-bad-exit=1) kill_on_bad=1 ;;
    --ntasks=*) ntasks=${1#*=} ;;
    --nodelist=*) nodes=${1#*=} ;;
  esac
  shift
done
echo "${own[*]}" >>"$FAKE_LOGS/srun.calls"
IFS=, read -ra node_of <<<"$nodes"
per_node=$((ntasks / ${#node_of[@]}))
declare -A task_of
for ((t = 0; t < ntasks; t++)); do
  SLURM_PROCID=$t SLURM_LOCALID=$((t % per_node)) SLURM_NTASKS=$ntasks SLURM_STEP_NODELIST=localhost \
    SLURMD_NODENAME=${node_of[t / per_node]} "$@" >>"$FAKE_LOGS/task$t.log" 2>&1 &
  task_of[$!]=$t
done
while ((${#task_of[@]})); do
  wait -n -p ended; rc=$?
  task=${task_of[$ended]}; unset "task_of[$ended]"
  echo "srun: task $task exited with code $rc"
  ((rc > worst)) && worst=$rc
  if ((rc && kill_on_bad)); then
    for pid in "${!task_of[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    wait; exit "$rc"
  fi
done
exit "$worst"
'''
# scontrol for the fake job: node lists are plain comma lists; the job's nodes are FAKE_JOB_NODES (those SLURM left
# it), else all it was given.
_FAKE_SCONTROL = r'''#!/usr/bin/env bash
case "$1 $2" in
  'show hostnames') tr , '\n' <<<"$3" ;;
  'show job') echo "   NodeList=${FAKE_JOB_NODES:-$SLURM_JOB_NODELIST} BatchHost=localhost" ;;
esac
'''


def _slurm_job(tmp_path, *args: str, python: str = sys.executable) -> tuple[pathlib.Path, dict]:
  # The job file scripts/launch_slurm.sh writes for a 2-node job of the tiny config, and an environment whose srun
  # and scontrol are the fakes above.
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  logs, bin_dir = tmp_path / 'logs', tmp_path / 'bin'
  logs.mkdir()
  bin_dir.mkdir()
  for name, body in (('srun', _FAKE_SRUN), ('scontrol', _FAKE_SCONTROL)):
    (bin_dir / name).write_text(body)
    (bin_dir / name).chmod(0o755)
  env = launcher_env(JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags(4))
  dry = subprocess.run(
      ['bash', str(REPO / 'scripts' / 'launch_slurm.sh'), '--nodes=2', '--gpus_per_node=4',
       '--config=configs/tiny.py', f'--workdir={tmp_path / "run"}', f'--python={python}',
       '--config.ckpt.async_save=False', '--config.log.every_steps=1', f'--config.data.text_dir={text_dir}',
       '--restart_backoff_s=1', *args, '--dry_run'], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert dry.returncode == 0, dry.stderr
  job = tmp_path / 'job.sbatch'
  job.write_text(dry.stdout.split("<<'SBATCH_EOF'\n", 1)[1].split('\nSBATCH_EOF\n', 1)[0] + '\n')
  return job, {**env, 'PATH': f'{bin_dir}{os.pathsep}{env["PATH"]}', 'FAKE_NTASKS': '2', 'FAKE_LOGS': str(logs),
               'SLURM_JOB_ID': '77', 'SLURM_JOB_NAME': 'jax-launch', 'SLURM_JOB_NODELIST': 'node1,node2',
               'JAX_COORDINATOR_PORT': str(free_port())}


def test_under_slurm_a_killed_member_restarts_and_the_group_resumes_together(tmp_path):
  workdir, logs = tmp_path / 'run', tmp_path / 'logs'
  job, env = _slurm_job(tmp_path, f'--config.train.steps={INJECTED_STEPS}', '--config.ckpt.every_steps=5',
                        '--max_restarts=2')
  run_env = {**env, 'LAUNCH_TEST_FAULT': 'kill@7,process=1,attempt=1'}
  # cwd: what #SBATCH --chdir does under sbatch. The timeout is a hang guard only.
  result = subprocess.run(['bash', str(job)], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=900)
  task_logs = [(logs / f'task{t}.log').read_text() for t in range(2)]
  assert result.returncode == 0, result.stdout + task_logs[0][-3000:] + task_logs[1][-3000:]
  assert result.stdout.splitlines()[-2:] in (['srun: task 0 exited with code 0', 'srun: task 1 exited with code 0'],
                                             ['srun: task 1 exited with code 0', 'srun: task 0 exited with code 0'])
  # The killed member's own supervisor restarted it; the survivor named it in one line (the peer watchdog, also in a
  # launch jax's detection joined) and its supervisor restarted its own.
  assert 'launch.py: restarting: attempt 1 ended with killed by SIGKILL (exit -9)' in task_logs[1], task_logs[1][-3000:]
  said = [l for l in task_logs[0].splitlines() if l.startswith('launch.py: error:')]
  assert said == ['launch.py: error: process 1 of 2 was lost (its connection closed: the process exited or was '
                  'killed); this run cannot continue without it. Stopped; relaunch every process with the same '
                  'command to resume from the last checkpoint.'], task_logs[0][-3000:]
  assert all('Traceback' not in log for log in task_logs), task_logs[0][-3000:] + task_logs[1][-3000:]
  records = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [(r['cause'], r['exit_code'], r['retried']) for r in records] == [('lost peer', 75, True),
                                                                           ('finished', 0, False)], records
  assert records[1]['resumed_step'] == 5, records
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())[-1] == INJECTED_STEPS



def test_under_slurm_a_lost_node_leaves_a_step_on_the_nodes_left(tmp_path):
  """--elastic_min_nodes=1: node2's task lost for good at step 6; node1's, short of its peer, ends 76, and a second
  srun on node1 alone trains on as 1 of the run's 2 processes, with gradient accumulation 2, to the end."""
  workdir, logs = tmp_path / 'run', tmp_path / 'logs'
  job, env = _slurm_job(tmp_path, '--config.train.steps=9', '--config.ckpt.every_steps=3', '--max_restarts=1',
                        '--elastic_min_nodes=1', '--distributed_timeout_s=12')
  assert '\n#SBATCH --no-kill\n' in job.read_text()
  result = subprocess.run(['bash', str(job)], cwd=REPO, env={**env, 'LAUNCH_TEST_FAULT': 'lose@6,process=1'},
                          capture_output=True, text=True, timeout=900)
  task_logs = [(logs / f'task{t}.log').read_text() for t in range(2)]
  assert result.returncode == 0, result.stderr + task_logs[0][-3000:] + task_logs[1][-3000:]
  assert [l for l in result.stderr.splitlines() if l.startswith('slurm_train.sbatch:')] == [
      "slurm_train.sbatch: elastic: task 1 on node2 exited with code 137; starting a step on the 1 node(s) left "
      "(node1) as 1 of the run's 2 processes, from its newest checkpoint at the same global batch (resubmitting the "
      "job file with every node grows it back)."], result.stderr
  calls = (logs / 'srun.calls').read_text().splitlines()
  assert [re.findall(r'--(?:ntasks|nodelist)=\S+', c) for c in calls] == [
      ['--ntasks=2', '--nodelist=node1,node2'], ['--ntasks=1', '--nodelist=node1']], calls
  assert all(c.startswith('--no-kill --kill-on-bad-exit=0 ') for c in calls), calls
  assert ("Elastic: running on 1 of the run's 2 processes: mesh.data 8 -> 4, train.grad_accum_steps 1 -> 2"
          in task_logs[0]), task_logs[0][-3000:]
  records = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [(r['exit_code'], r['retried']) for r in records] == [(75, True), (76, False), (0, False)], records
  assert records[2].get('resized') == '2 -> 1 processes' and records[2]['grad_accum_steps'] == 2, records
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())[-1] == 9


@pytest.mark.parametrize('on_node2, job_nodes, min_nodes, code, said', [
    # Node2 gone with its task's shell: no exit status at all.
    ('kill -9 $PPID', '', 1, 0, "slurm_train.sbatch: elastic: node2 was lost (no task exit status); starting a step on "
     "the 1 node(s) left (node1) as 1 of the run's 2 processes"),
    # Its task alive, but SLURM took the node out of the --no-kill job (a node failure).
    ('exit 75', 'node1', 1, 0, "slurm_train.sbatch: elastic: node2 was taken out of the job by SLURM; starting a step "
     "on the 1 node(s) left (node1)"),
    ('exit 1', '', 2, 76, "slurm_train.sbatch: error: task 1 on node2 exited with code 1: 1 node(s) left, fewer than "
     "--elastic_min_nodes=2; resubmit "),
    ('exit 2', '', 1, 2, 'slurm_train.sbatch: error: task 1 on node2 exited with code 2; see its log.'),  # User error.
])
def test_under_slurm_what_the_elastic_job_does_with_each_ending(tmp_path, on_node2, job_nodes, min_nodes, code, said):
  """A stand-in for launch.py (no jax): on the 2-node step node1's task ends 76 and node2's as given; alone, 0."""
  python = tmp_path / 'python'
  python.write_text(f'#!/usr/bin/env bash\nif ((SLURM_NTASKS == 1)); then exit 0; fi\n'
                    f'if [[ $SLURMD_NODENAME == node2 ]]; then {on_node2}; fi\nexit 76\n')
  python.chmod(0o755)
  job, env = _slurm_job(tmp_path, f'--elastic_min_nodes={min_nodes}', python=str(python))
  result = subprocess.run(['bash', str(job)], cwd=REPO, env={**env, 'FAKE_JOB_NODES': job_nodes}, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == code, result.stderr
  lines = [l for l in result.stderr.splitlines() if l.startswith('slurm_train.sbatch:')]
  assert len(lines) == 1 and lines[0].startswith(said), result.stderr
  assert len((tmp_path / 'logs' / 'srun.calls').read_text().splitlines()) == (2 if code == 0 else 1)

# gcloud for a TPU pod slice of FAKE_WORKERS workers on one host: `ssh --worker=all` runs the command once per worker,
# each its own process with its own home (FAKE_HOMES/wN, where `scp --recurse` copies the repo), and with what jax's
# TPU detection reads from a pod's environment (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_*, as on GKE; else it
# asks the metadata server; JAX_FORCE_TPU_INIT stands in for the TPU chips this host lacks). The install is skipped: each worker's ~/jax-launch-venv is this venv. A fake curl answers the
# script's metadata query for the worker number.
_FAKE_GCLOUD = r"""#!/usr/bin/env bash
set -uo pipefail
verb=$4 worker='' command=''
for arg in "$@"; do
  case $arg in --worker=*) worker=${arg#*=} ;; --command=*) command=${arg#*=} ;; esac
done
case $verb in
  describe) [[ $* == *acceleratorType* ]] && echo "$FAKE_TPU_TYPE" || echo '127.0.0.1;127.0.0.1' ;;
  scp)
    if [[ $5 == --recurse ]]; then
      for ((w = 0; w < FAKE_WORKERS; w++)); do cp -r "$6" "$FAKE_HOMES/w$w/"; done
    else
      cp "$FAKE_HOMES/w$worker/${5#*:}" "$6/"
    fi ;;
  ssh)
    [[ $command == *'pip install'* ]] && exit 0
    hosts=$(printf 'localhost,%.0s' $(seq "$FAKE_WORKERS")); pids=()
    for ((w = 0; w < FAKE_WORKERS; w++)); do
      HOME=$FAKE_HOMES/w$w TPU_WORKER_ID=$w TPU_WORKER_HOSTNAMES=${hosts%,} JAX_FORCE_TPU_INIT=1 \
        MEGASCALE_COORDINATOR_ADDRESS=localhost MEGASCALE_NUM_SLICES=1 MEGASCALE_SLICE_ID=0 bash -c "$command" >"$FAKE_HOMES/w$w.out" 2>&1 &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    exit "$rc" ;;
esac
"""


def test_on_a_tpu_pod_a_killed_member_restarts_and_the_group_resumes_together(tmp_path):
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  workdir, homes, bin_dir = tmp_path / 'run', tmp_path / 'homes', tmp_path / 'bin'
  bin_dir.mkdir()
  for name, body in (('gcloud', _FAKE_GCLOUD), ('curl', '#!/usr/bin/env bash\necho "$TPU_WORKER_ID"\n')):
    (bin_dir / name).write_text(body)
    (bin_dir / name).chmod(0o755)
  for w in range(2):
    (homes / f'w{w}').mkdir(parents=True)
    (homes / f'w{w}' / 'jax-launch-venv').symlink_to(pathlib.Path(sys.prefix))
  env = {**launcher_env(JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags(4)),
         'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'FAKE_WORKERS': '2', 'FAKE_HOMES': str(homes),
         'FAKE_TPU_TYPE': 'v4-16', 'TMPDIR': str(tmp_path), 'JAX_COORDINATOR_PORT': str(free_port()),
         'LAUNCH_TEST_FAULT': 'kill@7,process=1,attempt=1'}
  result = subprocess.run(
      ['bash', str(REPO / 'scripts' / 'launch_tpu_pod.sh'), '--name=pod', '--zone=us-east5-a',
       '--accelerator_type=v4-16', '--config=configs/tiny.py', f'--workdir={workdir}', f'--log_dir={tmp_path / "logs"}',
       f'--config.train.steps={INJECTED_STEPS}', '--config.ckpt.every_steps=5', '--config.ckpt.async_save=False',
       '--config.log.every_steps=1', f'--config.data.text_dir={text_dir}', '--max_restarts=2',
       '--restart_backoff_s=1'], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)  # A hang guard.
  logs = [(tmp_path / 'logs' / f'worker-{w}' / f'worker-{w}.log').read_text() for w in range(2)]
  assert result.returncode == 0, result.stderr[-2000:] + logs[0][-3000:] + logs[1][-3000:]
  for w in range(2):  # jax's TPU detection joined them, each attempt.
    assert logs[w].count(f'Joined 2 processes as process {w} (TPU pod, detected)') == 2, logs[w][-3000:]
  assert 'launch.py: restarting: attempt 1 ended with killed by SIGKILL (exit -9)' in logs[1], logs[1][-3000:]
  said = [l for l in logs[0].splitlines() if l.startswith('launch.py: error:')]
  assert len(said) == 1 and said[0].startswith('launch.py: error: process 1 of 2 was lost'), logs[0][-3000:]
  assert all('Traceback' not in log for log in logs), logs[0][-3000:] + logs[1][-3000:]
  records = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [(r['cause'], r['exit_code'], r['retried']) for r in records] == [('lost peer', 75, True),
                                                                           ('finished', 0, False)], records
  assert records[1]['resumed_step'] == 5, records
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())[-1] == INJECTED_STEPS


def test_a_join_that_times_out_after_check_in_is_one_line_and_retried(monkeypatch):
  def timed_out(*args, **kwargs):
    raise RuntimeError('DEADLINE_EXCEEDED: Barrier timed out.\nId: PjRT_Client_Connect\nAdditional GRPC error...')

  monkeypatch.setattr(distributed, '_check_in', lambda *args: None)
  monkeypatch.setattr(distributed, '_use_cpu_collectives', lambda: None)
  monkeypatch.setattr(distributed.jax.distributed, 'initialize', timed_out)
  with pytest.raises(distributed.JoinTimedOut) as raised:
    distributed.initialize('127.0.0.1:1234', 2, 1, 5)
  message = str(raised.value)
  assert '\n' not in message and 'process 1 of 2: joining the coordinator at 127.0.0.1:1234' in message
  assert 'DEADLINE_EXCEEDED: Barrier timed out.' in message and '--distributed_timeout_s=5' in message
  assert supervisor.classify(raised.value.exit_code, {}) == (True, 'lost peer')


def test_any_other_join_failure_keeps_its_own_error(monkeypatch):
  def broken(*args, **kwargs):
    raise ValueError('a bug')

  monkeypatch.setattr(distributed, '_check_in', lambda *args: None)
  monkeypatch.setattr(distributed, '_use_cpu_collectives', lambda: None)
  monkeypatch.setattr(distributed.jax.distributed, 'initialize', broken)
  with pytest.raises(ValueError, match='a bug'):
    distributed.initialize('127.0.0.1:1234', 2, 1, 5)


def test_a_detected_launch_whose_watchdog_cannot_be_reached_goes_on_with_one_warning(monkeypatch):
  """A cluster whose firewall blocks process 0's watchdog port: the run goes on as before the watchdog, warned."""
  from jax._src import distributed as jax_distributed
  from parallel import watchdog

  class Client:
    def key_value_set(self, key, value):
      self.port = value

    def blocking_key_value_get(self, key, timeout_ms):
      return str(free_port())  # Nothing listens there: the connect is refused.

  warnings = []
  monkeypatch.setattr(watchdog, '_watching', threading.Event())
  monkeypatch.setattr(jax_distributed.global_state, 'client', Client())
  monkeypatch.setattr(jax_distributed.global_state, 'coordinator_address', '127.0.0.1:1')
  monkeypatch.setattr(distributed.logging, 'warning', lambda text, *args: warnings.append(text % args))
  monkeypatch.setattr(distributed.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(distributed.jax, 'process_index', lambda: 1)
  distributed._watch_detected(5)
  assert len(warnings) == 1 and warnings[0].startswith(
      'The peer watchdog could not be set up (ConnectionRefusedError: '), warnings
  assert not watchdog._watching.is_set()  # No lost-peer grace is waited for a watchdog that is not there.
  # Process 0: nobody connects within the timeout; one warning from its thread, no thread traceback.
  server = distributed._listen(0)
  distributed._serve_or_warn(server, 2, 1)
  assert len(warnings) == 2 and warnings[1].startswith('The peer watchdog could not be set up (TimeoutError'), warnings
