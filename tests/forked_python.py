"""`python launch.py ...` (or another of the repository's scripts) for the suite, forked from a process that has
already imported the trainer.

A launch spends about 1.4 s of CPU importing jax, flax, optax, Orbax, grain and tensorboardX before it reads its
flags, and the suite starts a few hundred launches on a 2-core machine. Each test process keeps a server (this file,
run as a script) that imports what launch.py imports, in launch.py's order, and then waits; a command asked of it is
a `fork()` of that server which runs the script (or `-c` code) as `__main__` from its first line, as a fresh
`python SCRIPT ARGS` would: the same argv, sys.path[0], environment, working directory, stdin/stdout/stderr, exit
code, uncaught-exception traceback and interpreter shutdown, in its own process group.

What the fork cannot give, the command gets from a fresh interpreter instead (`run` falls back to subprocess.run):
- the first command of an environment (a server is started for it then, and serves its later ones): jax and the
  libraries read the environment as they import, so a server serves only commands whose environment equals its own
  but for variables read at run time (`_READ_AT_RUN_TIME`, and those a caller names);
- --plan or --topology: launch.py sets library variables (TF_CPP_MIN_LOG_LEVEL, JAX_SKIP_CUDA_CONSTRAINTS_CHECK)
  before jax loads;
- stdin text, a script outside the repository, or any other interpreter option.
Tests of the process itself (its start-up and imports, signals sent to it, the supervisor's restarts, several
processes of one job) start their processes with subprocess, as before. A shell a test runs (a docs block) reaches
the servers through `Relay` (below) and tests/forked_command.py.

jax starts no backend as it imports: XLA_FLAGS, with the device count, is read when the backend starts, in the fork.
The server holds no device, compiler thread pool or compilation cache to share.
"""

import atexit
import io
import json
import locale
import os
import pathlib
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
# Read by the trainer or XLA once the command runs, never as a module imports: a fork may differ in them.
_READ_AT_RUN_TIME = ('PYTEST_CURRENT_TEST', 'XLA_FLAGS', 'LAUNCH_TEST_FAULT', 'LAUNCH_MAX_RESTARTS')
_NOT_FORKED = ('--plan', '--topology')  # Flags launch.py acts on before jax loads (above).
_HEADER = struct.Struct('!Q')


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
  data = b''
  while len(data) < size:
    chunk = conn.recv(size - len(data))
    if not chunk:
      raise ConnectionError('the forked-python server closed the connection')
    data += chunk
  return data


# ----------------------------------------------------------------------------------------------------------------
# The server: `python tests/forked_python.py FD`, FD its listening socket, its test process at the other end of stdin.


def _preload() -> None:
  """What launch.py's `__main__` and `main` import before training, in their order."""
  sys.path[0] = str(REPO)
  from trainer.run import collector  # pylint: disable=import-outside-toplevel
  collector.tune()
  # pylint: disable=import-outside-toplevel,unused-import
  from trainer.safety import startup_signals
  from absl import app, flags
  from ml_collections import config_flags
  from trainer.base import config_keys, errors, storage
  from trainer.run import gpu_env
  from trainer.safety import workdir
  from trainer.supervision import attempt, settings
  from parallel import distributed, platforms, watchdog
  from trainer.observe import console
  from trainer.run import loop
  from trainer.safety import preemption, sigterm_handoff, disk, lock
  from trainer.hf import load
  # pylint: enable=import-outside-toplevel,unused-import
  collector.freeze_imports()


def _serve(listener: socket.socket) -> dict:
  """Answers requests until the test process goes; in each forked child, returns its request."""
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ)
  selector.register(sys.stdin, selectors.EVENT_READ)  # EOF: the test process is gone.
  running: dict[int, socket.socket] = {}
  while True:
    for key, _ in selector.select(timeout=0.05 if running else None):
      if key.fileobj is sys.stdin:
        os._exit(0)  # pylint: disable=protected-access  (nothing to shut down: the children are the tests')
      conn, _ = listener.accept()
      message, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
      (size,) = _HEADER.unpack(message)
      request = json.loads(_recv_exactly(conn, size))
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        selector.close()
        listener.close()
        conn.close()
        for other in running.values():
          other.close()
        os.setpgid(0, 0)  # A command that signals its own group does not reach this server.
        for target, fd in enumerate(fds):
          os.dup2(fd, target)
          os.close(fd)
        os.chdir(request['cwd'])
        os.environ.clear()
        os.environ.update(request['env'])
        return request
      for fd in fds:
        os.close(fd)
      conn.sendall(_HEADER.pack(pid))
      running[pid] = conn
    while running:  # Each finished child's status and CPU go back to its test.
      pid, status, usage = os.wait4(-1, os.WNOHANG)
      if pid == 0:
        break
      conn = running.pop(pid)
      reply = json.dumps({'returncode': os.waitstatus_to_exitcode(status),
                          'cpu': usage.ru_utime + usage.ru_stime}).encode()
      try:
        conn.sendall(_HEADER.pack(len(reply)) + reply)
      except OSError:  # The test stopped waiting (its timeout).
        pass
      conn.close()


def _main() -> None:
  listener = socket.socket(fileno=int(sys.argv[1]))
  _preload()
  request = _serve(listener)
  # The child: from here on it is `python ARGV...`.
  argv = request['argv']
  if argv[0] == '-c':
    import types  # pylint: disable=import-outside-toplevel
    sys.argv, sys.path[0] = ['-c', *argv[2:]], ''
    main = types.ModuleType('__main__')
    sys.modules['__main__'] = main
    exec(compile(argv[1], '<string>', 'exec'), main.__dict__)  # pylint: disable=exec-used
  else:
    import runpy  # pylint: disable=import-outside-toplevel
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    runpy.run_path(argv[0], run_name='__main__')


# ----------------------------------------------------------------------------------------------------------------
# The client: the test process.


def _key(env: dict[str, str], read_at_run_time: tuple[str, ...]) -> str:
  return json.dumps({k: v for k, v in env.items() if k not in (*_READ_AT_RUN_TIME, *read_at_run_time)},
                    sort_keys=True)


class _Server:

  def __init__(self, env: dict[str, str]):
    self.path = f'/tmp/forked-python-{os.getpid()}-{time.monotonic_ns()}.sock'
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(self.path)
    listener.listen(16)
    self.process = subprocess.Popen(  # pylint: disable=consider-using-with  (lives as long as the test process)
        [sys.executable, __file__, str(listener.fileno())], cwd=REPO, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, pass_fds=(listener.fileno(),))
    listener.close()
    self.busy = 0  # Commands under way.
    self.forked_cpu = 0.0  # Its commands' CPU seconds, in CHILD_CPU already.

  def alive(self) -> bool:
    return self.process.poll() is None


_SERVERS: dict[str, _Server] = {}  # The least recently used first.
_ASKED: dict[str, int] = {}
# Tests that set variables in their own process (a tracker's, a tokenizer's) change the environment later commands
# get: a new server then takes the place of the one used least recently.
_MAX_SERVERS = 3
_LOCK = threading.Lock()
_STOPPING: list = []
CHILD_CPU = [0.0]  # CPU seconds of the commands forked for this process: not its children, so not in its rusage.


def _stop(server: _Server) -> None:
  server.process.stdin.close()  # The server's EOF.
  pathlib.Path(server.path).unlink(missing_ok=True)
  try:  # Waited for: its own CPU counts in this process's children; its commands', counted as they ended, leave
    server.process.wait(timeout=10)  # CHILD_CPU, or the two together would count them twice.
    CHILD_CPU[0] -= server.forked_cpu
  except subprocess.TimeoutExpired:
    server.process.kill()


def _stop_servers() -> None:
  while _SERVERS:
    _stop(_SERVERS.pop(next(iter(_SERVERS))))


def _server(env: dict[str, str], read_at_run_time: tuple[str, ...]) -> _Server | None:
  """The server for `env`, started at its second command: an environment asked for once runs fresh."""
  key = _key(env, read_at_run_time)
  with _LOCK:
    _ASKED[key] = _ASKED.get(key, 0) + 1
    if key in _SERVERS and not _SERVERS[key].alive():
      del _SERVERS[key]
    if key not in _SERVERS and _ASKED[key] >= 2:
      idle = [k for k, server in _SERVERS.items() if not server.busy]
      if len(_SERVERS) >= _MAX_SERVERS and idle:
        _stop(_SERVERS.pop(idle[0]))
      if len(_SERVERS) < _MAX_SERVERS:
        if not _STOPPING:  # Here, not at import: a server's forks exit as a fresh interpreter would.
          _STOPPING.append(atexit.register(_stop_servers))
        _SERVERS[key] = _Server(env)
    server = _SERVERS.pop(key, None)
    if server is not None:
      _SERVERS[key] = server  # Now the most recently used.
      server.busy += 1
    return server


def _command(argv: list[str], cwd: str | os.PathLike) -> list[str] | None:
  """What the fork runs: [script, args...] or ['-c', code, args...]; None where it must be a fresh process."""
  if len(argv) < 2 or argv[0] != sys.executable or any(a.split('=')[0] in _NOT_FORKED for a in argv[2:]):
    return None
  if argv[1] == '-c':
    return argv[1:] if len(argv) >= 3 else None
  script = pathlib.Path(cwd, argv[1]).resolve()
  if script.suffix != '.py' or not script.is_file() or REPO not in script.parents:
    return None
  return argv[1:]  # The script as given: the fork moves to `cwd` before it runs it, as sys.argv[0] reads fresh.


def run(argv: list[str], *, cwd: str | os.PathLike, env: dict[str, str], timeout: float, text: bool = True,
        read_at_run_time: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
  """subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=text, timeout=timeout), forked where it can
  be (above); `read_at_run_time` names the command's own variables that no module reads as it imports."""
  command = _command(argv, cwd)
  server = _server(env, read_at_run_time) if command else None
  if server is None:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=text, timeout=timeout, check=False)
  try:
    return _forked(server, argv, command, cwd=cwd, env=env, timeout=timeout, text=text)
  finally:
    with _LOCK:
      server.busy -= 1


def _start(server: _Server, command: list[str], cwd: str | os.PathLike, env: dict[str, str],
           fds: list[int]) -> tuple[socket.socket, int]:
  """Asks `server` to fork `command` with `fds` as its stdin, stdout and stderr: (the connection its reply comes on,
  the fork's pid)."""
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  conn.connect(server.path)
  payload = json.dumps({'argv': command, 'cwd': str(cwd), 'env': env}).encode()
  socket.send_fds(conn, [_HEADER.pack(len(payload))], fds)
  conn.sendall(payload)
  (pid,) = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))
  return conn, pid


def _kill(pid: int) -> None:
  try:
    os.killpg(pid, 9)
  except ProcessLookupError:  # Not in its own group yet.
    try:
      os.kill(pid, 9)
    except ProcessLookupError:  # Already gone.
      pass


def _returncode(server: _Server, conn: socket.socket) -> int:
  """The fork's exit status from its server; its CPU joins this process's count."""
  (size,) = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))
  reply = json.loads(_recv_exactly(conn, size))
  CHILD_CPU[0] += reply['cpu']
  server.forked_cpu += reply['cpu']
  return reply['returncode']


def _forked(server: _Server, argv: list[str], command: list[str], *, cwd: str | os.PathLike, env: dict[str, str],
            timeout: float, text: bool) -> subprocess.CompletedProcess:
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  null = os.open(os.devnull, os.O_RDONLY)
  try:
    conn, pid = _start(server, command, cwd, env, [null, out_w, err_w])
  finally:
    for fd in (null, out_w, err_w):
      os.close(fd)
  outputs: dict[int, list[bytes]] = {out_r: [], err_r: []}

  def drain(fd):
    with os.fdopen(fd, 'rb') as f:
      outputs[fd].append(f.read())

  readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in outputs]
  for reader in readers:
    reader.start()
  conn.settimeout(timeout)
  try:
    returncode = _returncode(server, conn)
  except (TimeoutError, socket.timeout) as e:
    _kill(pid)
    raise subprocess.TimeoutExpired(argv, timeout) from e
  finally:
    conn.close()
  for reader in readers:
    reader.join(timeout)
  out, err = b''.join(outputs[out_r]), b''.join(outputs[err_r])
  if text:  # As subprocess's text mode reads: the locale's encoding, universal newlines.
    out, err = (io.TextIOWrapper(io.BytesIO(b), encoding=locale.getpreferredencoding(False)).read()
                for b in (out, err))
  return subprocess.CompletedProcess(argv, returncode, out, err)


# ----------------------------------------------------------------------------------------------------------------
# The relay: `python` for a shell this process started (a docs block, tests/test_docs.py). The shell runs
# tests/forked_command.py in its place, which hands its argv, folder, environment and stdin/stdout/stderr to this
# process's relay; the relay forks the command from the environment's server, as run() does, and answers its exit
# status, or that it must run fresh (then forked_command.py execs the interpreter itself).

# The shell's bookkeeping, which differs from command to command and no library reads.
_SHELL_VARIABLES = ('_', 'SHLVL', 'PWD', 'OLDPWD')


class Relay:

  def __init__(self):
    self.path = f'/tmp/forked-relay-{os.getpid()}-{time.monotonic_ns()}.sock'
    self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._listener.bind(self.path)
    self._listener.listen(16)
    atexit.register(pathlib.Path(self.path).unlink, missing_ok=True)
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while True:
      conn, _ = self._listener.accept()
      threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

  def _answer(self, client: socket.socket) -> None:
    with client:
      message, fds, _, _ = socket.recv_fds(client, _HEADER.size, 3)
      (size,) = _HEADER.unpack(message)
      request = json.loads(_recv_exactly(client, size))
      argv, cwd, env = request['argv'], request['cwd'], request['env']
      command = _command(argv, cwd)
      server = _server(env, _SHELL_VARIABLES) if command else None
      try:
        returncode = None if server is None else self._run(server, command, cwd, env, fds, client)
      finally:
        for fd in fds:
          os.close(fd)
        if server is not None:
          with _LOCK:
            server.busy -= 1
      if server is not None and returncode is None:
        return  # The client is gone, and the fork with it.
      payload = json.dumps({'fresh': True} if server is None else {'returncode': returncode}).encode()
      client.sendall(_HEADER.pack(len(payload)) + payload)

  @staticmethod
  def _run(server: _Server, command: list[str], cwd: str, env: dict[str, str], fds: list[int],
           client: socket.socket) -> int | None:
    """The fork's exit status; None where the client went first (the block's hang guard killed the shell's group,
    which the fork, in a group of its own, is not in): the fork is killed too."""
    conn, pid = _start(server, command, cwd, env, fds)
    with conn, selectors.DefaultSelector() as selector:
      selector.register(conn, selectors.EVENT_READ)
      selector.register(client, selectors.EVENT_READ)  # The client sends nothing more: readable is its end.
      if any(key.fileobj is conn for key, _ in selector.select()):
        return _returncode(server, conn)
      _kill(pid)
      return None


if __name__ == '__main__':
  _main()
