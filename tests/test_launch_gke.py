"""scripts/launch_gke.py and parallel/jobset.py: the JobSet manifests (checked against the JobSet CRD's schema), the
xpk command (checked against xpk's flags), the refusals, and the pods' commands run here as processes.

The CRD's schema is stored (tests/fixtures/jobset_crd_schema.json, its $comment says from where): CI reaches PyPI only.
"""

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys

import jsonschema
import pytest
import yaml

from conftest import REPO, free_port, launcher_env, read_metrics, xla_flags
from parallel import jobset

sys.path.insert(0, str(REPO / 'scripts'))
import launch_gke  # pylint: disable=wrong-import-position

COMMON = ('--image=us-docker.pkg.dev/p/r/jax-launch:1', '--config=configs/tiny.py', '--workdir=gs://bucket/run1')
V5P = ('--name=v5p-run', '--accelerator=v5p', '--topology=2x2x2')
V5E_TWO_SLICES = ('--name=v5e-run', '--accelerator=v5e', '--topology=2x4', '--num_slices=2',
                  '--config.train.batch_size=16', '--config.mesh.dcn_data=2')
A3_TWO_NODES = ('--name=a3-run', '--accelerator=a3', '--num_nodes=2', '--config.train.batch_size=16')


def _strict(schema):
  """The CRD's schema as `kubectl apply` (strict field validation, its default) holds a manifest to: an object's
  unknown field is an error, not silently dropped, except where the CRD keeps unknown fields."""
  if isinstance(schema, dict):
    schema = {k: _strict(v) for k, v in schema.items()}
    if 'properties' in schema and 'additionalProperties' not in schema and \
        not schema.get('x-kubernetes-preserve-unknown-fields'):
      schema['additionalProperties'] = False
    return schema
  return [_strict(v) for v in schema] if isinstance(schema, list) else schema


SCHEMA = _strict(json.loads((REPO / 'tests/fixtures/jobset_crd_schema.json').read_text()))
jsonschema.Draft7Validator.check_schema(SCHEMA)  # Once: jsonschema.validate would check the 73 KB schema each call.
CRD = jsonschema.Draft7Validator(SCHEMA)


def _dry_run(capsys, *args: str) -> dict:
  assert launch_gke.main([*COMMON, *args, '--dry_run']) == 0
  return yaml.safe_load(capsys.readouterr().out)


def _container(manifest: dict, job: int = 0) -> dict:
  (container,) = manifest['spec']['replicatedJobs'][job]['template']['spec']['template']['spec']['containers']
  return container


def _env(container: dict) -> dict:
  return {e['name']: e.get('value', e.get('valueFrom')) for e in container['env']}


@pytest.mark.parametrize('args', [V5P, V5E_TWO_SLICES, A3_TWO_NODES], ids=['v5p-2x2x2', 'v5e-2x4-x2', 'a3-x2'])
def test_the_manifests_validate_against_the_jobset_crd(capsys, args):
  manifest = _dry_run(capsys, *args)
  CRD.validate(manifest)
  broken = copy.deepcopy(manifest)  # The check can fail: a misspelt field, a wrong type.
  broken['spec']['replicatedJobs'][0]['template']['spec']['parallelizm'] = 2
  with pytest.raises(jsonschema.ValidationError, match='parallelizm'):
    CRD.validate(broken)
  broken = copy.deepcopy(manifest)
  broken['spec']['failurePolicy']['maxRestarts'] = 'once'
  with pytest.raises(jsonschema.ValidationError):
    CRD.validate(broken)


def _restart_policy_is_the_jobsets(manifest: dict, hosts: int) -> None:
  """Who restarts what: launch.py runs unsupervised, any pod failure fails its Job, and the JobSet recreates the
  group once; the exits a restart cannot fix end the JobSet."""
  assert manifest['spec']['failurePolicy']['maxRestarts'] == 1
  assert manifest['spec']['failurePolicy']['rules'] == [
      {'name': 'final-exit-codes', 'action': 'FailJobSet', 'onJobFailureReasons': ['PodFailurePolicy']}]
  job = manifest['spec']['replicatedJobs'][0]['template']['spec']
  assert (job['parallelism'], job['completions'], job['completionMode'], job['backoffLimit']) == (
      hosts, hosts, 'Indexed', 0)
  assert job['podFailurePolicy']['rules'][0]['onExitCodes'] == {'containerName': 'train', 'operator': 'In',
                                                                 'values': [2, 3, 130]}
  assert job['template']['spec']['restartPolicy'] == 'Never'
  container = _container(manifest)
  assert container['args'][:3] == ['--config=configs/tiny.py', '--workdir=gs://bucket/run1', '--max_restarts=0']
  assert container['command'][:2] == ['/bin/sh', '-c'] and 'exec python launch.py "$@"' in container['command'][2]


def test_a_v5p_2x2x2_slice_is_two_hosts_of_four_chips(capsys):
  manifest = _dry_run(capsys, *V5P)
  _restart_policy_is_the_jobsets(manifest, hosts=2)
  (job,) = manifest['spec']['replicatedJobs']
  pod = job['template']['spec']['template']['spec']
  assert job['replicas'] == 1 and 'serviceAccountName' not in pod
  assert pod['nodeSelector'] == {'cloud.google.com/gke-tpu-accelerator': 'tpu-v5p-slice',
                                 'cloud.google.com/gke-tpu-topology': '2x2x2'}
  assert _container(manifest)['resources'] == {'limits': {'google.com/tpu': 4}}
  env = _env(_container(manifest))
  assert env['NUM_PROCESSES'] == '2' and env['PROCESSES_PER_SLICE'] == '2'
  assert env['COORDINATOR_ADDRESS'] == 'v5p-run-slice-0-0.v5p-run:1234'
  assert env['TPU_WORKER_HOSTNAMES'] == 'v5p-run-slice-$(JOB_INDEX)-0.v5p-run,v5p-run-slice-$(JOB_INDEX)-1.v5p-run'
  assert env['TPU_WORKER_ID'] == '$(JOB_COMPLETION_INDEX)'
  assert not any(k.startswith('MEGASCALE') for k in env)  # One slice: no DCN.
  assert manifest['metadata']['annotations'] == {
      'alpha.jobset.sigs.k8s.io/exclusive-topology': 'cloud.google.com/gke-nodepool'}


def test_two_v5e_slices_are_two_replicated_jobs_joined_by_megascale(capsys):
  manifest = _dry_run(capsys, *V5E_TWO_SLICES, '--queue=team-a')
  _restart_policy_is_the_jobsets(manifest, hosts=2)
  (job,) = manifest['spec']['replicatedJobs']
  assert job['replicas'] == 2
  assert job['template']['spec']['template']['spec']['nodeSelector'] == {
      'cloud.google.com/gke-tpu-accelerator': 'tpu-v5-lite-podslice', 'cloud.google.com/gke-tpu-topology': '2x4'}
  env = _env(_container(manifest))
  assert env['NUM_PROCESSES'] == '4'
  assert env['JOB_INDEX'] == {'fieldRef': {'fieldPath': "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
  assert (env['MEGASCALE_NUM_SLICES'], env['MEGASCALE_SLICE_ID'], env['MEGASCALE_COORDINATOR_ADDRESS']) == (
      '2', '$(JOB_INDEX)', 'v5e-run-slice-0-0.v5e-run')
  assert {p['containerPort'] for p in _container(manifest)['ports']} == {1234, 8471, 8080}
  assert _container(manifest)['args'][3:] == ['--config.train.batch_size=16', '--config.mesh.dcn_data=2']
  assert manifest['metadata']['labels']['kueue.x-k8s.io/queue-name'] == 'team-a'



def test_an_elastic_relaunch_on_the_slices_left_tells_launch_py_the_full_size(capsys):
  """One v5e slice left of two: a one-slice JobSet (no MEGASCALE), each launch.py told the 4 processes of the full
  run, and the waiting slices' exit 76 ends the JobSet instead of recreating a group that would wait again."""
  assert launch_gke.main([*COMMON, *V5E_TWO_SLICES[:3], '--num_slices=1', '--elastic_full_slices=2',
                          '--config.train.batch_size=16', '--config.mesh.dcn_data=2', '--dry_run']) == 0
  out, err = capsys.readouterr()
  manifest = yaml.safe_load(out)
  CRD.validate(manifest)
  (job,) = manifest['spec']['replicatedJobs']
  env = _env(_container(manifest))
  assert job['replicas'] == 1 and env['NUM_PROCESSES'] == '2' and not any(k.startswith('MEGASCALE') for k in env)
  assert _container(manifest)['args'][-1] == '--elastic_full_processes=4'
  assert job['template']['spec']['podFailurePolicy']['rules'][0]['onExitCodes']['values'] == [2, 3, 130, 76]
  assert err == ("launch_gke.py: Elastic: running on 2 of the run's 4 processes: mesh.dcn_data 2 -> 1, "
                 "train.grad_accum_steps 1 -> 2; each step still takes train.batch_size examples, so the data order "
                 "and learning-rate schedule are unchanged (a relaunch with all of them grows it back).\n")

def test_two_a3_nodes_are_one_job_of_two_pods_with_eight_gpus(capsys):
  manifest = _dry_run(capsys, *A3_TWO_NODES, '--service_account=trainer')
  _restart_policy_is_the_jobsets(manifest, hosts=2)
  (job,) = manifest['spec']['replicatedJobs']
  pod = job['template']['spec']['template']['spec']
  assert job['replicas'] == 1 and pod['nodeSelector'] == {'cloud.google.com/gke-accelerator': 'nvidia-h100-80gb'}
  assert _container(manifest)['resources'] == {'limits': {'nvidia.com/gpu': 8}}
  env = _env(_container(manifest))
  assert env['COORDINATOR_ADDRESS'] == 'a3-run-node-0-0.a3-run:1234' and env['NUM_PROCESSES'] == '2'
  assert not any(k.startswith(('TPU_', 'MEGASCALE')) for k in env)
  assert pod['volumes'] == [{'name': 'dshm', 'emptyDir': {'medium': 'Memory'}}]
  assert pod['serviceAccountName'] == 'trainer'
  assert 'annotations' not in manifest['metadata']


@pytest.mark.parametrize('args, message', [
    (('--name=r', '--accelerator=v5p', '--topology=2x4'), "--topology='2x4' is not a v5p slice"),
    (('--name=r', '--accelerator=v5e', '--topology=2x2x2'), "--topology='2x2x2' is not a v5e slice"),
    (('--name=r', '--accelerator=v4', '--topology=4x4x6'), "--topology='4x4x6' is not a v4 slice"),
    (('--name=r', '--accelerator=a3', '--num_nodes=2', '--config.train.batch_size=16', '--workdir=/mnt/runs/r'),
     "--workdir='/mnt/runs/r': a 2-host run needs a gs:// workdir"),
    (('--name=r', '--accelerator=v5e', '--topology=2x4', '--num_slices=2', '--config.mesh.dcn_data=2'),
     'train.batch_size=8 does not divide over the 16 data-parallel devices'),
    (('--name=r', '--accelerator=v5e', '--topology=2x4', '--num_slices=2', '--config.train.batch_size=16'),
     '--num_slices=2, but mesh.dcn_data x dcn_fsdp x dcn_pipeline = 1'),
    (('--name=r', '--accelerator=v5p', '--topology=2x2x2', '--config.train.batch_size=12'),
     'train.batch_size=12 does not divide over the 8 data-parallel devices of 8 (2 hosts x 4); nearest valid: 8 or 16'),
    (('--name=Run_1', '--accelerator=a3'), "--name='Run_1' must be lowercase"),
    (('--name=r', '--accelerator=tpu9', '--topology=2x2'), "--accelerator='tpu9' is not one of"),
    (('--name=r', '--accelerator=v6e'), '--accelerator=v6e is a TPU: give its slice as --topology, e.g. 2x4'),
    (('--name=r', '--accelerator=a3', '--config.train.nope=1'), '--config.train.nope=1'),
    (('--name=r', '--accelerator=v5p', '--topology=2x2x2', '--elastic_full_slices=1'),
     '--elastic_full_slices=1: the TPU slices the run is written for, 2 or more'),
    (('--name=r', '--accelerator=v5e', '--topology=2x4', '--num_slices=2', '--elastic_full_slices=3',
      '--config.mesh.dcn_data=3', '--config.train.batch_size=24'),
     'elastic: 4 of 6 processes make 16 batch-parallel devices'),  # Divides at 3 slices, not at the 2 left.
], ids=['v5p-2d', 'v5e-3d', 'v4-not-cubes', 'local-workdir', 'batch-slices', 'slices-not-on-dcn', 'batch-slice',
        'name', 'accelerator', 'no-topology', 'override', 'elastic-one-slice', 'elastic-batch'])
@pytest.mark.parametrize('mode', ['apply', 'dry_run', 'xpk'])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written_or_applied(capsys, tmp_path, monkeypatch,
                                                                                 args, message, mode):
  applied = _fake_kubectl(tmp_path, monkeypatch)
  extra = {'apply': (), 'dry_run': ('--dry_run',), 'xpk': ('--xpk', '--cluster=c')}[mode]
  assert launch_gke.main([*COMMON, *args, *extra]) == 2
  out, err = capsys.readouterr()
  assert out == '' and not applied.exists()
  assert err.count('\n') == 1 and err.startswith('launch_gke.py: error: ') and message in err, err


def _fake_kubectl(tmp_path, monkeypatch):
  """A kubectl on PATH that keeps what `apply -f -` was given; returns where."""
  bin_dir, applied = tmp_path / 'bin', tmp_path / 'applied.yaml'
  bin_dir.mkdir()
  (bin_dir / 'kubectl').write_text(f'#!/bin/sh\n[ "$*" = "apply -f -" ] || exit 9\ncat > {applied}\n')
  (bin_dir / 'kubectl').chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  return applied


def test_without_dry_run_the_manifest_goes_to_kubectl_apply(capsys, tmp_path, monkeypatch):
  applied = _fake_kubectl(tmp_path, monkeypatch)
  assert launch_gke.main([*COMMON, *V5P]) == 0
  assert yaml.safe_load(applied.read_text()) == _dry_run(capsys, *V5P)
  monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
  assert launch_gke.main([*COMMON, *V5P]) == 2
  assert 'kubectl not found on PATH' in capsys.readouterr().err


def _xpk_workload_create() -> argparse.ArgumentParser:
  """`xpk workload create`'s flags as xpk declares them (AI-Hypercomputer/xpk at 367c838, src/xpk/parser/workload.py
  and common.py: required --workload, --cluster, --command and one of --tpu-type / --device-type), strict about any
  other; the TPU keys are xpk's `{prefix}-{topology}` names (src/xpk/core/system_characteristics.py)."""
  parser = argparse.ArgumentParser(prog='xpk workload create', allow_abbrev=False)
  for flag in ('--workload', '--cluster', '--command'):
    parser.add_argument(flag, required=True)
  device = parser.add_mutually_exclusive_group(required=True)
  device.add_argument('--tpu-type', choices=['v5p-2x2x2', 'v5litepod-2x4', 'v4-2x2x2', 'v6e-2x4'])
  device.add_argument('--device-type', choices=['h100-80gb-8', 'h100-mega-80gb-8', 'h200-141gb-8'])
  parser.add_argument('--docker-image')
  parser.add_argument('--num-slices', type=int, default=1)
  parser.add_argument('--num-nodes', type=int, default=1)
  parser.add_argument('--max-restarts', type=str, default='0')
  parser.add_argument('--restart-on-exit-codes', type=str)
  parser.add_argument('--project')
  parser.add_argument('--zone')
  return parser


def _xpk(capsys, *args: str) -> argparse.Namespace:
  assert launch_gke.main([*COMMON, *args, '--xpk', '--cluster=my-cluster', '--zone=us-east5-a']) == 0
  argv = shlex.split(capsys.readouterr().out)
  assert argv[:3] == ['xpk', 'workload', 'create']
  return _xpk_workload_create().parse_args(argv[3:])


def _xpk_launch_argv(command: str, env: dict[str, str]) -> list[str]:
  """What xpk's --command runs (under bash in the container), with `python` printing its argv."""
  script = f'python() {{ printf "%s\\n" "$@"; }}\n{command}'
  return subprocess.run(['bash', '-c', script], env={**env, 'PATH': os.environ['PATH']}, capture_output=True,
                        text=True, check=True).stdout.splitlines()


def test_xpk_command_for_the_same_settings(capsys):
  tpu = _xpk(capsys, *V5E_TWO_SLICES)
  assert (tpu.workload, tpu.cluster, tpu.tpu_type, tpu.num_slices, tpu.max_restarts) == (
      'v5e-run', 'my-cluster', 'v5litepod-2x4', 2, '1')
  assert tpu.docker_image == 'us-docker.pkg.dev/p/r/jax-launch:1' and tpu.zone == 'us-east5-a'
  # xpk restarts on 42 and 127-255 only; a lost peer (75), a crash (1), a hang (124), a lost bucket (74) restart too.
  assert set(tpu.restart_on_exit_codes.split(',')) == {'1', '74', '75', '124'}
  # On TPU, jax finds the hosts from GKE's environment: no coordinator flags.
  assert _xpk_launch_argv(tpu.command, {}) == [
      'launch.py', '--config=configs/tiny.py', '--workdir=gs://bucket/run1', '--max_restarts=0',
      '--config.train.batch_size=16', '--config.mesh.dcn_data=2']
  gpu = _xpk(capsys, *A3_TWO_NODES)
  assert (gpu.device_type, gpu.num_nodes, gpu.tpu_type) == ('h100-80gb-8', 2, None)
  # xpk's GPU pods get JAX_COORDINATOR_ADDRESS, JAX_COORDINATOR_PORT and NODE_RANK (src/xpk/core/docker_resources.py).
  xpk_env = {'JAX_COORDINATOR_ADDRESS': 'a3-run-slice-job-0-0.a3-run', 'JAX_COORDINATOR_PORT': '6002', 'NODE_RANK': '1'}
  assert _xpk_launch_argv(gpu.command, xpk_env)[-3:] == [
      '--coordinator_address=a3-run-slice-job-0-0.a3-run:6002', '--num_processes=2', '--process_id=1']
  with pytest.raises(SystemExit):  # The parser is strict: a flag xpk lacks fails.
    _xpk_workload_create().parse_args(['--workload=w', '--cluster=c', '--command=x', '--tpu-type=v5p-2x2x2',
                                       '--max_restarts=1'])


def test_dockerfile_installs_the_pinned_requirements_and_runs_launch_py():
  text = (REPO / 'Dockerfile').read_text()
  run_lines = ' '.join(line for line in text.splitlines() if not line.lstrip().startswith('#'))
  for pinned in ('requirements.txt', 'requirements-gcs.txt'):
    assert f'-r {pinned}' in run_lines and (REPO / pinned).exists()
  assert 'COPY . ' in run_lines and 'WORKDIR /app' in run_lines
  # The manifest's command runs `python launch.py` from the image's working directory, the repo's copy.
  assert 'ENTRYPOINT' not in run_lines  # The JobSet gives the command; an entrypoint would wrap it.
  assert 'jax-ai-image' in text and 'import launch' in run_lines
  assert '.venv' in (REPO / '.dockerignore').read_text().split()


# The pods of a manifest, run here as processes: what the kubelet and the cluster would give each container.
FAULT = 'kill@7,process=1'  # The test hook (trainer/supervision/faults.py): pod 1's process dies at step 7.
PODS_TIMEOUT_S = 300


def _pod_env(container: dict, job_index: int, completion_index: int, dns: dict[str, str]) -> dict[str, str]:
  """The container's env as the kubelet makes it: fieldRefs read from the pod's annotations, $(VAR) expanded from
  the variables above; `dns` stands for the cluster's DNS (the headless service's names to this machine)."""
  annotations = {"metadata.annotations['jobset.sigs.k8s.io/job-index']": str(job_index),
                 "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(completion_index)}
  env: dict[str, str] = {}
  for item in container['env']:
    value = annotations[item['valueFrom']['fieldRef']['fieldPath']] if 'valueFrom' in item else item['value']
    for name, known in env.items():
      value = value.replace(f'$({name})', known)
    for host, address in dns.items():
      value = value.replace(host, address)
    env[item['name']] = value
  return env


def _start_pods(manifest: dict, workdir, dns: dict[str, str], bin_dir, extra_env: dict[str, str]) -> list:
  (job,) = manifest['spec']['replicatedJobs']
  container = _container(manifest)
  # The bucket is a local folder here (the gs:// path is checked by the tests above; tests/test_gcs.py runs one).
  args = [a.replace('gs://bucket/run1', str(workdir)) for a in container['args']]
  # The image's environment: the test's interpreter as `python`, CPU devices standing for each host's 4 chips.
  image_env = launcher_env(PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', JAX_PLATFORMS='cpu',
                           XLA_FLAGS=xla_flags(4), PYTHONUNBUFFERED='1')
  pods = []
  for j in range(job['replicas']):
    for i in range(job['template']['spec']['parallelism']):
      env = {**image_env, **_pod_env(container, j, i, dns), **extra_env}
      pods.append(subprocess.Popen([*container['command'], *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True))
  return pods


def _wait(pods: list) -> list[tuple[int, str]]:
  ended = []
  for pod in pods:
    try:
      _, err = pod.communicate(timeout=PODS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      for p in pods:
        os.killpg(p.pid, 9)
      pytest.fail(f'the pods ran past {PODS_TIMEOUT_S}s')
    ended.append((pod.returncode, err))
  return ended


def test_the_pods_train_like_launch_local_and_a_lost_pod_restarts_the_group_from_the_newest_checkpoint(
    capsys, tmp_path):
  overrides = ('--config.log.every_steps=1',)
  reference = tmp_path / 'launch_local'
  local = subprocess.run([sys.executable, str(REPO / 'scripts/launch_local.py'), '--num_processes=2',
                          '--devices_per_process=4', f'--timeout_s={PODS_TIMEOUT_S}', '--config=configs/tiny.py',
                          f'--workdir={reference}', *overrides], cwd=REPO, env=launcher_env(), capture_output=True,
                         text=True, timeout=PODS_TIMEOUT_S + 30)
  assert local.returncode == 0, local.stderr[-3000:]

  port = free_port()
  manifest = _dry_run(capsys, *V5P, f'--coordinator_port={port}', *overrides)
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'python').write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # A venv's python: a link loses it.
  (bin_dir / 'python').chmod(0o755)
  dns = {'v5p-run-slice-0-0.v5p-run': '127.0.0.1', 'v5p-run-slice-0-1.v5p-run': '127.0.0.1'}
  workdir = tmp_path / 'bucket'

  # The group's first run: pod 1 is lost at step 7, after the checkpoint of step 4.
  first = _wait(_start_pods(manifest, workdir, dns, bin_dir, {'LAUNCH_TEST_FAULT': FAULT}))
  (code_0, err_0), (code_1, err_1) = first
  # The pod's process itself: sh exec'd python, so nothing stands between it and the signal.
  assert code_1 == -9, err_1[-3000:]
  # The survivor ends too, with an exit the JobSet restarts (not one of the final ones): the whole group is down.
  assert code_0 == 75 and code_0 not in jobset.FINAL_EXIT_CODES, err_0[-3000:]
  assert (workdir / 'checkpoints' / '4').is_dir() and not (workdir / 'checkpoints' / '8').exists()

  # The JobSet recreates every pod with the same command and environment.
  second = _wait(_start_pods(manifest, workdir, dns, bin_dir, {}))
  for process, (code, err) in enumerate(second):
    assert code == 0, err[-3000:]
    assert 'Resuming from checkpoint at step 4' in err
    assert f'Joined 2 processes as process {process}' in err

  losses = {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}  # A resumed step's last record.
  expected = {r['step']: r['loss'] for r in read_metrics(reference) if 'loss' in r}
  assert sorted(losses) == sorted(expected) == list(range(1, 9))
  for step, loss in expected.items():
    assert abs(losses[step] - loss) <= 1e-6 * abs(loss), (step, losses[step], loss)


def test_each_pod_of_two_v5e_slices_gets_its_own_process_id_and_its_slices_hosts(capsys, tmp_path):
  """The pods' command as the shell in each container runs it, with `python` printing the argv it was given."""
  manifest = _dry_run(capsys, *V5E_TWO_SLICES)
  container = _container(manifest)
  (tmp_path / 'python').write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
  (tmp_path / 'python').chmod(0o755)
  seen = {}
  for j in range(2):
    for i in range(2):
      env = _pod_env(container, j, i, {})
      argv = subprocess.run([*container['command'], *container['args']], capture_output=True, text=True, check=True,
                            env={**env, 'PATH': f'{tmp_path}:/bin:/usr/bin'}).stdout.splitlines()
      assert argv[:6] == ['launch.py', *container['args']]
      assert argv[6:8] == ['--coordinator_address=v5e-run-slice-0-0.v5e-run:1234', '--num_processes=4']
      seen[argv[8]] = (j, i)
      assert env['TPU_WORKER_ID'] == str(i) and env['MEGASCALE_SLICE_ID'] == str(j)
      assert env['TPU_WORKER_HOSTNAMES'] == f'v5e-run-slice-{j}-0.v5e-run,v5e-run-slice-{j}-1.v5e-run'
  assert seen == {'--process_id=0': (0, 0), '--process_id=1': (0, 1), '--process_id=2': (1, 0),
                  '--process_id=3': (1, 1)}
