"""Runs launch.py as several CPU processes on this machine, joined over 127.0.0.1: a multi-host run in miniature.

  .venv/bin/python scripts/launch_local.py --num_processes=2 --devices_per_process=4 \\
      --config=configs/tiny.py --workdir=/tmp/two_processes [--config.train.steps=20 ...]

Every argument it does not know goes to launch.py unchanged. Each process gets
`--coordinator_address=127.0.0.1:PORT` (a free port), `--num_processes`, its own
`--process_id`, `JAX_PLATFORMS=cpu` and `XLA_FLAGS=--xla_force_host_platform_device_count=K`,
so the run sees num_processes x K devices. Output lines are prefixed with the
process index (`[0] ...`). When a process fails, or --timeout_s passes, the
others are stopped and this script exits non-zero (the failing process's exit
code, or 124 on timeout). --dry_run prints the commands and runs nothing.

--elastic_min_processes=M: a launch.py that dies is a lost host, not started again; the others wait
--distributed_timeout_s for it to rejoin, then end (exit 76), and are started again as a smaller job of at least M
processes, which trains on at the same global batch (trainer/supervision/elastic.py; docs/supervisor.md, "Elastic
runs"). A relaunch with every process grows the run back.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP to this script are forwarded to every process, which saves and stops as a
launch.py does; it exits 128 + the signal (143, 130, 129). The processes die with it even when it is killed
without a word (kill -9): each is started with Linux's parent-death signal (PR_SET_PDEATHSIG, as launch.py's
supervisor starts its training process) set to SIGTERM, so a run left without its launcher saves and stops and
frees the workdir's lock, rather than training headless to the end. Chosen over a pipe each process would
watch because launch.py already acts on SIGTERM in every phase and needs no change for it.
"""

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from trainer.base import interpreter  # noqa: E402
interpreter.require_packages('launch_local.py')  # Its launch.py processes need them.
from trainer.supervision import supervisor  # noqa: E402  (die_with_parent, signals_held)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_SAVE_GRACE_S = 60  # After a forwarded stop signal, the processes get this long to save before SIGKILL.
_OWN_FLAGS = ('--coordinator_address', '--num_processes', '--process_id')
_GRACE_S = 3  # After the first failure, the others get this long to print their own error and exit.


def free_port() -> int:
  """A port nothing listens on now, on any interface (the coordinator binds them all)."""
  with socket.socket() as s:
    s.bind(('', 0))
    return s.getsockname()[1]


def process_env(devices_per_process: int) -> dict[str, str]:
  """The variables each process gets on top of this environment (replacing any device count already there)."""
  xla_flags = re.sub(r'--xla_force_host_platform_device_count=\S*', '', os.environ.get('XLA_FLAGS', '')).split()
  xla_flags.append(f'--xla_force_host_platform_device_count={devices_per_process}')
  return {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ' '.join(xla_flags), 'PYTHONUNBUFFERED': '1'}


def commands(num_processes: int, port: int, launch_args: list[str]) -> list[list[str]]:
  return [[sys.executable, str(REPO / 'launch.py'), *launch_args, f'--coordinator_address=127.0.0.1:{port}',
           f'--num_processes={num_processes}', f'--process_id={i}'] for i in range(num_processes)]


# Gloo (the CPU collectives) prints one line per device and collective group as its peers connect: 16 lines for two
# processes of 4 devices, interleaved with the log. Only a shortfall (fewer peers than expected) is news.
_GLOO_CONNECTED = re.compile(r'\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. '
                             r'Expected number of connected peer ranks is : (\d+)\s*$')


def _relay(stream, sink, prefix: str) -> None:
  for line in stream:
    gloo = _GLOO_CONNECTED.match(line)
    if gloo and gloo.group(1) == gloo.group(2):
      continue
    sink.write(prefix + line)
    sink.flush()


def _stop(procs: list[subprocess.Popen], received: int | None = None) -> None:
  """SIGTERM (or the stop signal this script `received`, with time to save), then SIGKILL, to each still-running
  process's whole group (its own session, see run)."""
  first = (signal.SIGTERM, 3) if received is None else (received, _SAVE_GRACE_S)
  for sig, wait_s in (first, (signal.SIGKILL, 5)):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait_s
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
      time.sleep(0.1)


def _exit_code(returncode: int) -> int:
  return returncode if returncode >= 0 else 128 - returncode  # A signal's negative code as the shell shows it.


def max_restarts(launch_args: list[str]) -> int:
  """The --max_restarts launch.py will use (its flag, else $LAUNCH_MAX_RESTARTS, else 3); 0 when it is unreadable."""
  given = [a.split('=', 1)[1] for a in launch_args if a.startswith('--max_restarts=')]
  given += [b for a, b in zip(launch_args, launch_args[1:]) if a == '--max_restarts']
  value = given[-1] if given else (os.environ.get('LAUNCH_MAX_RESTARTS', '').strip() or '3')
  return int(value) if value.isdigit() else 0


def run(cmds: list[list[str]], env: dict[str, str], timeout_s: float, restarts: int = 0,
        ends: list[int] | None = None) -> int:
  """Starts every command, relays its output with a `[i] ` prefix, and returns the exit code for the whole run.

  `restarts` (launch.py's --max_restarts): each process's launch.py supervises its own training process, and the
  survivors of a lost peer restart theirs. A launch.py killed by a signal (kill -9 of the supervisor itself) has no
  one to restart it: it is started again here, up to `restarts` times, to rejoin the group, and the others are
  left alone (stopping them then killed them mid-start-up: a C++ abort, issue 39).

  `ends` (an elastic run, see run_elastic): a failed process does not stop the others, which end on their own (exit
  76 once the lost one has not rejoined within --distributed_timeout_s); every exit code is appended to `ends`, and
  no error line is printed, unless a stop signal or the timeout ended the run (then `ends` stays empty).
  """
  procs, relays = [], []
  deadline = time.monotonic() + timeout_s if timeout_s > 0 else float('inf')
  code, reason = 0, ''
  received = []  # The stop signal this script got; the loop below forwards it (a handler only records it).
  for sig in _STOP_SIGNALS:
    signal.signal(sig, lambda signum, frame: received.append(signum))

  def start(i: int) -> subprocess.Popen:
    # Own session per process: stopping it takes its children too, and Ctrl-C reaches only this script. A stop
    # forwarded while it still starts Python waits for launch.py's handlers (signals_held), not a traceback.
    with supervisor.signals_held(_STOP_SIGNALS) as held:
      p = subprocess.Popen(cmds[i], env={**os.environ, **env, **held}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, bufsize=1, start_new_session=True,
                           preexec_fn=supervisor.die_with_parent(signal.SIGTERM))
    for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
      relays.append(threading.Thread(target=_relay, args=(stream, sink, f'[{i}] '), daemon=True))
      relays[-1].start()
    return p

  for i in range(len(cmds)):
    if not received:
      procs.append(start(i))
  while any(p.poll() is None for p in procs) and not received:
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    for i in [i for i in failed if procs[i].returncode < 0 and restarts > 0]:
      restarts -= 1
      print(f'launch_local.py: restarting: the launch.py of process {i} was killed by '
            f'{signal.Signals(-procs[i].returncode).name}; started it again to rejoin the group '
            f'({restarts} restart(s) left).', file=sys.stderr, flush=True)
      procs[i] = start(i)
      failed.remove(i)
    if failed and ends is None:
      grace_end = time.monotonic() + _GRACE_S
      while any(p.poll() is None for p in procs) and time.monotonic() < grace_end:
        time.sleep(0.1)
      break
    if time.monotonic() > deadline:
      code, reason = 124, f'--timeout_s={timeout_s:g} passed'
      break
    time.sleep(0.2)
  stopped = [i for i, p in enumerate(procs) if p.poll() is None]
  _stop(procs, received[0] if received else None)
  for t in relays:
    t.join(timeout=5)
  if received:
    return _interrupted(received[0], procs, stopped)
  if ends is not None and not code:
    ends.extend(p.returncode for p in procs)
    return next((_exit_code(p.returncode) for p in procs if p.returncode), 0)
  failed = [i for i, p in enumerate(procs) if p.returncode and i not in stopped]
  if not code and failed:
    # A process that lost a peer exits 75 (parallel/watchdog.py) because another failed first: name the cause.
    cause = next((i for i in failed if procs[i].returncode != 75), failed[0])
    first = procs[cause].returncode
    how = f'was killed by {signal.Signals(-first).name}' if first < 0 else f'exited with code {first}'
    code, reason = _exit_code(first), f'process {cause} {how}'
  if code:
    also = f'; stopped process{"es" if len(stopped) > 1 else ""} {", ".join(map(str, stopped))}' if stopped else ''
    print(f'launch_local.py: error: {reason}{also}.', file=sys.stderr)
  return code


# launch.py's exits that say a process is alive but short of peers (watchdog.PEER_LOST_EXIT_CODE, and
# elastic.PROCESSES_MISSING_EXIT_CODE after waiting for the lost one to rejoin), and those that end the run as they are.
_SHORT_OF_PEERS = (75, 76)
_FINAL = (0, 2, 3, 130)


def run_elastic(num_processes: int, min_processes: int, port: int, env: dict[str, str], launch_args: list[str],
                timeout_s: float) -> int:
  """Runs the group; when processes are lost and the others end short of peers, starts those as a smaller job.

  A launch.py that dies (killed, or its supervisor gave up) is a lost host: it is not started again here. The
  survivors' supervisors restart their training processes, which wait --distributed_timeout_s for it to rejoin and
  then exit 76; the survivors are then started again as a job of their count, renumbered from 0, each launch.py told
  the run's full size (--elastic_full_processes), which recomputes the mesh and gradient accumulation
  (trainer/supervision/elastic.py). A relaunch with all processes grows the run back the same way.
  """
  members = list(range(num_processes))  # The original process ids in this job, by new id.
  deadline = time.monotonic() + timeout_s if timeout_s > 0 else float('inf')
  while True:
    ends: list[int] = []
    cmds = commands(len(members), port or free_port(), launch_args)
    code = run(cmds, env, max(deadline - time.monotonic(), 1) if timeout_s > 0 else 0, 0, ends)
    final = [c for c in ends if c in _FINAL and c]
    lost = [i for i, c in enumerate(ends) if c not in _FINAL + _SHORT_OF_PEERS]
    if not ends or not code or final or not lost:
      if ends and code:
        print(f'launch_local.py: error: {_ends(members, ends)}.', file=sys.stderr)
      return code
    survivors = [members[i] for i, c in enumerate(ends) if c in _SHORT_OF_PEERS]
    if len(survivors) < min_processes:
      print(f'launch_local.py: error: {_ends(members, ends)}: {len(survivors)} process(es) left, fewer than '
            f'--elastic_min_processes={min_processes}; relaunch the same command when the hosts are back (the run '
            f'resumes from its newest checkpoint).', file=sys.stderr)
      return code
    print(f'launch_local.py: elastic: {_ends(members, ends)}; starting the {len(survivors)} left (process(es) '
          f'{", ".join(map(str, survivors))}) as a job of {len(survivors)} of the run\'s {num_processes} processes, '
          f'from its newest checkpoint at the same global batch (a relaunch with all {num_processes} grows it back).',
          file=sys.stderr, flush=True)
    members, port = survivors, 0  # A fresh coordinator port: the old one may linger.


def _ends(members: list[int], ends: list[int]) -> str:
  """How each process of a job ended, by its original id: 'process 1 was killed by SIGKILL, process 0 exited 76'."""
  def how(code: int) -> str:
    return f'was killed by {signal.Signals(-code).name}' if code < 0 else f'exited with code {code}'
  return ', '.join(f'process {members[i]} {how(c)}' for i, c in enumerate(ends) if c)


def _interrupted(signum: int, procs: list[subprocess.Popen], stopped: list[int]) -> int:
  """The one line for a stop signal this script received and forwarded; 128 + it."""
  ends = ', '.join(f'{i}: exit {_exit_code(procs[i].returncode)}' for i in stopped) or 'none was still running'
  print(f'launch_local.py: interrupted: {signal.Signals(signum).name} received: forwarded to every process, which '
        f'stopped ({ends}); relaunch the same command to resume from the newest checkpoint.', file=sys.stderr)
  return 128 + signum


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
  parser.add_argument('--num_processes', type=int, default=2, help='processes to start (default 2)')
  parser.add_argument('--devices_per_process', type=int, default=4, help='fake CPU devices each (default 4)')
  parser.add_argument('--timeout_s', type=float, default=0, help='stop everything after this long; 0 = never')
  parser.add_argument('--port', type=int, default=0, help='coordinator port on 127.0.0.1 (default: a free one)')
  parser.add_argument('--dry_run', action='store_true', help='print each command with its environment; run nothing')
  parser.add_argument('--elastic_min_processes', type=int, default=0,
                      help='elastic: when processes are lost and not back within --distributed_timeout_s, go on with '
                           'those left if at least this many (docs/supervisor.md); 0 = off (default)')
  args, launch_args = parser.parse_known_args()
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error('--num_processes and --devices_per_process must be >= 1')
  if not 0 <= args.elastic_min_processes <= args.num_processes:
    parser.error(f'--elastic_min_processes={args.elastic_min_processes} must be from 1 to --num_processes='
                 f'{args.num_processes} (0: not elastic)')
  own = _OWN_FLAGS + (('--elastic_full_processes',) if args.elastic_min_processes else ())
  taken = [a for a in launch_args if a.split('=')[0] in own]
  if taken:
    parser.error(f'{", ".join(taken)}: this script sets the coordinator, the process count and each process id')
  env = process_env(args.devices_per_process)
  if args.elastic_min_processes:  # Every job, the smaller ones too, is told the size its config is written for.
    launch_args = [*launch_args, f'--elastic_full_processes={args.num_processes}']
  cmds = commands(args.num_processes, args.port or free_port(), launch_args)
  if args.dry_run:
    for i, cmd in enumerate(cmds):
      print(f'# process {i}\n' + ' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items()) + ' ' + shlex.join(cmd))
    return 0
  if args.elastic_min_processes:
    return run_elastic(args.num_processes, args.elastic_min_processes, args.port, env, launch_args, args.timeout_s)
  return run(cmds, env, args.timeout_s, max_restarts(launch_args))


if __name__ == '__main__':
  sys.exit(main())
