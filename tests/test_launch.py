"""End to end through `python launch.py`: it learns, logs, checkpoints, resumes, and fails clearly."""

import math
import re
import shutil

import pytest

from conftest import REPO, read_metrics
from tensorboard.backend.event_processing import event_accumulator

TINY = '--config=configs/tiny.py'



@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A tiny run of 8 steps on 8 fake devices, then a relaunch to 12 steps in the same workdir."""
  from conftest import run_launcher
  workdir = tmp_path_factory.mktemp('run')
  first = run_launcher(TINY, f'--workdir={workdir}')
  assert first.returncode == 0, first.stderr[-3000:]
  records_after_first = read_metrics(workdir)
  second = run_launcher(TINY, f'--workdir={workdir}', '--config.train.steps=12',
                        '--config.train.accept_schedule_change=True')
  assert second.returncode == 0, second.stderr[-3000:]
  return workdir, first, second, records_after_first


def test_loss_falls_and_metrics_are_written(finished_run):
  workdir, first, _, records = finished_run
  assert [r['step'] for r in records] == [1, 2, 4, 6, 8]
  for record in records:
    assert {'step', 'loss', 'step_time_s', 'tokens_per_s', 'learning_rate', 'grad_norm'} <= record.keys()
    assert record['tokens_per_s'] > 0
  # It learns: below the loss of uniform predictions, ln(256), which the initial model starts near (within 0.15;
  # tests/test_presets.py), by more than that start's spread.
  assert records[-1]['loss'] < min(records[0]['loss'], math.log(256)) - 0.3
  assert 'eval_loss' in records[-1]
  assert "Mesh {'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1} over 8 devices" in first.stderr
  assert 'step 8/8 | loss' in first.stderr


def test_a_default_launch_says_nothing_a_user_reads_as_a_fault(finished_run):
  """No warning or error lines from libraries (absl's W/E prefix, libtpu's E0000), and the sharding table goes to
  sharding.txt with one line on the console, on a fresh start and on a resume alike."""
  workdir, first, second, _ = finished_run
  # The launcher's own warnings (a stall on a loaded machine, say) are its business; a library's are noise.
  own = {p.name for part in ('trainer', 'parallel', 'configs') for p in (REPO / part).glob('**/*.py')} | {'launch.py'}
  for launch in (first, second):
    faults = [line for line in launch.stderr.splitlines()
              if re.match(r'[WEF]\d{4} ', line) and re.match(r'\S+ \S+ +\d+ (\S+?):\d+\]', line)[1] not in own]
    assert not faults, faults
    assert not re.search(r'^(E0000|\[Gloo\]|WARNING)', launch.stderr, re.M)
    [summary] = [line for line in launch.stderr.splitlines() if 'Sharding: ' in line]
    assert summary.endswith(f'the table per parameter is in {workdir}/sharding.txt')
    assert '12 parameter arrays' in summary
    assert 'embed/embedding' not in launch.stderr
  table = (workdir / 'sharding.txt').read_text().splitlines()
  assert table[0].split() == ['parameter', 'shape', 'spec', 'bytes/device', 'decay']
  assert len(table) == 1 + 12 + 2 and 'embed/embedding' in table[1]


def test_tensorboard_events_read_back_with_tensorboards_reader(finished_run):
  workdir, _, _, records = finished_run
  acc = event_accumulator.EventAccumulator(str(workdir / 'tensorboard'))
  acc.Reload()
  tags = set(acc.Tags()['scalars'])
  assert {'train/loss', 'train/learning_rate', 'train/grad_norm', 'train/step_time_s', 'train/tokens_per_s',
          'eval/loss'} <= tags
  losses = {e.step: e.value for e in acc.Scalars('train/loss')}
  for record in records:
    assert losses[record['step']] == pytest.approx(record['loss'], rel=1e-6)


def test_checkpoints_and_relaunch_resumes_at_saved_step(finished_run):
  workdir, _, second, _ = finished_run
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit()) == [4, 8, 12]
  assert 'Resuming from checkpoint at step 8' in second.stderr
  steps = [r['step'] for r in read_metrics(workdir)]
  assert steps == [1, 2, 4, 6, 8, 9, 10, 12]


def test_workdir_of_another_model_is_refused_and_untouched(finished_run, launcher, tmp_path):
  workdir = tmp_path / 'copy'
  shutil.copytree(finished_run[0], workdir)
  before = sorted(p.relative_to(workdir) for p in workdir.rglob('*'))
  result = launcher(TINY, f'--workdir={workdir}', '--config.model.d_model=64', '--config.train.steps=20')
  assert result.returncode == 2
  assert 'holds checkpoints of a different model' in result.stderr
  assert 'model.d_model: checkpoint 32 vs config 64' in result.stderr
  assert 'Traceback' not in result.stderr
  assert sorted(p.relative_to(workdir) for p in workdir.rglob('*')) == before


def _error_line(result) -> str:
  lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert len(lines) == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  return lines[0]


def test_unknown_override_key_names_the_key(launcher, tmp_path):
  result = launcher(TINY, f'--workdir={tmp_path}', '--config.train.stpes=5')
  assert result.returncode == 2
  line = _error_line(result)
  assert '--config.train.stpes' in line and '"steps"' in line
  assert not (tmp_path / 'checkpoints').exists()


def test_batch_size_not_dividing_the_data_axis(launcher, tmp_path):
  result = launcher(TINY, f'--workdir={tmp_path}', '--config.train.batch_size=12')
  assert result.returncode == 2
  line = _error_line(result)
  assert 'train.batch_size=12' in line and '8 data-parallel devices' in line and '8 or 16' in line


def test_missing_text_dir_is_one_line(launcher, tmp_path):
  result = launcher(TINY, f'--workdir={tmp_path}', f'--config.data.text_dir={tmp_path}/none')
  assert result.returncode == 2
  assert f"data.text_dir='{tmp_path}/none' does not exist" in _error_line(result)


def test_missing_config_file(launcher, tmp_path):
  result = launcher('--config=configs/nope.py', f'--workdir={tmp_path}')
  assert result.returncode == 2
  assert 'configs/nope.py' in _error_line(result)


def test_the_log_counts_passes_over_the_data(finished_run):
  workdir, first, _, _ = finished_run
  examples = int(re.search(r'; (\d+) train examples', first.stderr).group(1))
  records = [r for r in read_metrics(workdir) if 'loss' in r]
  assert records and all(r['epochs'] == pytest.approx(r['step'] * 8 / examples) for r in records)  # tiny: batch 8.
  assert re.search(r'step 8/8 \| loss [\d.]+ \| epoch \d+\.\d\d \|', first.stderr)
