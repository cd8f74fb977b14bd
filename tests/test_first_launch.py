"""What a new user meets (issue 37): words before each long phase, a finished run that says so without compiling, the
data-wait warning only on an input-bound run, goodput over every attempt of a restarted run, no libtpu lines on a CPU
launch, and every README tool installed by the README's install.

Launcher subprocesses on the tiny config; faults from trainer/supervision/faults.py make one run step-bound (`slow`:
each step sleeps) and one input-bound (`slow_data`: each batch sleeps), so what the warning sees does not depend on how
busy the machine is.
"""

import importlib.metadata
import importlib.util
import json
import os
import re
import sys

import pytest

from conftest import REPO, launcher_env, make_text_dir, read_metrics, run_python, watch_command
from trainer.observe import earlier_attempts
from trainer.observe import goodput as goodput_lib

TIMEOUT_S = 600  # A hang guard only.
WARNING = 'waiting for input took'


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def _args(workdir, text_dir, *extra):
  return ['--config=configs/tiny.py', f'--workdir={workdir}', f'--config.data.text_dir={text_dir}',
          '--config.log.every_steps=1', '--config.ckpt.async_save=False', *extra]


def _launch(args, fault=None, **env):
  env = launcher_env(**env, **({'LAUNCH_TEST_FAULT': fault} if fault else {}))
  return watch_command([sys.executable, str(REPO / 'launch.py'), *args], env, timeout=TIMEOUT_S)[0]


@pytest.fixture(scope='module')
def step_bound(tmp_path_factory, text_dir):
  """4 steps, each sleeping 0.3 s in the step from step 2 on: the batches are ready long before they are asked for."""
  workdir = tmp_path_factory.mktemp('run')
  result = _launch(_args(workdir, text_dir, '--config.train.steps=4'), fault='slow@2,seconds=0.3')
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, result


def _order(text, *needles):
  where = [text.find(n) for n in needles]
  assert -1 not in where, [n for n, w in zip(needles, where) if w == -1]
  return where == sorted(where)


def test_each_long_phase_is_announced_and_timed(step_bound):
  _, result = step_bound
  assert _order(result.stderr, 'Reading the data ...', 'Data: ', 'Compiling the train step (', 'Compiled the train step in',
                'Initializing the parameters (compiling the init) ...', 'Initialized the parameters in', 'step 1/4')
  assert re.search(r'Data: .* \(read in \d+\.\ds\)', result.stderr)
  assert re.search(r'Initialized the parameters in \d+\.\ds', result.stderr)


def test_a_step_bound_run_gives_no_data_wait_warning(step_bound):
  workdir, result = step_bound
  assert WARNING not in result.stderr
  records = [r for r in read_metrics(workdir) if 'step_time_s' in r]
  assert len(records) == 4 and all(0 <= r['data_wait_s'] <= r['step_time_s'] for r in records)


def test_a_finished_run_relaunched_says_so_before_compiling(step_bound, text_dir):
  workdir, _ = step_bound
  metrics_before = (workdir / 'metrics.jsonl').read_text()
  result = _launch(_args(workdir, text_dir, '--config.train.steps=4'), LAUNCH_MAX_RESTARTS='3')  # Supervised.
  assert result.returncode == 0, result.stderr[-3000:]
  assert (f'Checkpoint step 4 in {workdir}/checkpoints already reaches train.steps=4: nothing to train (raise '
          f'--config.train.steps to train further).') in result.stderr
  assert 'Compiling' not in result.stderr and 'Compiled' not in result.stderr and 'Initializ' not in result.stderr
  assert (workdir / 'metrics.jsonl').read_text() == metrics_before
  assert [json.loads(l)['cause'] for l in (workdir / 'attempts.jsonl').read_text().splitlines()] == ['finished']


def test_the_tools_name_the_checkpoint_they_read(step_bound):
  import subprocess
  workdir, _ = step_bound
  sample = run_python([sys.executable, 'scripts/sample.py', f'--workdir={workdir}', '--prompt=a', '--num_tokens=2'],
                      timeout=TIMEOUT_S, text=False)
  assert sample.returncode == 0, sample.stderr[-3000:]
  assert f'sample.py: raw parameters of checkpoint step 4 in {workdir}' in sample.stderr.decode()
  export = run_python([sys.executable, 'scripts/export_params.py', '--config=configs/tiny.py', f'--workdir={workdir}',
                       f'--output={workdir}-params', '--config.train.steps=6'], timeout=TIMEOUT_S)
  assert export.returncode == 0, export.stderr[-3000:]
  assert re.search(r'Reading step 4 with \d setting\(s\) changed since it was saved: .*config.train.steps: 4 -> 6',
                   export.stderr) and 'Resuming' not in export.stderr  # An export trains nothing.
  assert f'Read checkpoint step 4 from {workdir}/checkpoints' in export.stderr


def test_an_input_bound_resume_warns_with_a_share_of_its_step(step_bound, text_dir, tmp_path):
  """Resumed to 8 steps with every batch from step 5 on taking 1 s to read; the restore is announced and timed."""
  import shutil
  workdir = tmp_path / 'resumed'
  shutil.copytree(step_bound[0], workdir)
  result = _launch(_args(workdir, text_dir, '--config.train.steps=8', '--config.train.accept_schedule_change=True'),
                   fault='slow_data@5,seconds=1.0')
  assert result.returncode == 0, result.stderr[-3000:]
  assert _order(result.stderr, f'Restoring checkpoint step 4 from {workdir}/checkpoints ...',
                'Resuming from checkpoint at step 4')
  assert re.search(r'Resuming from checkpoint at step 4 .* after \d+\.\ds', result.stderr)
  [line] = [l for l in result.stderr.splitlines() if WARNING in l]
  share, waited, step_time = re.search(r'took (\d+)% of the step time \(([\d.]+) ms of ([\d.]+) ms\)', line).groups()
  # Each batch takes 1 s to read in the pipeline's thread, part of it while the step before runs (a tiny step: tens of
  # milliseconds, a few hundred on a loaded machine).
  assert 500 <= float(waited) <= float(step_time) and 10 < int(share) <= 100, line
  # A step's record holds the waits inside its time: the loop takes batch k+1 before it fetches step k's metrics, so
  # steps 5..7 hold the waits for batches 6..8, and the last step none.
  records = {r['step']: r for r in read_metrics(workdir) if r['step'] > 4}
  assert all(0.5 <= records[s]['data_wait_s'] <= records[s]['step_time_s'] for s in (5, 6, 7)), records
  assert records[8]['data_wait_s'] == 0


# ----------------------------------------------------------------------------- goodput over attempts

def _write_jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))


def test_earlier_attempts_split_into_kept_steps_redone_steps_and_the_rest(tmp_path):
  # Attempt 1 (from 0) logged steps 1..6 and died; attempt 2 died before logging; attempt 3 resumed from 4 and logged
  # 5..7; this attempt (4) resumes from 6. Each record stands for the steps since the one before it.
  _write_jsonl(tmp_path / 'attempts.jsonl', [
      {'attempt': 1, 'start': 100.0, 'end': 150.0, 'resumed_step': 0, 'last_step': 6},
      {'attempt': 2, 'start': 160.0, 'end': 170.0, 'resumed_step': 4, 'last_step': None},
      {'attempt': 3, 'start': 175.0, 'end': 200.0, 'resumed_step': 4, 'last_step': 7}])
  _write_jsonl(tmp_path / 'metrics.jsonl', [
      {'step': 3, 'step_time_s': 9.0, 'compile_time_s': 1.0},  # An older launch, before this run.
      {'step': 1, 'step_time_s': 2.0, 'data_wait_s': 0.5, 'compile_time_s': 5.0},
      {'step': 4, 'step_time_s': 1.0, 'data_wait_s': 0.0},  # Steps 2..4.
      {'step': 6, 'step_time_s': 3.0, 'data_wait_s': 1.0},  # Steps 5..6: redone by attempt 3.
      {'step': 5, 'step_time_s': 2.0, 'data_wait_s': 0.25, 'compile_time_s': 4.0},
      {'step': 7, 'step_time_s': 1.0, 'data_wait_s': 0.0}])  # Steps 6 (kept) and 7 (redone by this attempt).
  earlier = earlier_attempts.read(str(tmp_path), attempt_number=4, resumed_step=6, process_started=210.0)
  # Kept: attempt 1's steps 1..4 (1.5 + 3 x 1.0 productive, 0.5 waited); attempt 3's step 5 (1.75, 0.25) and step 6.
  assert earlier.productive_s == pytest.approx(1.5 + 3.0 + 1.75 + 1.0)
  assert earlier.data_wait_s == pytest.approx(0.5 + 0.25)
  assert (earlier.lost_steps, earlier.lost_to_restarts_s) == (3, pytest.approx(2 * 3.0 + 1.0))
  spent = 50.0 + 10.0 + 25.0
  assert earlier.earlier_attempts_s == pytest.approx(spent - 7.25 - 0.75 - 7.0)
  assert (earlier.count, earlier.run_started, earlier.restart_s) == (3, 100.0, pytest.approx(110.0 - spent))
  assert earlier_attempts.read(str(tmp_path), attempt_number=1, resumed_step=0, process_started=0.0) is None
  # Attempt numbers that are not this run's 1..n-1 (another host's file, a lost line): this attempt alone.
  assert earlier_attempts.read(str(tmp_path), attempt_number=3, resumed_step=6, process_started=210.0) is None


def test_a_killed_first_attempt_is_in_the_goodput_of_the_run(text_dir, tmp_path):
  result = _launch(_args(tmp_path, text_dir, '--config.train.steps=8', '--config.ckpt.every_steps=4',
                         '--restart_backoff_s=1'), fault='kill@7,attempt=1', LAUNCH_MAX_RESTARTS='1')
  assert result.returncode == 0, result.stderr[-3000:]
  first, second = [json.loads(l) for l in (tmp_path / 'attempts.jsonl').read_text().splitlines()]
  assert (first['cause'], second['resumed_step']) == ('killed by SIGKILL', 4)
  summary = json.loads((tmp_path / 'goodput.jsonl').read_text().splitlines()[-1])
  assert summary['attempts'] == 2 and summary['steps'] == 4 and summary['lost_steps'] == 1  # Step 5, logged, redone.
  # The total runs from attempt 1's start: what this attempt did not see is attempt 1 and the back-off after it.
  before = summary['total_s'] - summary['wall_s']
  assert second['start'] - first['start'] - 0.05 <= before <= second['start'] - first['start'] + 60
  # The 1 s back-off, less up to a clock tick (the process's start time is read in kernel ticks,
  # trainer/observe/goodput.py; 0.9968 s was measured in a CI run).
  assert summary['restart_s'] >= 0.9 and summary['earlier_attempts_s'] > 0  # Attempt 1's start-up and compile.
  step5 = [r for r in read_metrics(tmp_path) if r['step'] == 5][0]  # Attempt 1's: logged once before the kill.
  assert summary['lost_to_restarts_s'] == pytest.approx(step5['step_time_s'])
  parts = summary['productive_s'] + sum(summary[k] for k in goodput_lib.CATEGORIES)
  assert parts == pytest.approx(summary['total_s'], rel=1e-6)
  [row] = [l for l in result.stderr.splitlines() if l.strip().startswith('earlier attempts')]
  assert float(row.split()[2].rstrip('s')) == pytest.approx(summary['earlier_attempts_s'], abs=0.05)
  assert 'the whole run since attempt 1 started' in result.stderr and '1 earlier attempt and the restarts' in result.stderr


# ----------------------------------------------------------------------------- libtpu off CPU launches

@pytest.fixture
def tpu_factory(monkeypatch):
  from jax._src import hardware_utils, xla_bridge
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  monkeypatch.delenv('JAX_FORCE_TPU_INIT', raising=False)
  sentinel = xla_bridge.BackendRegistration(factory=lambda: 'libtpu started', priority=300, fail_quietly=True)
  monkeypatch.setitem(xla_bridge._backend_factories, 'tpu', sentinel)  # Restored after the test.
  chips = []
  monkeypatch.setattr(hardware_utils, 'num_available_tpu_chips_and_device_id', lambda: (chips[0], None))
  return xla_bridge._backend_factories, chips


def test_no_tpu_chip_means_libtpu_is_never_started(tpu_factory):
  from parallel import platforms
  factories, chips = tpu_factory
  chips.append(0)
  assert platforms.skip_absent_tpu()
  assert 'tpu' in factories and factories['tpu'].fail_quietly  # Still a known platform, tried quietly...
  with pytest.raises(RuntimeError, match='no TPU chips on this machine'):
    factories['tpu'].factory()  # ...and failing without loading libtpu.


def test_a_tpu_machine_or_a_users_choice_is_left_alone(tpu_factory, monkeypatch):
  from parallel import platforms
  factories, chips = tpu_factory
  chips.append(4)
  assert not platforms.skip_absent_tpu() and factories['tpu'].factory() == 'libtpu started'
  chips[0] = 0
  monkeypatch.setenv('JAX_PLATFORMS', 'tpu,cpu')
  assert not platforms.skip_absent_tpu() and factories['tpu'].factory() == 'libtpu started'


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs libtpu (pip install -r requirements-tpu-plan.txt); the choice is tested above')
def test_a_cpu_launch_with_libtpu_installed_prints_only_its_own_line(tmp_path):
  env = {k: v for k, v in launcher_env(XLA_FLAGS='').items() if k != 'JAX_PLATFORMS'}  # As a user runs it.
  import subprocess
  result = subprocess.run([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                           f'--workdir={tmp_path}', '--config.mesh.data=3'], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      "launch.py: error: mesh {'data': 3, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1} needs 3 devices but 1 "
      "are available. Shapes that fit: data=1,fsdp=1,tensor=1 (or set one axis to -1). On CPU, prefix the command "
      "with XLA_FLAGS=--xla_force_host_platform_device_count=3 to run 3 devices."]


# ----------------------------------------------------------------------------- the README's tools

def _pinned(requirements):
  names = set()
  for line in (REPO / requirements).read_text().splitlines():
    line = line.split('#', 1)[0].strip()
    if line and not line.startswith('-'):
      names.add(re.split(r'[=<>\[ ]', line, maxsplit=1)[0].lower().replace('_', '-'))
  return names


def test_every_readme_tool_is_installed_by_the_readme_install():
  """`.venv/bin/X` in the README (a block or a table row) is a console script of a package requirements.txt pins."""
  readme = (REPO / 'README.md').read_text()
  install = re.search(r'```bash\n(python3 -m venv \.venv && \.venv/bin/pip install -r (\S+))\n```', readme)
  assert install and install.group(2) == 'requirements.txt', 'the Quickstart installs requirements.txt'
  tools = set(re.findall(r'\.venv/bin/([\w-]+)', readme)) - {'python', 'pip'}
  assert 'tensorboard' in tools  # The README's "watch a run".
  scripts = {ep.name: ep.dist.name.lower().replace('_', '-') for ep in importlib.metadata.entry_points(
      group='console_scripts')}
  missing = {tool: scripts.get(tool) for tool in tools if scripts.get(tool) not in _pinned('requirements.txt')}
  assert not missing, f'README tools whose package requirements.txt does not pin (tool: package): {missing}'


# ----------------------------------------------------------------------------- wording

def test_a_folder_too_small_to_hold_files_out_says_what_it_holds_out(tmp_path):
  from configs import tiny
  from trainer import data
  (tmp_path / 'only.py').write_bytes(b'x = 1\n' * 1000)  # 6000 bytes, one file: no file-level split.
  config = tiny.get_config()
  config.data.text_dir, config.data.eval_percent = str(tmp_path), 10
  description = data.load_sources(config).description
  assert description.startswith('1 train files (5400 bytes), the last 10% of their bytes held out (600 bytes) from ')
  assert '0 held out' not in description
