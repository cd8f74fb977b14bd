"""trainer/observe/metrics.py, progress.py and goodput.py in-process, without a training run.

The GPU/TPU paths (device memory statistics, TFLOP/s and MFU keys) cannot run on
this CPU-only machine; they are fed fakes of what those backends report.
"""

import io
import json
import logging as py_logging

import jax
import pytest

from conftest import read_metrics
from absl import logging
from tensorboard.backend.event_processing import event_accumulator

from configs import tiny
from trainer.base.errors import UserError
from trainer.observe import goodput as goodput_lib
from trainer.observe import metrics, progress
from trainer.observe.trackers import hparams

GIB = 2**30
# What jax's memory_stats() returns on a GPU (a subset of its keys), for two local devices.
GPU_STATS = [{'bytes_in_use': 3 * GIB, 'peak_bytes_in_use': 5 * GIB, 'bytes_limit': 70 * GIB, 'num_allocs': 9},
             {'bytes_in_use': 4 * GIB, 'peak_bytes_in_use': 4.5 * GIB, 'bytes_limit': 69 * GIB, 'num_allocs': 7}]


class _FakeDevice:

  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    return self._stats


def _tb_scalars(workdir) -> dict[str, dict[int, float]]:
  acc = event_accumulator.EventAccumulator(str(workdir / 'tensorboard'))
  acc.Reload()
  return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()['scalars']}



def test_device_memory_is_the_fullest_devices_in_gib():
  assert metrics.device_memory_scalars(GPU_STATS) == {
      'device_memory_in_use_gib': 4.0, 'device_memory_peak_gib': 5.0, 'device_memory_limit_gib': 69.0}
  assert metrics.device_memory_scalars([{'bytes_in_use': GIB}]) == {'device_memory_in_use_gib': 1.0}
  assert metrics.device_memory_scalars([None, None]) is None  # The CPU backend.
  assert metrics.device_memory_scalars([{}, {'num_allocs': 3}]) is None


def test_every_numeric_key_reaches_jsonl_and_tensorboard_with_memory_where_reported(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(jax, 'local_devices', lambda: [_FakeDevice(s) for s in GPU_STATS])
  writer = metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10)
  # tflops_per_device and mfu are what the loop adds on known accelerators; they need no change here.
  with caplog.at_level(py_logging.INFO):
    writer.write(1, {'loss': 2.75, 'step_time_s': 60.0})  # An attempt's first step: no ETA from its one slow step.
    writer.write(5, {'loss': 2.5, 'tokens_per_s': 1000.0, 'step_time_s': 0.5, 'tflops_per_device': 312.5,
                     'mfu': 0.41, 'eval_loss': 2.75, 'not_known_here': None})
  writer.close()
  assert 'step 1/10 | loss 2.7500\n' in caplog.text + '\n' and 'ETA 9m' not in caplog.text
  assert ('step 5/10 | loss 2.5000 | eval_loss 2.7500 | 1,000 tok/s | 312 TFLOP/s/device | MFU 41.0% | ETA 0m02s'
          in caplog.text)
  assert 'reports no memory statistics' not in caplog.text
  record = read_metrics(tmp_path)[1]
  assert record == {'step': 5, 'loss': 2.5, 'tokens_per_s': 1000.0, 'step_time_s': 0.5, 'tflops_per_device': 312.5,
                    'mfu': 0.41, 'eval_loss': 2.75, 'device_memory_in_use_gib': 4.0, 'device_memory_peak_gib': 5.0,
                    'device_memory_limit_gib': 69.0}
  scalars = _tb_scalars(tmp_path)
  assert scalars['train/tflops_per_device'] == {5: 312.5}
  assert scalars['eval/loss'][5] == 2.75
  assert scalars['train/mfu'][5] == pytest.approx(0.41)
  assert scalars['train/device_memory_peak_gib'][5] == 5.0


def test_cpu_memory_is_said_once_and_never_logged_as_zeros(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(jax, 'local_devices', lambda: [_FakeDevice(None)] * 8)
  writer = metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10)
  with caplog.at_level(py_logging.INFO):
    for step in (1, 2, 3):
      writer.write(step, {'loss': 1.0})
  writer.close()
  assert all(not any(k.startswith('device_memory') for k in r) for r in read_metrics(tmp_path))
  said = [r.getMessage() for r in caplog.records if 'reports no memory statistics' in r.getMessage()]
  assert len(said) == 1 and 'device_memory_* is not logged' in said[0]


def test_other_processes_write_nothing(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path / 'w'), enabled=False, total_steps=10, progress_bar='on')
  writer.write(1, {'loss': 1.0})
  writer.step_done(1, 1.0, 0.1, 0.0, 64)
  writer.write_config(tiny.get_config())
  writer.close()
  assert not (tmp_path / 'w').exists()


def test_hparams_are_the_flat_config_in_plugin_types():
  config = tiny.get_config()
  flat = hparams.flat(config.to_dict())
  assert flat['train.steps'] == 8 and flat['ckpt.async_save'] is True
  assert flat['train.learning_rate'] == config.train.learning_rate
  assert flat['data.text_dir'] == 'None'
  assert flat['parallel.logical_axis_rules'].startswith("(('batch', ('data', 'fsdp', 'expert'))")
  assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())


# ----------------------------------------------------------------------------- progress bar

class _Terminal(io.StringIO):

  def isatty(self):
    return True


def test_progress_bar_renders_step_loss_throughput_and_eta():
  line = progress.render(30, 120, 2.34567, 12345.6, 95)
  assert line == ('[======>                 ]  25% step 30/120 | loss 2.3457 (this step) | 12,346 tok/s (recent) | '
                  'ETA 1m35s')
  assert progress.render(120, 120, 1.0, 1.0, 0).startswith('[========================] 100% step 120/120')


def test_progress_bar_draws_on_a_terminal_and_wipes_itself_before_log_lines():
  terminal = _Terminal()
  bar = progress.ProgressBar(total_steps=100, mode='auto', stream=terminal)
  try:
    assert bar.enabled
    bar.update(10, 3.0, step_time_s=0.5, tokens_per_step=1000)
    assert terminal.getvalue() == '\r\x1b[K' + progress.render(10, 100, 3.0, 2000.0, 45.0)
    # launch.py logs through absl's handler (app.run installs it); its filters run before it writes a record.
    record = py_logging.LogRecord('absl', py_logging.INFO, __file__, 1, 'a log line', None, None)
    assert logging.get_absl_handler().filter(record)
    assert terminal.getvalue().endswith('\r\x1b[K')
    bar.update(11, 2.9, step_time_s=0.5, tokens_per_step=1000)  # Redrawn at once after a wipe.
    assert terminal.getvalue().endswith(progress.render(11, 100, 2.9, 2000.0, 44.5))
  finally:
    bar.close()
  assert not any(isinstance(f, progress._WipeBarFirst) for f in logging.get_absl_handler().filters)


def test_progress_bar_stays_off_in_files_and_when_asked():
  for stream, mode in ((io.StringIO(), 'auto'), (_Terminal(), 'off')):
    bar = progress.ProgressBar(total_steps=100, mode=mode, stream=stream)
    bar.update(10, 3.0, step_time_s=0.5, tokens_per_step=1000)
    bar.close()
    assert not bar.enabled and stream.getvalue() == ''
  assert progress.ProgressBar(total_steps=100, mode='on', stream=io.StringIO()).enabled


def test_bad_progress_bar_mode_names_the_key():
  with pytest.raises(UserError, match=r"log.progress_bar='yes': expected one of 'auto', 'on', 'off'"):
    progress.check_mode('yes')


# ----------------------------------------------------------------------------- goodput

def test_lost_to_restart_takes_the_latest_attempts_steps_beyond_the_checkpoint():
  first = [{'step': 1, 'step_time_s': 9.0}, {'step': 2, 'step_time_s': 1.0}, {'step': 4, 'step_time_s': 1.0},
           {'step': 6, 'step_time_s': 2.0}]
  # Resumed from 4: steps 5 and 6 (one record standing for 2 steps at 2s) are redone.
  assert goodput_lib.lost_to_restart(first, resumed_step=4) == (2, 4.0)
  # Resumed from 3: step 4 (half of the 3..4 record) and 5..6.
  assert goodput_lib.lost_to_restart(first, resumed_step=3) == (3, 5.0)
  assert goodput_lib.lost_to_restart(first, resumed_step=6) == (0, 0.0)
  # A second attempt (from 4) that got to 8 before dying; the third resumes from 6.
  second = first + [{'step': 5, 'step_time_s': 3.0}, {'step': 8, 'step_time_s': 0.5}]
  assert goodput_lib.lost_to_restart(second, resumed_step=6) == (2, 1.0)
  assert goodput_lib.lost_to_restart([], resumed_step=6) == (0, 0.0)


def test_goodput_summary_adds_up_to_the_total(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"step": 3, "step_time_s": 1.0}\n{"step": 4, "step_time_s": 1.5}\n{"ste')
  tracker = goodput_lib.Goodput(str(tmp_path), resumed_step=2, started=0.0)  # Process started at the epoch.
  tracker.compiled(3.0)
  tracker.record_step(2.0, data_wait_s=0.5)
  tracker.record_step(1.0, data_wait_s=0.25)
  tracker.record_side(eval_s=0.75, checkpoint_s=1.25)
  tracker.record_side(profiling_s=0.5)
  window = tracker.take_window()
  assert window == {'checkpoint_blocking_s': 1.25, 'evaluation_time_s': 0.75, 'compile_time_s': 3.0}
  assert tracker.take_window() == {'checkpoint_blocking_s': 0.0, 'evaluation_time_s': 0.0}  # Compile once.
  s = tracker.summary()
  assert (s['productive_s'], s['data_wait_s'], s['eval_s'], s['checkpoint_s']) == (2.25, 0.75, 0.75, 1.25)
  assert (s['lost_steps'], s['lost_to_restarts_s'], s['steps']) == (2, 2.5, 2)
  assert s['total_s'] == pytest.approx(s['wall_s'] + 2.5)
  parts = s['productive_s'] + sum(s[k] for k in goodput_lib.CATEGORIES)
  assert parts == pytest.approx(s['total_s'])
  assert s['goodput'] == pytest.approx(2.25 / s['total_s'])
  table = goodput_lib.format_summary(s)
  assert table.startswith(f'Goodput {s["goodput"]:.1%}: productive step time over')
  assert "2.5s of an earlier attempt's steps redone" in table
  assert [line.split()[0] for line in table.splitlines()[1:]] == [
      'productive', 'start-up', 'compile', 'data', 'checkpoint', 'eval', 'profiling', 'lost', 'restart', 'earlier',
      'other']


def test_process_start_is_before_now_and_not_long_ago():
  import time
  started = goodput_lib.process_start_time()
  assert time.time() - 3600 < started <= time.time()


def test_a_last_line_torn_by_a_kill_is_dropped_before_appending(tmp_path):
  from trainer.base import storage
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 8, "loss": 1.5}\n{"step": 9, "loss": 1.2')  # Killed while writing step 9's record.
  log = storage.AppendLog(path)
  log.write('{"step": 9, "loss": 1.25}\n')
  log.close()
  assert [json.loads(line)['step'] for line in path.read_text().splitlines()] == [8, 9]
