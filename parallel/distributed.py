"""Joining the processes of a multi-process run: `jax.distributed.initialize`, before any device is touched.

Three kinds of launch:
- explicit: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` on
  every process (any launcher, `scripts/launch_local.py`, a shell loop);
- detected: SLURM with more than one task, or a Cloud TPU VM (one host or a pod
  slice), where jax's own cluster detection (`jax.distributed.initialize()` with
  no arguments) finds the coordinator, the process count and this process's id;
- single process: neither of the above; nothing to join.

Why a check-in before jax's join: when a process never arrives, jax's
coordination client does not raise; it aborts the whole interpreter after the
timeout with `DEADLINE_EXCEEDED` and a C++ stack trace that names nobody. So in
an explicit launch every process first checks in with process 0 over plain TCP
on the coordinator port (which jax takes over right after): process 0 knows
who arrived, and every waiting process ends at `--distributed_timeout_s` with
one UserError naming the missing process ids. In a detected launch the
coordinator address is only known inside jax, so a watchdog prints the same kind
of line and exits with code 2 just before jax's own deadline would abort.

Once joined, an explicit launch keeps watching its peers (parallel/watchdog.py):
a process that dies or stops answering later is named by every survivor in one
line, instead of a hang and a C++ abort.
"""

import os
import pathlib
import re
import socket
import sys
import threading
import time

import jax
from absl import logging

from parallel import watchdog
from trainer.base.errors import UserError

# jax's own deadline in a detected launch; the watchdog fires this much earlier.
_WATCHDOG_LEAD_S = 10
_POLL_S = 0.25
_ADDRESS = re.compile(r'^(?P<host>\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(?P<port>\d+)$')


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
               timeout_s: int = 300, missing_exit_code: int = 2) -> None:
  """Joins this process to the others, or does nothing in a single-process launch.

  Args:
    coordinator_address: 'host:port' of process 0, reachable from every process.
    num_processes: how many processes the run has, all hosts together.
    process_id: this process's index, 0 .. num_processes - 1.
    timeout_s: how long any process waits for all of them to join.
    missing_exit_code: the exit code of a launch some process did not join within `timeout_s` (2, or the elastic
      run's request for a smaller job, trainer/supervision/elastic.py).

  Raises:
    UserError: a bad flag; ProcessesMissing: a process that did not join within `timeout_s`.
  """
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
    raise UserError(f'--distributed_timeout_s={timeout_s!r} must be a whole number of seconds >= 1.')
  given = {'--coordinator_address': coordinator_address, '--num_processes': num_processes,
           '--process_id': process_id}
  if all(value is None for value in given.values()):
    cluster = detected_cluster()
    if cluster is not None:
      _use_cpu_collectives()
      _initialize_detected(cluster, timeout_s, missing_exit_code)
    return
  if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
    return  # One process, said explicitly: nothing to join.
  missing = [flag for flag, value in given.items() if value is None]
  if missing:
    raise UserError(f'{" and ".join(missing)} missing: a multi-process launch needs --coordinator_address, '
                    f'--num_processes and --process_id on every process (none of them under SLURM or on a TPU pod).')
  host, port = _check_flags(coordinator_address, num_processes, process_id)
  if num_processes > 1:
    _use_cpu_collectives()
    start = time.monotonic()
    address = coordinator_address.strip()
    try:
      heartbeat = _check_in(host, port, address, num_processes, process_id, timeout_s)
    except ProcessesMissing as e:
      e.exit_code = missing_exit_code
      raise
    _join(address, num_processes, process_id, timeout_s)
    if process_id == 0:
      threading.Thread(target=watchdog.serve, args=(heartbeat, num_processes, timeout_s), daemon=True,
                       name='peer-watchdog').start()
    else:
      watchdog.join(host, heartbeat, process_id, num_processes, timeout_s)
    logging.info('Joined %d processes as process %d via the coordinator at %s in %.1fs', num_processes,
                 process_id, address, time.monotonic() - start)


class ProcessesMissing(UserError):
  """Not every process checked in within --distributed_timeout_s. Exit 2 (fix the launch) unless the run is elastic,
  where launch.py makes it the exit that asks the launcher for a smaller job (trainer/supervision/elastic.py)."""


class JoinTimedOut(UserError):
  """Every process checked in, but joining jax's coordination service timed out: a loaded host, worth a retry."""
  exit_code = watchdog.PEER_LOST_EXIT_CODE


def _join(address: str, num_processes: int, process_id: int, timeout_s: int) -> None:
  """jax.distributed.initialize, with a timeout or lost connection in it as one line and the exit the supervisor
  retries (it printed a DEADLINE_EXCEEDED traceback and was classed a crash under load, issue 39)."""
  try:
    jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=timeout_s)
  except Exception as e:  # pylint: disable=broad-except  (jax raises its runtime errors untyped for Python)
    text = ' '.join(str(e).split())
    if not any(code in text for code in ('DEADLINE_EXCEEDED', 'UNAVAILABLE')):
      raise
    raise JoinTimedOut(f'process {process_id} of {num_processes}: joining the coordinator at {address} failed after '
                       f'every process checked in ({text[:200]}); a loaded or restarting host is the usual cause. A '
                       f'supervised run retries; otherwise relaunch every process, or raise '
                       f'--distributed_timeout_s={timeout_s}.') from None


def _check_flags(address: str, num_processes: int, process_id: int) -> tuple[str, int]:
  """Validates the three explicit flags; returns the coordinator's host (brackets stripped) and port."""
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise UserError(f'--num_processes={num_processes!r} must be an integer >= 1 (all processes, all hosts together).')
  if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise UserError(f'--process_id={process_id!r} must be an integer from 0 to --num_processes-1 = '
                    f'{num_processes - 1}, different on every process.')
  match = _ADDRESS.match(address.strip())
  if not match or not 0 < int(match['port']) < 65536:
    raise UserError(f'--coordinator_address={address!r} is not HOST:PORT (e.g. 10.0.0.1:1234 or [::1]:1234): '
                    f'the host of process 0 and a free port there, the same on every process.')
  return match['host'].strip('[]'), int(match['port'])


def _use_cpu_collectives() -> None:
  # Without a CPU collectives implementation, XLA:CPU cannot run a computation
  # that spans processes; gloo rides on jax's distributed client. It must be set
  # before the CPU backend is created, and is harmless on GPU and TPU hosts.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def detected_cluster() -> str | None:
  """'SLURM', 'TPU pod' or 'Cloud TPU VM' when this is a launch that jax's cluster detection configures."""
  env = os.environ
  slurm_vars = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
  # The variables jax's SlurmCluster keys on; SLURM_STEP_NODELIST exists only inside `srun`.
  if all(v in env for v in slurm_vars) and env['SLURM_NTASKS'].isdigit() and int(env['SLURM_NTASKS']) > 1:
    return 'SLURM'
  hosts = env.get('TPU_PROCESS_ADDRESSES') or env.get('TPU_WORKER_HOSTNAMES') or ''
  if len([h for h in hosts.split(',') if h.strip()]) > 1 or env.get('MEGASCALE_NUM_SLICES', '1') not in ('', '1'):
    return 'TPU pod'
  if _on_cloud_tpu_vm():
    return 'Cloud TPU VM'
  return None


def _on_cloud_tpu_vm() -> bool:
  # A pod slice created on GCE lists its workers only in the metadata server,
  # which jax's detection reads; the environment does not show them. jax noted
  # at import whether this host has TPU chips and libtpu (no device touched, no
  # network), and on a single-host VM its detection finds one process.
  try:
    from jax._src import cloud_tpu_init  # Private, hence the guard; only read, never called.
  except ImportError:
    return False
  return bool(getattr(cloud_tpu_init, 'running_in_cloud_tpu_vm', False))


def _initialize_detected(cluster: str, timeout_s: int, missing_exit_code: int = 2) -> None:
  """jax.distributed.initialize() with a watchdog that turns jax's abort on a missing process into one line."""
  env = os.environ
  if cluster == 'SLURM':
    who = f'task {env["SLURM_PROCID"]} of {env["SLURM_NTASKS"]} of SLURM job {env["SLURM_JOB_ID"]}'
    check = (f'that every task of the job started (sacct -j {env["SLURM_JOB_ID"]}), and that the first node of '
             f'{env["SLURM_STEP_NODELIST"]} is reachable from all of them')
  else:
    who = f'TPU worker {env.get("TPU_WORKER_ID", "?")}'
    check = 'that the command was started on every worker of the slice (gcloud ... ssh --worker=all)'
  message = (f'not every process of this {cluster} launch joined within --distributed_timeout_s={timeout_s} '
             f'({who} waited for the others); check {check}.')
  done = threading.Event()

  def deadline():
    if not done.wait(timeout_s):
      # jax is blocked in C++ and will abort the interpreter; exit first, with the message.
      print(f'{pathlib.Path(sys.argv[0]).name}: error: {message}', file=sys.stderr, flush=True)
      os._exit(missing_exit_code)

  threading.Thread(target=deadline, daemon=True, name='distributed-join-watchdog').start()
  try:
    jax.distributed.initialize(initialization_timeout=timeout_s + _WATCHDOG_LEAD_S)
  except (RuntimeError, ValueError, OSError, ImportError) as e:  # Detection came up empty, or lacks `requests`.
    raise UserError(f'this looks like a {cluster} launch ({who}), but jax could not set up the processes: '
                    f'{" ".join(str(e).split())[:300]}. Pass --coordinator_address, --num_processes and '
                    f'--process_id explicitly.') from e
  finally:
    done.set()
  logging.info('Joined %d processes as process %d (%s, detected)', jax.process_count(), jax.process_index(),
               cluster)
  _watch_detected(timeout_s)


_WATCHDOG_KEY = 'jax_launch/peer_watchdog'


def _watch_detected(timeout_s: int) -> None:
  """The peer watchdog of an explicit launch, for one jax's detection joined (SLURM, a TPU pod).

  Without it a survivor learned of a lost process only when its next collective
  failed, as a Gloo traceback classed a crash (issue 39). Process 0 hosts jax's
  coordinator, so every process reaches its host already; the watchdog's port goes
  through jax's key-value store (a private module, hence read here alone).
  """
  num_processes, process_id = jax.process_count(), jax.process_index()
  if num_processes < 2:
    return
  from jax._src import distributed as jax_distributed
  try:
    client = jax_distributed.global_state.client
    host = jax_distributed.global_state.coordinator_address.rsplit(':', 1)[0].strip('[]')
    if process_id == 0:
      server = _listen(0)
      client.key_value_set(_WATCHDOG_KEY, str(server.getsockname()[1]))
      threading.Thread(target=_serve_or_warn, args=(server, num_processes, timeout_s), daemon=True,
                       name='peer-watchdog').start()
    else:
      port = int(client.blocking_key_value_get(_WATCHDOG_KEY, timeout_s * 1000))
      watchdog.join(host, port, process_id, num_processes, timeout_s)
  except Exception as e:  # pylint: disable=broad-except  (a port the cluster's firewall blocks; jax's untyped errors)
    _watchdog_missing(e)


def _serve_or_warn(server, num_processes: int, timeout_s: int) -> None:
  try:
    watchdog.serve(server, num_processes, timeout_s)
  except OSError as e:  # A process that never connected (its host cannot reach this port): TimeoutError.
    _watchdog_missing(e)


def _watchdog_missing(error: Exception) -> None:
  """The run goes on as before the watchdog existed in detected launches: a lost process shows when a collective fails."""
  logging.warning('The peer watchdog could not be set up (%s: %s); a lost process will show only when a collective '
                  'fails.', type(error).__name__, ' '.join(str(error).split())[:200])


def _check_in(host: str, port: int, address: str, num_processes: int, process_id: int, timeout_s: int):
  """Waits until all processes have checked in with process 0, or raises UserError naming who is missing.

  Returns process 0's peer-watchdog server socket on process 0, its port on the others.
  """
  deadline = time.monotonic() + timeout_s
  if process_id == 0:
    return _host_check_in(port, num_processes, deadline, address, timeout_s)
  return _join_check_in(host, port, num_processes, process_id, deadline, address, timeout_s)


def _listen(port: int) -> socket.socket:
  return socket.create_server(('', port), family=socket.AF_INET6, dualstack_ipv6=True) \
      if socket.has_dualstack_ipv6() else socket.create_server(('', port))


def _missing(joined: set[int], num_processes: int) -> str:
  ids = [i for i in range(num_processes) if i not in joined]
  return f'process{"es" if len(ids) > 1 else ""} {", ".join(map(str, ids))}'


def _not_joined_message(joined: set[int], num_processes: int, address: str, timeout_s: int) -> str:
  return (f'{_missing(joined, num_processes)} of {num_processes} did not join within --distributed_timeout_s='
          f'{timeout_s} ({len(joined)} of {num_processes} joined at the coordinator {address}); check that every '
          f'process was started with --num_processes={num_processes}, --coordinator_address={address} and its own '
          f'--process_id, and that {address} is reachable from its host.')


def _send(conn: socket.socket, line: str) -> None:
  try:
    conn.sendall(line.encode() + b'\n')
  except OSError:
    pass  # That process is gone; it reports its own failure.


def _host_check_in(port: int, num_processes: int, deadline: float, address: str, timeout_s: int) -> socket.socket:
  """Process 0: accepts every other process's `hello ID N` and answers `go PORT` (the watchdog's), or `fail MESSAGE`."""
  try:
    server = _listen(port)
  except OSError as e:
    raise UserError(f'process 0 cannot listen on port {port} of --coordinator_address={address} ({e.strerror}); '
                    f'another program (or another process 0) holds it: choose another port.') from e
  conns: dict[int, socket.socket] = {}
  try:
    while len(conns) < num_processes - 1:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        message = _not_joined_message(set(conns) | {0}, num_processes, address, timeout_s)
        for conn in conns.values():
          _send(conn, f'missing {message}')
        raise ProcessesMissing(message)
      server.settimeout(min(remaining, 1.0))
      try:
        conn, peer = server.accept()
      except TimeoutError:
        continue
      peer_host = peer[0].removeprefix('::ffff:')  # An IPv4 client as the dual-stack socket shows it.
      conn.settimeout(5)
      try:
        words = conn.makefile('r').readline().split()
      except OSError:
        words = []
      if len(words) != 3 or words[0] != 'hello' or not words[1].isdigit() or not words[2].isdigit():
        conn.close()  # Not one of ours (a port scan, a health check): ignore it.
        continue
      other_id, other_count = int(words[1]), int(words[2])
      problem = None
      if other_count != num_processes:
        problem = (f'process {other_id} (from {peer_host}) was started with --num_processes={other_count}, '
                   f'process 0 with --num_processes={num_processes}; give every process the same count.')
      elif other_id in conns or other_id == 0:
        problem = (f'two processes were started with --process_id={other_id} (one from {peer_host}); '
                   f'give each process its own id from 0 to {num_processes - 1}.')
      if problem:
        for c in [*conns.values(), conn]:
          _send(c, f'fail {problem}')
        conn.close()
        raise UserError(problem)
      conns[other_id] = conn
      logging.info('Process %d of %d checked in from %s', other_id, num_processes, peer_host)
    heartbeat = _listen(0)  # A free port for the peer watchdog; the coordinator port goes to jax next.
    for conn in conns.values():
      _send(conn, f'go {heartbeat.getsockname()[1]}')
    for conn in conns.values():  # Let them close first, so no connection lingers on the port jax takes next.
      try:
        conn.recv(1)
      except OSError:
        pass
  finally:
    for conn in conns.values():
      conn.close()
    server.close()
  return heartbeat


def _join_check_in(host: str, port: int, num_processes: int, process_id: int, deadline: float, address: str,
                   timeout_s: int) -> int:
  """Process 1..N-1: connects to process 0 (retrying until the deadline) and waits for its verdict."""
  last_error = 'no answer'
  while True:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      raise ProcessesMissing(f'process 0 of {num_processes} (the coordinator at {address}) did not join within '
                             f'--distributed_timeout_s={timeout_s}: process {process_id} could not reach it '
                             f'({last_error}); check that process 0 is running on {host} with --coordinator_address='
                             f'{address}, and that port {port} there is reachable from this host.')
    try:
      conn = socket.create_connection((host, port), timeout=min(remaining, 5))
      break
    except OSError as e:
      last_error = e.strerror or type(e).__name__
      time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0)))
  with conn:
    conn.sendall(f'hello {process_id} {num_processes}\n'.encode())
    # Process 0 decides at its own deadline; a little grace lets its verdict, which names who is missing, arrive.
    conn.settimeout(max(deadline - time.monotonic(), 0) + 5)
    try:
      answer = conn.makefile('r').readline().strip()
    except TimeoutError:
      answer = ''
    except OSError as e:
      answer = f'lost {e.strerror}'
    if answer.startswith('go ') and answer[3:].isdigit():
      return int(answer[3:])  # Process 0's peer-watchdog port.
    if answer.startswith('fail '):
      raise UserError(answer[len('fail '):])
    if answer.startswith('missing '):
      raise ProcessesMissing(answer[len('missing '):])
    raise ProcessesMissing(f'process {process_id} of {num_processes} reached the coordinator at {address}, but '
                           f'process 0 did not report all {num_processes} processes joined within '
                           f'--distributed_timeout_s={timeout_s}{" (connection " + answer + ")" if answer else ""}; see '
                           f'process 0\'s log for which are missing.')
