"""The XLA flags of a run on NVIDIA GPUs (trainer/run/gpu_env.py): set when a GPU is there, the user's own win, and the
pinned jaxlib knows them and removes exactly cuDNN from its command-buffer types."""

import os
import subprocess
import sys

import pytest

from trainer.run import gpu_env

GPU_DEVICE_FILES = ['null', 'nvidiactl', 'nvidia-uvm', 'nvidia0', 'nvidia1']


def test_a_gpu_machine_gets_the_flag_in_front_of_the_users_others():
  environ = {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  assert gpu_env.apply(environ, GPU_DEVICE_FILES)
  assert environ['XLA_FLAGS'].split() == ['--xla_gpu_enable_command_buffer=-CUDNN', '--xla_dump_to=/tmp/x']
  environ = {}
  assert gpu_env.apply(environ, GPU_DEVICE_FILES) and environ == {
      'XLA_FLAGS': '--xla_gpu_enable_command_buffer=-CUDNN'}


@pytest.mark.parametrize('environ,device_files', [
    ({}, ['null', 'nvidiactl']),  # The driver's control file but no GPU.
    ({}, ['null', 'accel0']),  # A TPU VM.
    ({'JAX_PLATFORMS': 'cpu'}, GPU_DEVICE_FILES),
    ({'JAX_PLATFORMS': 'tpu'}, GPU_DEVICE_FILES),
    ({'CUDA_VISIBLE_DEVICES': ''}, GPU_DEVICE_FILES),
])
def test_no_gpu_for_jax_no_flags(environ, device_files):
  before = dict(environ)
  assert not gpu_env.apply(environ, device_files)
  assert environ == before


@pytest.mark.parametrize('platforms', ['cuda', 'cuda,cpu', 'GPU'])
def test_platforms_that_include_the_gpu_get_the_flag(platforms):
  environ = {'JAX_PLATFORMS': platforms}
  assert gpu_env.apply(environ, GPU_DEVICE_FILES)


@pytest.mark.parametrize('users', ['--xla_gpu_enable_command_buffer=', '--xla_gpu_enable_command_buffer=FUSION'])
def test_the_users_command_buffer_setting_wins(users):
  environ = {'XLA_FLAGS': f'--xla_gpu_autotune_level=0 {users}'}
  assert gpu_env.apply(environ, GPU_DEVICE_FILES)
  assert environ['XLA_FLAGS'] == f'--xla_gpu_autotune_level=0 {users}'


def test_applying_twice_adds_nothing():  # The supervisor's child process runs launch.py again with the same env.
  environ = {}
  gpu_env.apply(environ, GPU_DEVICE_FILES)
  once = dict(environ)
  gpu_env.apply(environ, GPU_DEVICE_FILES)
  assert environ == once


def _command_buffer_types(xla_flags: str, dump) -> subprocess.CompletedProcess:
  """Starts the pinned jax on the CPU with `xla_flags`, compiles one function and dumps XLA's debug options."""
  return subprocess.run(
      [sys.executable, '-c', 'import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()'],
      env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': f'{xla_flags} --xla_dump_to={dump}'},
      capture_output=True, text=True, timeout=300)


def test_the_pinned_jaxlib_accepts_the_flag_and_it_removes_cudnn_only(tmp_path):
  environ = {}
  gpu_env.apply(environ, GPU_DEVICE_FILES)
  result = _command_buffer_types(environ['XLA_FLAGS'], tmp_path / 'dump')
  assert result.returncode == 0, result.stderr[-2000:]
  options = next((tmp_path / 'dump').glob('*.debug_options')).read_text()
  types = {line.split(':')[1].strip() for line in options.splitlines()
           if line.startswith('xla_gpu_enable_command_buffer:')}
  # XLA's default types in jaxlib 0.10.2, less cuDNN: fusions and cuBLAS stay in CUDA graphs.
  assert types == {'FUSION', 'CUBLAS', 'CUBLASLT', 'CUSTOM_CALL', 'CONDITIONAL', 'DYNAMIC_SLICE_FUSION'}
  # The check can fail: XLA aborts on a type it does not know.
  bad = _command_buffer_types('--xla_gpu_enable_command_buffer=-NO_SUCH_TYPE', tmp_path / 'bad')
  assert bad.returncode != 0 and 'Illegal value for --xla_gpu_enable_command_buffer' in bad.stderr
