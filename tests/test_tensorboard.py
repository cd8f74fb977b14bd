"""A finished launch.py run, read back through a real TensorBoard server's HTTP API; its goodput, and a restart's.

The TensorBoard here is the pinned `tensorboard` of requirements.txt, started
on 127.0.0.1 at a free port against the workdir, as a user would start it.
"""

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from conftest import read_metrics

TINY = '--config=configs/tiny.py'



@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """Tiny run of 8 steps (eval at the end, checkpoints at 4 and 8), no profiling asked for."""
  from conftest import run_launcher
  workdir = tmp_path_factory.mktemp('tb_run')
  result = run_launcher(TINY, f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, result


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class _TensorBoard:

  def __init__(self, logdir):
    self.port = _free_port()
    self.process = subprocess.Popen(
        [sys.executable, '-m', 'tensorboard.main', f'--logdir={logdir}', '--host=127.0.0.1', f'--port={self.port}',
         '--reload_interval=1'], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

  def get(self, path: str, body: dict | None = None):
    request = urllib.request.Request(f'http://127.0.0.1:{self.port}{path}',
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=10) as response:
      return json.loads(response.read())

  def wait_for(self, path: str, ready, timeout: float = 90):
    """GETs `path` until `ready(answer)`: the server starts, then loads event files in the background."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
      assert self.process.poll() is None, self.process.stderr.read().decode()[-2000:]
      try:
        last = self.get(path)
        if ready(last):
          return last
      except OSError:
        pass
      time.sleep(0.3)
    raise AssertionError(f'TensorBoard did not serve {path} in {timeout}s; last answer: {last}')

  def scalars(self, run: str, tag: str) -> dict[int, float]:
    query = urllib.parse.urlencode({'run': run, 'tag': tag})
    return {step: value for _, step, value in self.get(f'/data/plugin/scalars/scalars?{query}')}

  def close(self):
    self.process.terminate()
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()


@pytest.fixture(scope='module')
def tensorboard(finished_run):
  server = _TensorBoard(finished_run[0])
  try:
    server.wait_for('/data/plugin/scalars/tags', lambda tags: 'goodput/goodput' in tags.get('tensorboard', {}))
    yield server
  finally:
    server.close()


def test_loss_and_tokens_per_s_served_by_tensorboard_match_metrics_jsonl(finished_run, tensorboard):
  records = read_metrics(finished_run[0])
  assert [r['step'] for r in records] == [1, 2, 4, 6, 8]
  for key in ('loss', 'tokens_per_s'):
    served = tensorboard.scalars('tensorboard', f'train/{key}')
    assert sorted(served) == [1, 2, 4, 6, 8]
    for record in records:
      assert served[record['step']] == pytest.approx(record[key], rel=1e-6)  # Stored as float32.
  assert tensorboard.scalars('tensorboard', 'eval/loss')[8] == pytest.approx(records[-1]['eval_loss'], rel=1e-6)


def test_every_scalar_the_issue_lists_is_served(finished_run, tensorboard):
  tags = set(tensorboard.get('/data/plugin/scalars/tags')['tensorboard'])
  wanted = {'train/loss', 'eval/loss', 'eval/perplexity', 'train/learning_rate', 'train/grad_norm',
            'train/param_norm', 'train/step_time_s', 'train/tokens_per_s', 'train/data_wait_s',
            'train/checkpoint_blocking_s', 'train/compile_time_s', 'goodput/goodput', 'train/tflops_per_device'}
  assert wanted <= tags, wanted - tags
  assert not any('device_memory' in t for t in tags)  # The CPU backend reports none: no zeros logged.
  assert 'reports no memory statistics' in finished_run[1].stderr
  compile_time = tensorboard.scalars('tensorboard', 'train/compile_time_s')
  assert list(compile_time) == [1] and compile_time[1] > 0
  param_norm = tensorboard.scalars('tensorboard', 'train/param_norm')
  assert all(v > 1 for v in param_norm.values())


def test_config_served_as_text_and_as_hparams(tensorboard):
  text_tags = set(tensorboard.get('/data/plugin/text/tags')['tensorboard'])
  assert {'config/text_summary', 'goodput/text_summary'} <= text_tags
  experiment = tensorboard.get('/data/plugin/hparams/experiment', body={'experimentName': ''})
  hparams = {h['name'] for h in experiment['hparamInfos']}
  assert {'train.steps', 'train.batch_size', 'model.d_model', 'mesh.data', 'profile.trace_window'} <= hparams
  assert {m['name']['tag'] for m in experiment['metricInfos']} == {'train/loss', 'eval/loss'}


def test_goodput_summary_printed_logged_and_consistent(finished_run):
  workdir, result = finished_run
  assert 'Goodput ' in result.stderr and 'productive steps' in result.stderr and 'checkpoint blocking' in result.stderr
  summary = json.loads((workdir / 'goodput.jsonl').read_text())
  assert summary['step'] == 8 and summary['steps'] == 8 and summary['lost_steps'] == 0
  assert 0 < summary['goodput'] < 1
  parts = ('productive_s', 'startup_s', 'compile_s', 'data_wait_s', 'checkpoint_s', 'eval_s', 'profiling_s',
           'lost_to_restarts_s', 'restart_s', 'other_s')
  assert sum(summary[k] for k in parts) == pytest.approx(summary['total_s'], rel=1e-6)
  assert summary['compile_s'] > 0 and summary['checkpoint_s'] > 0 and summary['eval_s'] > 0
  assert summary['profiling_s'] == 0


def test_run_without_a_profile_window_leaves_no_trace(finished_run):
  workdir, result = finished_run
  assert not list(workdir.rglob('*.xplane.pb')) and not (workdir / 'plugins').exists()
  assert 'Profiling steps' not in result.stderr


def test_restart_counts_the_steps_it_redoes_as_lost(finished_run, launcher, tmp_path):
  """An attempt that died after logging step 8 but with only checkpoint 4 on disk: steps 5..8 are redone."""
  workdir = tmp_path / 'restarted'
  shutil.copytree(finished_run[0], workdir)
  shutil.rmtree(workdir / 'checkpoints' / '8')
  first = read_metrics(workdir)
  result = launcher(TINY, f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resuming from checkpoint at step 4' in result.stderr
  summary = json.loads((workdir / 'goodput.jsonl').read_text().splitlines()[-1])
  assert summary['lost_steps'] == 4 and summary['steps'] == 4
  lost = 2 * first[3]['step_time_s'] + 2 * first[4]['step_time_s']  # Records 6 and 8 stand for 2 steps each.
  assert summary['lost_to_restarts_s'] == pytest.approx(lost)
  assert summary['total_s'] == pytest.approx(summary['wall_s'] + lost)
  assert "of an earlier attempt's steps redone" in result.stderr
