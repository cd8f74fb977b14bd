"""`python ARGS` for a shell a test started (a docs block): run as `python -I -S tests/forked_command.py RELAY ARGS`,
it hands the command to the test process's relay (tests/forked_python.py, Relay), which forks it from a server that
has imported the trainer, and exits as the command did; a command no server can fork (a --plan, `-m`, a script
outside the repository, an environment's first command) runs here instead, in a fresh interpreter exec'd in place.

Standard library only, and little of it: this is the one interpreter start-up a forked command still pays.
"""

import json
import os
import signal
import socket
import struct
import sys

_HEADER = struct.Struct('!Q')  # As tests/forked_python.py frames its messages.


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
  data = b''
  while len(data) < size:
    chunk = conn.recv(size - len(data))
    if not chunk:
      sys.stderr.write('forked_command.py: the test process\'s relay closed the connection without an answer\n')
      sys.stderr.flush()
      os._exit(1)  # pylint: disable=protected-access
    data += chunk
  return data


def main() -> None:
  relay, args = sys.argv[1], sys.argv[2:]
  argv = [sys.executable, *args]
  payload = json.dumps({'argv': argv, 'cwd': os.getcwd(), 'env': dict(os.environ)}).encode()
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
    conn.connect(relay)
    socket.send_fds(conn, [_HEADER.pack(len(payload))], [0, 1, 2])
    conn.sendall(payload)
    (size,) = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))
    reply = json.loads(_recv_exactly(conn, size))
  if reply.get('fresh'):
    os.execv(sys.executable, argv)
  returncode = reply['returncode']
  if returncode < 0:  # Killed by a signal: so is this process, for the shell's $? (128 + the signal).
    signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
  os._exit(returncode & 0xFF)  # pylint: disable=protected-access


if __name__ == '__main__':
  main()
