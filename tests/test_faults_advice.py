"""Advice that works, and refusals that touch nothing (issue 39, item 6): real launches.

- The non-finite stop says "Lower train.learning_rate"; relaunching with a lower --config.train.learning_rate, as
  printed, resumes (the schedule-change check takes a learning rate typed on the command line as deliberate and
  says so), where it used to be refused at the resume step.
- A second launch, or --start_over, on a workdir a supervised run is using is refused and writes nothing into the
  live run's attempts.jsonl.
"""

import re
import sys

import pytest

from conftest import REPO, make_text_dir, run_python
from test_guardrails import _run, _saved
from test_workdir_lock import _hold


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def test_the_non_finite_stops_advice_followed_as_printed_resumes(tmp_path, text_dir):
  stopped = _run(tmp_path, text_dir, 'stop')  # A NaN gradient at step 6: stops, checkpoint 4 kept.
  assert stopped.returncode == 3, stopped.stderr[-3000:]
  [line] = [l for l in stopped.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert 'Lower train.learning_rate (a relaunch with a lower --config.train.learning_rate resumes with it)' in line
  assert _saved(tmp_path) == [4]

  followed = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                         f'--workdir={tmp_path}', f'--config.data.text_dir={text_dir}',
                         '--config.log.every_steps=1', '--config.train.learning_rate=1e-4'], timeout=240)
  assert followed.returncode == 0, followed.stderr[-3000:]
  assert 'Resuming from checkpoint at step 4 ' in followed.stderr
  assert re.search(r'Resuming step 4: train.learning_rate 0.003 -> 0.0001 since checkpoint 4: the '
                   r'learning-rate schedule moves.*taken as deliberate, since --config.train.learning_rate was given on '
                   r'the command line', followed.stderr), followed.stderr[-3000:]
  assert _saved(tmp_path) == [4, 8]


def test_a_schedule_change_not_typed_on_the_command_line_still_needs_consent(tmp_path, text_dir):
  good = _run(tmp_path, text_dir, 'stop', '--config.train.steps=8', bad_step=100)
  assert good.returncode == 0, good.stderr[-3000:]
  extended = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                         f'--workdir={tmp_path}', f'--config.data.text_dir={text_dir}', '--config.train.steps=16',
                         '--config.train.learning_rate=1e-4'], timeout=240)
  assert extended.returncode == 2, extended.stderr[-3000:]
  assert 'accept_schedule_change=True' in extended.stderr  # steps changed too: not only the typed learning rate.


@pytest.mark.parametrize('extra', [[], ['--start_over']], ids=['second launch', 'start_over'])
def test_a_refused_launch_writes_nothing_into_the_live_runs_attempts(tmp_path, extra):
  live = '{"attempt": 1, "cause": "finished", "retried": false}\n'
  (tmp_path / 'attempts.jsonl').write_text(live)
  (tmp_path / 'checkpoints').mkdir()
  holder = _hold(tmp_path)
  try:
    result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                         f'--workdir={tmp_path}', '--max_restarts=2', *extra], timeout=240)
  finally:
    holder.kill()
    holder.wait()
  assert result.returncode == 2, result.stderr[-3000:]
  [line] = [l for l in result.stderr.splitlines() if l.startswith('launch.py: ')]
  assert 'is in use by another launch' in line
  assert (tmp_path / 'attempts.jsonl').read_text() == live
