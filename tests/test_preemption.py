"""Real subprocesses of launch.py: kill -9 and resume, SIGTERM and relaunch, --start_over; bitwise-equal losses.

Each run is its own process group under a deadline; the test reads its log as
it is written and sends the signal when the run reaches a given step.
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

from conftest import REPO, launcher_env, make_text_dir, run_launcher

STEPS = 20
TIMEOUT_S = 600  # A hang guard only.



@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'), bytes_per_file=4000)


def _args(workdir, text_dir, *extra, steps=STEPS):
  return ['--config=configs/tiny.py', f'--workdir={workdir}', f'--config.train.steps={steps}',
          '--config.ckpt.every_steps=5', '--config.log.every_steps=1', '--config.data.seq_len=128',
          f'--config.data.text_dir={text_dir}', *extra]


# launch.py, except that the run waits before its preemption check of step N+1 (argv[1]) until a signal has arrived.
# Step N is logged during step N+1, before that check; so a signal sent once the log shows `step N/` always lands
# mid-run, however fast the machine (before, a fast machine could finish all the steps first).
_HELD_AT_STEP = f'''
import runpy, sys, time
sys.path.insert(0, {str(REPO)!r})
from trainer.safety import preemption
hold_at, reached = int(sys.argv[1]), preemption.PreemptionWatch.reached

def held(self, step):
  deadline = time.monotonic() + {TIMEOUT_S}
  while step == hold_at and not reached(self, step) and time.monotonic() < deadline:
    time.sleep(0.01)
  return reached(self, step)

preemption.PreemptionWatch.reached = held
sys.argv = [{str(REPO / 'launch.py')!r}] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def _launch(args, signal_at_step: int | None = None, sig: int = signal.SIGKILL,
            steps: int = STEPS) -> subprocess.CompletedProcess:
  """Runs launch.py; once its log shows `step N/`, sends `sig` (the run waits for it). Fails past TIMEOUT_S.

  A run sent no signal is forked from a warm interpreter (conftest.run_launcher), which skips its imports (about
  1.4 s of CPU each); one sent a signal is a fresh process of its own, as a user's would be."""
  if not signal_at_step:
    return run_launcher(*args, timeout=TIMEOUT_S)
  command = [sys.executable, '-c', _HELD_AT_STEP, str(signal_at_step + 1)]
  proc = subprocess.Popen([*command, *args], cwd=REPO, env=launcher_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
  timer = threading.Timer(TIMEOUT_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
  timer.start()
  lines, sent = [], False
  try:
    for line in proc.stderr:
      lines.append(line)
      if signal_at_step and not sent and re.search(rf'step {signal_at_step}/{steps} \|', line):
        os.kill(proc.pid, sig)
        sent = True
    proc.wait()
  finally:
    timed_out = not timer.is_alive()
    timer.cancel()
  assert not timed_out, f'launch.py ran past {TIMEOUT_S}s:\n{"".join(lines)[-4000:]}'
  return subprocess.CompletedProcess(args, proc.returncode, '', ''.join(lines))


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  """step -> loss; a relaunch's records replace the killed run's records of the same step."""
  return {r['step']: r['loss'] for r in map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines())}


def _steps_saved(workdir: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit())


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, text_dir):
  workdir = tmp_path_factory.mktemp('uninterrupted')
  result = _launch(_args(workdir, text_dir))
  assert result.returncode == 0, result.stderr[-3000:]
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return workdir, losses


def test_kill_9_after_10_steps_then_resume_gives_bitwise_identical_losses(uninterrupted, text_dir, tmp_path):
  _, reference = uninterrupted
  killed = _launch(_args(tmp_path, text_dir), signal_at_step=10, sig=signal.SIGKILL)
  assert killed.returncode == -signal.SIGKILL
  reached = max(_losses(tmp_path))
  assert reached == 10  # Killed while it waited at step 11's check (_HELD_AT_STEP).
  saved_before = _steps_saved(tmp_path)
  assert 5 in saved_before and STEPS not in saved_before

  resumed = _launch(_args(tmp_path, text_dir))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  start = int(re.search(r'Resuming from checkpoint at step (\d+)', resumed.stderr).group(1))
  assert start == max(saved_before) and start >= 5
  losses = _losses(tmp_path)
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert losses == reference  # float32 losses, bit for bit, before and after the kill.


def test_sigterm_saves_the_current_step_exits_0_and_relaunch_continues_exactly(uninterrupted, text_dir, tmp_path):
  _, reference = uninterrupted
  stopped = _launch(_args(tmp_path, text_dir), signal_at_step=7, sig=signal.SIGTERM)
  assert stopped.returncode == 0, stopped.stderr[-3000:]
  match = re.search(r'SIGTERM received: saved step (\d+) to (\S+) and stopped', stopped.stderr)
  assert match, stopped.stderr[-3000:]
  step = int(match.group(1))
  assert step == 8  # The first preemption check after the signal.
  assert _steps_saved(tmp_path)[-1] == step  # Saved at the step it stopped at, not at the last multiple of 5.
  assert not list((tmp_path / 'checkpoints').glob('*tmp*'))  # The save finished before the exit.
  assert max(_losses(tmp_path)) == step

  relaunched = _launch(_args(tmp_path, text_dir))
  assert relaunched.returncode == 0, relaunched.stderr[-3000:]
  assert f'Resuming from checkpoint at step {step} ' in relaunched.stderr
  assert _losses(tmp_path) == reference


def test_start_over_moves_the_previous_run_aside_and_trains_from_step_0(uninterrupted, text_dir, tmp_path):
  reference_dir, reference = uninterrupted
  workdir = tmp_path / 'run'
  subprocess.run(['cp', '-r', str(reference_dir), str(workdir)], check=True)
  # launch.lock stays: it belongs to the workdir, and the new launch holds it (trainer/safety/lock.py).
  before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob('*') if p.name != 'launch.lock')
  result = _launch(_args(workdir, text_dir, '--start_over'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resuming' not in result.stderr
  [moved] = workdir.glob('previous_run_*')
  assert '--start_over: moved the previous run' in result.stderr and str(moved) in result.stderr
  after = sorted(str(p.relative_to(moved)) for p in moved.rglob('*'))
  assert before == after  # Everything kept, nothing deleted.
  assert _steps_saved(workdir) == [10, 15, 20]
  assert _losses(workdir) == reference  # A fresh run from step 0, not a resume.


def test_start_over_with_a_bad_config_moves_nothing(uninterrupted, text_dir, tmp_path):
  reference_dir, _ = uninterrupted
  workdir = tmp_path / 'run'
  subprocess.run(['cp', '-r', str(reference_dir), str(workdir)], check=True)
  before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob('*'))
  result = _launch(_args(workdir, text_dir, '--start_over', '--config.mesh.data=3'))
  assert result.returncode == 2 and 'mesh' in result.stderr.splitlines()[-1], result.stderr[-2000:]
  assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob('*')) == before  # Checked first, then moved.


def test_ctrl_c_saves_the_current_step_and_exits_130_in_one_line(text_dir, tmp_path):
  stopped = _launch(_args(tmp_path, text_dir), signal_at_step=7, sig=signal.SIGINT)
  assert stopped.returncode == 130, stopped.stderr[-3000:]
  match = re.search(r'SIGINT received: saved step (\d+) to (\S+) and stopped', stopped.stderr)
  assert match, stopped.stderr[-3000:]
  step = int(match.group(1))
  assert step == 8 and _steps_saved(tmp_path)[-1] == step
  assert stopped.stderr.splitlines()[-1] == (f'launch.py: interrupted: Ctrl-C: saved the current step to {tmp_path}/'
                                             f'checkpoints and stopped; relaunch the same command to continue.')
  assert 'Traceback' not in stopped.stderr and 'KeyboardInterrupt' not in stopped.stderr


def test_a_second_ctrl_c_exits_at_once():
  script = f'''
import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from trainer.safety import preemption
watch = preemption.PreemptionWatch()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
assert watch.reached(1)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print('not reached')
'''
  result = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=600)
  assert result.returncode == 130 and 'not reached' not in result.stdout, result.stderr
  assert result.stderr.splitlines()[-1].startswith('launch.py: interrupted again (Ctrl-C): exiting now')


def _records(workdir: pathlib.Path) -> dict[int, tuple]:
  """step -> (loss, gradient norm, parameter norm); a relaunch's records replace the killed run's."""
  return {r['step']: (r['loss'], r['grad_norm'], r['param_norm'])
          for r in map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines()) if 'loss' in r}


def test_an_fp8_run_killed_with_9_resumes_bit_exactly_over_30_steps(text_dir, tmp_path):
  """train.quantization='fp8' (bf16 compute, float32 master weights): current scaling keeps no state, so the
  checkpoint holds all a resume needs, and the relaunched run's losses and norms are the uninterrupted run's."""
  # A synchronous save: step 15's checkpoint is whole before step 16 starts, so the kill at 17 resumes at 15 however
  # slow the machine (async, a loaded CI machine could still be writing it at the kill: then 10).
  steps, fp8 = 30, ('--config.train.quantization=fp8', '--config.train.compute_dtype=bfloat16',
                    '--config.ckpt.async_save=False')
  straight = _launch(_args(tmp_path / 'straight', text_dir, *fp8, steps=steps), steps=steps)
  assert straight.returncode == 0, straight.stderr[-3000:]
  killed = _launch(_args(tmp_path / 'killed', text_dir, *fp8, steps=steps), signal_at_step=17, steps=steps)
  assert killed.returncode == -signal.SIGKILL and max(_records(tmp_path / 'killed')) == 17
  resumed = _launch(_args(tmp_path / 'killed', text_dir, *fp8, steps=steps), steps=steps)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Resuming from checkpoint at step 15 ' in resumed.stderr
  reference = _records(tmp_path / 'straight')
  assert sorted(reference) == list(range(1, steps + 1)) and _records(tmp_path / 'killed') == reference
