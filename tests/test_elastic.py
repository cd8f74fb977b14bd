"""Elastic continuation (issue 58): a 2 x 4 run that loses process 1 for good goes on as 1 x 4, then grows back.

scripts/launch_local.py --elastic_min_processes=1, 2 processes x 4 CPU devices, tiny config. At step 20 process 1's
host is lost (LAUNCH_TEST_FAULT=lose: its launch.py and training process killed, nothing restarts them); process 0
waits --distributed_timeout_s for it to rejoin, exits 76, and is started again as a job of 1 x 4 with gradient
accumulation 2. Its losses from the resumed step on equal an uninterrupted 2 x 4 run's (same global batches) up to
step 30, where it ends; a relaunch to step 36 with both processes grows back to 2 x 4 with the losses still equal. A
smaller job whose batch-parallel devices no longer divide the batch is one line, exit 2, the workdir as it was. The
runs are shared by the module's tests.
"""

import json
import re
import shutil
import sys

import pytest

from conftest import REPO, launcher_env, read_metrics, watch_command

STEPS, LOST_AT, GROWN_AT = 36, 20, 30
# A constant learning rate after warmup: the smaller job ends at step GROWN_AT, and the relaunch that grows the run
# back trains on to STEPS without moving the schedule (deterministic, where stopping the fast tiny steps at a given
# step by a signal was not).
RUN = ('--config=configs/tiny.py', '--config.train.schedule=constant', '--config.ckpt.every_steps=5',
       '--config.log.every_steps=1', '--config.train.eval_batches=0', '--restart_backoff_s=1', '--max_restarts=2')
TIMEOUT_S = 900  # A hang guard only.
_MESH = "Mesh {{'data': {}, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}}"


def _launch_local(workdir, *args, num_processes=2, devices=4, fault=None, on_line=None):
  env = launcher_env(**({'LAUNCH_TEST_FAULT': fault} if fault else {}))
  return watch_command([sys.executable, str(REPO / 'scripts' / 'launch_local.py'), f'--num_processes={num_processes}',
                        f'--devices_per_process={devices}', f'--workdir={workdir}', *args], env, on_line, TIMEOUT_S)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp('elastic')
  reference, elastic = root / 'reference', root / 'elastic'
  uninterrupted, _ = _launch_local(reference, *RUN, f'--config.train.steps={STEPS}')
  assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
  shrunk, _ = _launch_local(elastic, *RUN, f'--config.train.steps={GROWN_AT}', '--elastic_min_processes=1',
                            '--distributed_timeout_s=15', fault=f'lose@{LOST_AT},process=1')
  attempts_shrunk = (elastic / 'attempts.jsonl').read_text()
  grown, _ = _launch_local(elastic, *RUN, f'--config.train.steps={STEPS}', '--elastic_min_processes=1')
  return {'root': root, 'reference': reference, 'elastic': elastic, 'shrunk': shrunk, 'grown': grown,
          'attempts_shrunk': attempts_shrunk}


def _losses(workdir) -> dict[int, float]:
  """The loss of every step, the last attempt's where steps were redone."""
  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}


def _resumed_step(text: str) -> int:
  return int(re.findall(r'Resuming from checkpoint at step (\d+)', text)[-1])


def test_a_lost_process_leaves_a_smaller_job_that_trains_on_the_same_batches(runs):
  shrunk = runs['shrunk'].stderr
  assert runs['shrunk'].returncode == 0, shrunk[-4000:]
  assert ("launch_local.py: elastic: process 0 exited with code 76, process 1 was killed by SIGKILL; starting the 1 "
          "left (process(es) 0) as a job of 1 of the run's 2 processes") in shrunk, shrunk[-4000:]
  smaller = shrunk[shrunk.index('launch_local.py: elastic:'):]
  assert ("Elastic: running on 1 of the run's 2 processes: mesh.data 8 -> 4, train.grad_accum_steps 1 -> 2" in smaller)
  assert _MESH.format(4) + ' over 4 devices (1 processes)' in smaller
  resumed = _resumed_step(smaller)
  assert 0 < resumed < LOST_AT and resumed % 5 == 0, resumed
  records = [r for r in read_metrics(runs['elastic']) if 'loss' in r]
  smaller_records = records[[i for i, r in enumerate(records) if r['step'] == resumed + 1][-1]:]
  # The smaller job's first logged step says its size (a TensorBoard scalar at each change).
  assert smaller_records[0]['step'] == resumed + 1
  assert (smaller_records[0]['processes'], smaller_records[0]['grad_accum_steps']) == (1, 2), smaller_records[0]
  reference, ours = _losses(runs['reference']), {r['step']: r['loss'] for r in smaller_records}
  compared = [s for s in ours if s <= GROWN_AT]
  assert compared[0] == resumed + 1 and compared[-1] >= GROWN_AT and LOST_AT + 1 in compared, compared
  for step in compared:
    assert abs(ours[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, ours[step], reference[step])
  attempts = [json.loads(l) for l in runs['attempts_shrunk'].splitlines()]
  ends = [(a['exit_code'], a.get('processes'), a['retried']) for a in attempts[:2]]
  assert ends == [(75, 2, True), (76, None, False)], attempts
  assert attempts[2].get('resized') == '2 -> 1 processes' and attempts[2]['grad_accum_steps'] == 2, attempts


def test_the_run_grows_back_when_the_process_returns(runs):
  grown = runs['grown'].stderr
  assert runs['grown'].returncode == 0, grown[-4000:]
  assert _MESH.format(8) + ' over 8 devices (2 processes)' in grown
  assert 'Elastic: all 2 processes of the run: its config as written.' in grown
  resumed = _resumed_step(grown)
  assert resumed == GROWN_AT, resumed
  reference, ours = _losses(runs['reference']), _losses(runs['elastic'])
  assert sorted(ours) == list(range(1, STEPS + 1))
  for step in range(resumed + 1, STEPS + 1):
    assert abs(ours[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, ours[step], reference[step])
  attempts = [json.loads(l) for l in (runs['elastic'] / 'attempts.jsonl').read_text().splitlines()]
  assert attempts[-1].get('resized') == '1 -> 2 processes' and attempts[-1]['grad_accum_steps'] == 1, attempts[-1]
  goodput = [json.loads(l) for l in (runs['elastic'] / 'goodput.jsonl').read_text().splitlines()]
  assert goodput[-2]['shrunk_s'] > 0 and goodput[-1]['shrunk_s'] == 0, goodput  # The smaller job's steps, counted.


def _listing(workdir) -> dict[str, int]:
  return {str(p.relative_to(workdir)): p.stat().st_size for p in workdir.rglob('*')
          if p.is_file() and 'checkpoints' in p.parts}


def test_a_smaller_job_that_no_longer_divides_the_batch_is_one_line_and_changes_nothing(runs):
  """2 of 3 processes x 2 devices: the batch of 6 divided over 6 devices, not over 4."""
  workdir = runs['root'] / 'copy'
  shutil.copytree(runs['elastic'], workdir)
  before = _listing(workdir)
  result, _ = _launch_local(workdir, *RUN, '--config.train.batch_size=6', '--elastic_full_processes=3',
                            devices=2)
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if 'launch.py: error:' in l]
  assert errors and all(l.split('launch.py: error: ')[1] == errors[0].split('launch.py: error: ')[1]
                        for l in errors), errors
  assert errors[0].split('launch.py: error: ')[1] == (
      'elastic: 2 of 3 processes make 4 batch-parallel devices (mesh data=4, fsdp=1, pipeline=1, expert=1, context=1, '
      'tensor=1), and train.batch_size=6 does not divide over them: the run cannot go on at this size; nothing was '
      'changed. Relaunch with all 3 processes, or restart with a train.batch_size that divides over both sizes (e.g. '
      '12), or a --elastic_min_processes that excludes 2.')
  assert 'Traceback' not in result.stderr
  assert _listing(workdir) == before


def _config(**overrides):
  from configs import tiny
  config = tiny.get_config()
  for key, value in overrides.items():
    section, name = key.split('__')
    config[section][name] = value
  return config


@pytest.mark.parametrize('overrides, full, now, devices, changed, accum', [
    ({'mesh__dcn_data': 2}, 2, 1, 4, {'dcn_data': 1}, 2),  # A slice dropped.
    ({'mesh__data': 1, 'mesh__fsdp': 8}, 2, 1, 4, {'fsdp': 4}, 2),  # The fsdp axis shrinks.
    ({'train__batch_size': 12}, 3, 2, 2, {'data': 4}, 3),  # 6 -> 4 devices: microbatches of 1, not 2 rows.
    ({'train__grad_accum_steps': 2, 'train__batch_size': 16}, 2, 2, 4, {}, 2),  # All back: the config as written.
])
def test_the_plan_keeps_each_devices_microbatch_and_the_global_batch(overrides, full, now, devices, changed, accum):
  from trainer.supervision import elastic
  config = _config(**overrides)
  size = elastic.plan(config.mesh, config.train, full, now, devices)
  assert {k: v for k, v in size.mesh.items() if v != size.full_mesh[k]} == changed
  assert size.grad_accum_steps == accum
  elastic.apply(config.mesh, config.train, size)
  assert config.train.batch_size == overrides.get('train__batch_size', 8) and config.train.grad_accum_steps == accum


@pytest.mark.parametrize('overrides, full, now, expected', [
    ({'mesh__data': 1, 'mesh__tensor': 8}, 2, 1, 'elastic: no mesh for 1 of 2 processes: none of mesh.dcn_data=1, '
     'mesh.dcn_fsdp=1, mesh.data=1, mesh.fsdp=1 scales by 1/2 to whole devices'),
    ({}, 1, 2, '--elastic_full_processes=1 must be the process count the config is written for, at least the 2 '
     'running now.'),
])
def test_a_size_the_plan_cannot_run_is_one_line_naming_the_setting(overrides, full, now, expected):
  from trainer.base.errors import UserError
  from trainer.supervision import elastic
  config = _config(**overrides)
  with pytest.raises(UserError) as raised:
    elastic.plan(config.mesh, config.train, full, now, 4)
  assert str(raised.value).startswith(expected), str(raised.value)
