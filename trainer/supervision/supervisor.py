"""The supervisor: launch.py's parent side, which runs training as a child and restarts it when that is worth it.

Why a parent process inside launch.py rather than a loop in the cluster scripts:
the same restart rules then hold everywhere a user starts a run (a laptop, a
hand-started pair, SLURM, a TPU pod, GKE), the scripts stay thin, and the parent
can read what the child left behind (its status file, trainer/supervision/attempt.py)
even when the child was killed without a word. The parent imports no jax and holds
no device; a child that loses its parent is killed with it (PR_SET_PDEATHSIG), so
`kill -9` on launch.py still ends the whole run.

What is retried: a lost peer (exit 75), a hang or stalled input (124, from the hang
watch), a crash (a traceback, an abort, a kill by a signal not sent through this
parent), and a stop after a saved preemption notice that reached the child alone.
What never is: success, a user error (2), a non-finite stop (3), Ctrl-C (130), an elastic
run's processes missing at the join (76: the launcher starts a smaller job, trainer/supervision/elastic.py),
and any run this parent was itself asked to stop (SIGTERM, SIGINT, SIGHUP are
forwarded to the child, which saves, and the run ends there: the machine is being
taken away). It stops after --max_restarts restarts, or when CRASH_LOOP attempts in
a row failed without saving past the same checkpoint (a crash loop), with one line.

On a multi-process run every host's launch.py supervises its own child. A failure
on one host ends the others too (the peer watchdog, exit 75), so every supervisor
restarts together and the new children join the coordinator as on the first
launch; a host that does not come back makes the others' join time out with the
existing one-line error (exit 2), which is not retried. Process 0's supervisor
writes WORKDIR/attempts.jsonl, one line per attempt: `last_step` is the last logged
step the child had reported (at most a second stale for one killed without a word),
`steps_redone` the steps an earlier attempt logged beyond this one's resumed step
(trainer/observe/goodput.py reads them from metrics.jsonl).
"""

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from trainer.base import confined, storage
from trainer.supervision import attempt, heartbeat

CRASH_LOOP = 3  # Failed attempts in a row resumed from the same step before the supervisor gives up.
_MAX_BACKOFF_S = 300.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_FORWARDED = _STOP_SIGNALS + (signal.SIGUSR1, signal.SIGUSR2)
# A child that stopped on a stop signal this parent did not forward stopped with a peer that received it
# (trainer/safety/startup_signals.py); a group-wide preemption reaches this parent too, a little later.
_PEER_STOP_GRACE_S = 5.0
# A child asked to stop that still holds the stop signals blocked after this long never reached its handlers (hung
# while starting Python: a stalled filesystem under its imports): nothing of it to save, so it is killed.
_STARTING_STOP_GRACE_S = 20.0
_NOT_RETRIED = {0: 'finished', 2: 'user error', 3: 'non-finite loss', 130: 'interrupted (Ctrl-C)',
                # An elastic run's processes that did not all rejoin: the launcher starts a smaller job (elastic.py).
                76: 'processes missing (elastic: the launcher starts the others as a smaller job)'}
# What an elastic attempt notes of its size (trainer/supervision/elastic.py), copied into its record.
_SIZE_FIELDS = ('processes', 'full_processes', 'grad_accum_steps')


def _say(message: str, kind: str = 'error') -> None:
  print(f'launch.py: {kind}: {message}', file=sys.stderr, flush=True)


def classify(returncode: int, status: dict) -> tuple[bool, str]:
  """(retry?, cause) for a child that ended with `returncode`, having left `status`."""
  if returncode == 0 and status.get('stopped') == 'preempted':
    return True, 'preempted (saved)'
  if returncode in _NOT_RETRIED:
    return False, _NOT_RETRIED[returncode]
  if returncode == 75:
    return True, 'lost peer'
  if returncode == 124:
    return True, status.get('stopped', 'hang')
  if returncode == 74:
    return True, 'storage stalled'
  if returncode - 128 in _STOP_SIGNALS:  # Not forwarded by this parent, or classify's caller would not retry it.
    return True, f'{signal.Signals(returncode - 128).name} that reached the child or a peer, not this supervisor'
  if returncode < 0:
    return True, f'killed by {signal.Signals(-returncode).name}'
  if returncode in (134, 139):
    return True, f'crash ({"abort" if returncode == 134 else "segfault"}, exit {returncode})'
  return True, f'crash (exit {returncode})'


try:  # Looked up here, not in the forked child, where another thread may have held the loader's lock.
  _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # Not Linux.
  _PRCTL = None


def die_with_parent(signum: int = signal.SIGKILL):
  """A `preexec_fn` for Popen: the child gets `signum` when the process that started it dies, even by kill -9.

  Linux's PR_SET_PDEATHSIG, set in the child before exec; a parent that died before it took is caught by
  the parent id check. The supervisor's child gets SIGKILL, as if both were one process.
  """
  parent = os.getpid()

  def preexec() -> None:
    if _PRCTL is not None:
      _PRCTL(1, signum)  # 1 = PR_SET_PDEATHSIG.
    if os.getppid() != parent:
      os.kill(os.getpid(), signum)

  return preexec


@contextlib.contextmanager
def signals_held(signals):
  """`signals` blocked in this thread meanwhile, and so in a process started meanwhile, from its first line; yields
  the environment entry that tells the child which to unblock.

  A stop forwarded to a launch.py that still starts Python (before its handlers: a KeyboardInterrupt traceback, or a
  SIGTERM that killed it without a word) then waits until trainer/safety/startup_signals.py has its handlers in and
  unblocks them. The child must unblock them itself once it can answer them, as launch.py does; one that never does
  never sees them.
  """
  before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
  try:
    yield {attempt.HELD_SIGNALS_ENV: ','.join(str(int(s)) for s in signals)}  # For the child's environment.
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _blocks(pid: int, signal_name: str | None) -> bool:
  """Whether process `pid` has `signal_name` blocked (Linux's /proc; elsewhere False: it is waited for)."""
  try:
    with open(f'/proc/{pid}/status') as f:
      mask = next(int(line.split()[1], 16) for line in f if line.startswith('SigBlk:'))
  except (OSError, StopIteration, ValueError):
    return False
  return bool(signal_name) and bool(mask >> (signal.Signals[signal_name] - 1) & 1)


class Supervisor:
  """Runs `command` (a launch.py command line) until it ends for good; `run()` returns the exit code to use."""

  def __init__(self, command: list[str], workdir: str, max_restarts: int, backoff_s: float,
               writes_record: bool, preemption_signals: tuple[str, ...] = ()):
    self.command, self.workdir = command, workdir
    self.max_restarts, self.backoff_s = max_restarts, backoff_s
    self.writes_record = writes_record
    self.records: list[dict] = []
    self._child: subprocess.Popen | None = None
    self._unforwarded: list[int] = []  # Signals that came while the child was being started.
    self._killed_starting = False  # Asked to stop, the child never reached its handlers and was killed (_wait).
    self._stop = threading.Event()
    self._stop_signal = None
    # The run's own preemption notices (train.preemption_signals, e.g. SLURM's --signal=USR2@120) stop it too.
    self._stops = set(_STOP_SIGNALS) | {signal.Signals[name] for name in preemption_signals
                                        if name in signal.Signals.__members__}
    self._forwarded = tuple(self._stops | set(_FORWARDED))

  def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
    if signum in self._stops:
      self._stop_signal = signal.Signals(signum).name
      self._stop.set()
    if self._child is None:
      self._unforwarded.append(signum)  # The child is being started: _one forwards it once Popen returned.
    elif self._child.poll() is None:
      os.kill(self._child.pid, signum)

  def run(self) -> int:
    # gcsfs logs each write that ran out of retries with its traceback; _write's warning line says it once.
    logging.getLogger('gcsfs').setLevel(logging.CRITICAL)
    previous = {s: signal.signal(s, self._on_signal) for s in self._forwarded}
    try:
      return self._attempts()
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)

  def _attempts(self) -> int:
    gap = 0.0
    n = 0
    while True:
      n += 1
      returncode, record = self._one(n, gap)
      ended = time.monotonic()
      if self._stop.is_set():  # Asked to stop from outside: the child has saved; nothing to retry.
        # One killed while still starting ends as a stop does: 128 + the signal (its own SIGKILL is the record's).
        return 128 + signal.Signals[self._stop_signal] if self._killed_starting else _exit_code(returncode)
      if not record['retried']:
        return _exit_code(returncode)
      failures = [r for r in self.records if r['retried']]
      streak = _same_step_streak(failures)
      # A lost storage endpoint fails every attempt at start-up until it is back: not a crash loop, so the back-off
      # (growing with the streak) and --max_restarts decide when to stop.
      if streak >= CRASH_LOOP and returncode != storage.STALL_EXIT_CODE:
        self._finish_record(record, False)
        _say(f'{streak} attempts in a row failed before saving past step {record["resumed_step"] or 0} (the last: '
             f'{record["cause"]}): a crash loop, not restarted again. Each attempt is a line in '
             f'{self.workdir}/attempts.jsonl; the output above shows the failure.')
        return _exit_code(returncode)
      if n > self.max_restarts:
        self._finish_record(record, False)
        _say(f'attempt {n} ended with {record["cause"]} (exit {returncode}) and --max_restarts={self.max_restarts} '
             f'restarts are used up; stopped. Relaunch the same command to resume from the newest intact checkpoint '
             f'(attempts in {self.workdir}/attempts.jsonl).')
        return _exit_code(returncode)
      wait = min(self.backoff_s * 2 ** (streak - 1), _MAX_BACKOFF_S) if streak else self.backoff_s
      _say(f'attempt {n} ended with {record["cause"]} (exit {returncode}); restarting from the newest intact '
           f'checkpoint in {wait:g}s (attempt {n + 1}, restart {n} of --max_restarts={self.max_restarts}).',
           'restarting')
      if self._stop.wait(wait):
        return _exit_code(returncode)
      gap = time.monotonic() - ended

  def _one(self, n: int, gap: float) -> tuple[int, dict]:
    fd, status_file = tempfile.mkstemp(prefix='launch-attempt-', suffix='.json')
    os.close(fd)
    beat_file = status_file[:-len('.json')] + '-heartbeat.json'
    env = {**os.environ, 'LAUNCH_ATTEMPT': str(n), 'LAUNCH_STATUS_FILE': status_file,
           'LAUNCH_RESTART_GAP_S': f'{gap:.3f}', heartbeat.ENV: beat_file}
    started = time.time()
    try:
      self._child = None  # A signal from here until the child is known is forwarded to it once it is.
      with signals_held(self._forwarded) as held:
        # Its own process group: a terminal's Ctrl-C reaches this parent alone, which forwards it once.
        self._child = subprocess.Popen(self.command_for(n), env={**env, **held}, process_group=0,
                                       preexec_fn=die_with_parent())
      for signum in self._unforwarded:
        os.kill(self._child.pid, signum)
      self._unforwarded.clear()
      returncode, frozen = self._wait(n, beat_file, started)
      if returncode - 128 in self._stops and returncode not in _NOT_RETRIED and not self._stop.is_set():
        self._stop.wait(_PEER_STOP_GRACE_S)
      status = attempt.read(status_file)
    finally:
      for path in (status_file, beat_file):
        if os.path.exists(path):
          os.unlink(path)
    retried, cause = classify(returncode, status)
    if frozen:
      retried, cause = True, 'hang (frozen; ended by the supervisor)'
    if self._stop.is_set():
      retried, cause = False, self._stopped_cause(returncode, cause)
    record = {'attempt': n, 'start': round(started, 3), 'end': round(time.time(), 3), 'exit_code': returncode,
              'cause': cause, 'resumed_step': status.get('resumed_step'), 'last_step': status.get('last_step'),
              'steps_redone': status.get('steps_redone', 0), 'retried': retried}
    for key in ('phase', 'resumed_from', 'restore_s'):  # Where the run was restored from (a tier), and how fast.
      if key in status:
        record[key] = status[key]
    record.update({k: status[k] for k in _SIZE_FIELDS if k in status})
    if frozen:
      record['detail'] = frozen
    self.records.append(record)
    # A launch refused because the workdir is in use leaves the live run's record alone.
    if status.get('process_index', 0) == 0 and self.writes_record and not status.get('workdir_in_use'):
      self._append(record)
    return returncode, record

  def _stopped_cause(self, returncode: int, cause: str) -> str:
    """What happened to an attempt this supervisor was asked to stop: the signal it received and forwarded."""
    received = f'stopped by {self._stop_signal}, which the supervisor received and forwarded to the training process'
    if returncode < 0:
      return f'{received}; it was killed by {signal.Signals(-returncode).name}'
    if returncode - 128 in self._stops:
      return f'{received}; it stopped with it (exit {returncode})'
    return f'{received}; it ended: {cause} (exit {returncode})'

  def _wait(self, n: int, beat_file: str, started: float) -> tuple[int, str | None]:
    """The child's exit code, and why the supervisor ended it if it did: no progress past its hang limit."""
    stop_seen = None
    while True:
      try:
        return self._child.wait(timeout=1.0), None
      except subprocess.TimeoutExpired:
        why = None if self._stop.is_set() else heartbeat.overdue(beat_file, started)
      if self._stop.is_set():
        stop_seen = stop_seen or time.monotonic()
        if time.monotonic() - stop_seen > _STARTING_STOP_GRACE_S and _blocks(self._child.pid, self._stop_signal):
          _say(f'attempt {n}: asked to stop ({self._stop_signal}), the training process was still starting after '
               f'{_STARTING_STOP_GRACE_S:g}s with the signal held (never reached its handlers: check the filesystem '
               'its Python imports from); killed it (SIGKILL), nothing of it to save.', 'interrupted')
          self._child.kill()
          self._killed_starting = True
          return self._child.wait(), None
      if why:
        break
    _say(f'attempt {n}: {why}, and its own hang watch did not end it (the process is frozen: stopped, or stuck where '
         f'no thread of it runs); ending it (SIGTERM, then SIGKILL after {heartbeat.GRACE_S:g}s) to restart it.', 'hang')
    os.kill(self._child.pid, signal.SIGTERM)
    try:
      return self._child.wait(timeout=heartbeat.GRACE_S), why
    except subprocess.TimeoutExpired:
      self._child.kill()  # The only signal a stopped process acts on.
      return self._child.wait(), why

  def command_for(self, n: int) -> list[str]:
    """Attempt n's command line: a restart resumes, so a --start_over given for the first attempt is not repeated."""
    return self.command if n == 1 else [*self.command, '--nostart_over']

  def _finish_record(self, record: dict, retried: bool) -> None:
    """Rewrites the last line of attempts.jsonl: the attempt that was to be retried is not, after all."""
    record['retried'] = retried
    if not self.writes_record:
      return
    def rewrite():
      path = storage.path(self.workdir) / 'attempts.jsonl'
      lines = path.read_text().splitlines()[:-1] + [json.dumps(record)]
      confined.write_text(path, '\n'.join(lines) + '\n')

    self._write('rewriting', rewrite)

  def _append(self, record: dict) -> None:
    def append():
      path = storage.path(self.workdir) / 'attempts.jsonl'
      before = path.read_text() if path.exists() else ''
      if before and not before.endswith('\n'):
        before = before[:before.rfind('\n') + 1]  # A line torn by a kill is dropped, not glued to the next.
      _mark_resize(record, before)
      confined.write_text(path, before + json.dumps(record) + '\n')

    self._write('appending to', append)

  def _write(self, what: str, write) -> None:
    """`write()` of attempts.jsonl, within ckpt.storage_deadline_s in a bucket; a failure is one warning line."""
    try:
      storage.within_deadline(f'{what} attempts.jsonl', self.workdir, write)
    except Exception as e:  # pylint: disable=broad-except  (a lost bucket raises aiohttp's or gcsfs's own types)
      text = ' '.join(str(e).split())[:300] or type(e).__name__
      _say(f'could not write {self.workdir}/attempts.jsonl ({type(e).__name__}: {text}); the run goes on without '
           f'this record.', 'warning')


def _mark_resize(record: dict, earlier: str) -> None:
  """An elastic attempt at another size than the last one that noted its size: `resized: 'M -> N processes'`."""
  if 'processes' not in record:
    return
  for line in reversed(earlier.splitlines()):
    try:
      before = json.loads(line).get('processes')
    except (ValueError, AttributeError):
      continue
    if before is not None:
      if before != record['processes']:
        record['resized'] = f'{before} -> {record["processes"]} processes'
      return


def _same_step_streak(failures: list[dict]) -> int:
  """How many of the latest failed attempts in a row resumed from the same step as the last one."""
  streak = 0
  for record in reversed(failures):
    if record['resumed_step'] != failures[-1]['resumed_step']:
      break
    streak += 1
  return streak


def _exit_code(returncode: int) -> int:
  return returncode if returncode >= 0 else 128 - returncode  # A signal's negative code as a shell shows it.
