"""Fakes 8 CPU devices before anything imports jax, and shares helpers for running the launcher."""

import os
import pathlib
import subprocess
import sys

# Must happen before jax initializes its backends: every test sees 8 CPU devices.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import pytest  # noqa: E402


def run_launcher(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs `python launch.py ARGS` in a subprocess with 8 fake devices; never hangs past `timeout`."""
  return subprocess.run([sys.executable, str(REPO / 'launch.py'), *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ))


@pytest.fixture
def launcher():
  return run_launcher
