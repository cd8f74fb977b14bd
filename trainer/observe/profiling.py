"""Profiling sessions: a scheduled trace window, on-demand captures, and a memory profile on OOM.

Traces go to WORKDIR/plugins/profile/<timestamp>/<host>.xplane.pb, which is
where TensorBoard's profile plugin (the `xprof` package) looks, so
`tensorboard --logdir WORKDIR` lists them under Profile. Three ways to get one:

- `profile.trace_window=True`: steps start_step .. start_step + num_steps - 1.
  start_step defaults past the first steps, whose warm-up would crowd the trace.
- SIGUSR1 (`kill -USR1 PID`): the next num_steps steps of a running job; the
  handler only sets a flag, the loop starts the trace at its next step.
- `profile.server_port`: jax.profiler's server, for TensorBoard's "Capture
  profile" button (or `xprof`'s) to pull a trace of a few seconds on demand.

Every process traces itself; on a multi-host run each host writes its own file.
With a gs:// workdir the trace is written to a local temporary folder and
copied into the bucket when it stops: jax's own gs:// writer ignores an
emulator's address (it asked www.googleapis.com with STORAGE_EMULATOR_HOST set).
"""

import os
import pathlib
import shutil
import signal
import socket
import tempfile
import threading
import time

import jax
from absl import logging

from trainer.base import confined, storage
from trainer.base.errors import UserError
from trainer.safety import startup_signals


def check_config(profile) -> None:
  """Refuses profile.* values that cannot work, before anything is compiled."""
  if profile.num_steps < 1:
    raise UserError(f'profile.num_steps={profile.num_steps}: a trace needs at least 1 step; '
                    'set --config.profile.num_steps=5 (say).')
  if profile.start_step < 1:
    raise UserError(f'profile.start_step={profile.start_step}: steps count from 1; pick a step past the first '
                    'few, e.g. --config.profile.start_step=10.')
  if not 0 <= profile.server_port <= 65535:
    raise UserError(f'profile.server_port={profile.server_port}: expected a TCP port (1..65535), or 0 for no '
                    'profiler server.')


_PORTS_TO_TRY = 64


def _port_is_free(port: int) -> bool:
  """Whether a server can listen on `port` on every interface, as jax's profiler server does."""
  family, host = (socket.AF_INET6, '::') if socket.has_ipv6 else (socket.AF_INET, '')
  try:
    with socket.socket(family, socket.SOCK_STREAM) as s:
      s.bind((host, port))
    return True
  except OSError:
    return False


def is_out_of_memory(error: BaseException) -> bool:
  """XLA reports a failed device allocation as RESOURCE_EXHAUSTED (an XlaRuntimeError).

  A full disk is not: tensorstore reports ENOSPC as RESOURCE_EXHAUSTED too, and a
  failed save arrives as trainer.safety.disk.SaveFailedError (a UserError).
  """
  from trainer.safety import disk
  if isinstance(error, (UserError, OSError)) or disk.write_failure(error) is not None:
    return False
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'Out of memory' in text or 'out of memory' in text


class Profiler:
  """Starts and stops traces at step boundaries; the loop calls `step(n, state)` before each step."""

  def __init__(self, profile, workdir: str, first_step: int, total_steps: int, goodput=None):
    check_config(profile)
    self._goodput = goodput  # trainer.observe.goodput.Goodput: time spent writing traces out is counted apart.
    self._workdir = storage.path(workdir)
    self._staging = None  # With a gs:// workdir: the local folder the trace in progress is written to.
    self._num_steps = profile.num_steps
    self._memory_on_oom = profile.memory_on_oom
    self._requested = threading.Event()  # Set by SIGUSR1; read at the next step boundary.
    self._active_until = None  # Last step of the trace in progress, if any.
    self._window = None
    self._server = None
    self._previous_handler = None
    if profile.trace_window:
      start, end = profile.start_step, profile.start_step + profile.num_steps - 1
      if end < first_step or start > total_steps:
        logging.warning('profile.trace_window: steps %d..%d are outside this launch\'s steps %d..%d; no scheduled '
                        'trace (set --config.profile.start_step).', start, end, first_step, total_steps)
      else:
        self._window = (max(start, first_step), end)
    if profile.server_port:
      self._start_server(profile.server_port)
    if startup_signals.profile_requested_early():  # A SIGUSR1 that came while the launch was still starting.
      self._requested.set()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, 'SIGUSR1'):
      self._previous_handler = signal.signal(signal.SIGUSR1, self._on_signal)
      logging.info('Profiling on demand: kill -USR1 %d traces the next %d steps into %s.', os.getpid(),
                   self._num_steps, self.trace_dir)

  def _start_server(self, wanted: int) -> None:
    """jax's profiler server on `wanted`, or the next free port (several processes share a host under SLURM).

    The server only logs when it cannot bind, so the port is checked first.
    """
    port = next((p for p in range(wanted, min(wanted + _PORTS_TO_TRY, 65536)) if _port_is_free(p)), None)
    if port is None:
      logging.warning('profile.server_port: ports %d..%d are all taken; no profiler server.', wanted,
                      wanted + _PORTS_TO_TRY - 1)
      return
    self._server = jax.profiler.start_server(port)
    logging.info('Profiler server on port %d%s: in TensorBoard, Profile > Capture profile > %s:%d.', port,
                 '' if port == wanted else f' ({wanted} was taken)', socket.gethostname(), port)

  @property
  def trace_dir(self) -> storage.Path:
    return self._workdir / 'plugins' / 'profile'

  def _on_signal(self, signum, frame) -> None:
    del signum, frame  # Only a flag: a signal handler must not call into the profiler mid-step.
    self._requested.set()

  def step(self, step: int, state) -> float:
    """Called before dispatching `step`; `state` is the previous step's output (blocked on to end a trace).

    Returns the seconds spent writing a finished trace out, for the loop to keep out of the step time.
    """
    spent = 0.0
    if self._active_until is not None and step > self._active_until:
      spent = self._stop(state)
    if self._active_until is None:
      if self._window is not None and step == self._window[0]:
        self._start(step, self._window[1], 'profile.trace_window')
        self._window = None
      elif self._requested.is_set():
        self._requested.clear()
        self._start(step, step + self._num_steps - 1, 'SIGUSR1')
    return spent

  def _start(self, first: int, last: int, why: str) -> None:
    log_dir = self._workdir
    if storage.is_cloud(self._workdir):
      log_dir = self._staging = pathlib.Path(tempfile.mkdtemp(prefix='jax_launch_trace_'))
    try:
      jax.profiler.start_trace(str(log_dir))
    except RuntimeError as e:  # E.g. a capture from TensorBoard through the profiler server is running.
      logging.warning('Could not start profiling steps %d..%d (%s): %s', first, last, why, e)
      return
    logging.info('Profiling steps %d..%d (%s) into %s', first, last, why, self.trace_dir)
    self._active_until = last

  def _stop(self, state) -> float:
    jax.block_until_ready(state)  # Steps run asynchronously: wait until the traced ones finished on device.
    start = time.perf_counter()
    jax.profiler.stop_trace()
    if self._staging is not None:
      storage.upload_folder(self._staging, self._workdir)
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
    spent = time.perf_counter() - start
    logging.info('Trace written under %s in %.1fs: open it in TensorBoard > Profile (needs `pip install xprof`).',
                 self.trace_dir, spent)
    self._active_until = None
    if self._goodput is not None:
      self._goodput.record_side(profiling_s=spent)
    return spent

  def close(self, state=None) -> None:
    """Ends a trace still running (the run ended inside its window), the server and the signal handler."""
    if self._active_until is not None:
      self._stop(state)
    if self._server is not None:
      jax.profiler.stop_server()
      self._server = None
    if self._previous_handler is not None:
      signal.signal(signal.SIGUSR1, self._previous_handler)
      self._previous_handler = None

  def on_error(self, error: BaseException) -> None:
    """Called with the exception that ends the run: on out-of-memory, saves the device memory profile."""
    if self._memory_on_oom and is_out_of_memory(error):
      self.save_memory_profile()

  def save_memory_profile(self) -> storage.Path | None:
    """Writes WORKDIR/memory_profiles/oom-HOST-TIME.prof (pprof); None where the backend has no profile."""
    path = self._workdir / 'memory_profiles' / f'oom-{socket.gethostname()}-{time.strftime("%Y%m%d-%H%M%S")}.prof'
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      confined.write_bytes(path, jax.profiler.device_memory_profile())  # What save_device_memory_profile writes.
    except Exception as e:  # The run is already failing: report this, but keep the original error.
      logging.error('Out of memory; could not save a device memory profile: %s', e)
      return None
    logging.error('Out of memory: device memory profile saved to %s (read it with `pprof -http=: %s`: which '
                  'arrays held the memory, by the code that made them).', path, path)
    return path
