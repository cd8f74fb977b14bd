"""An out-of-memory while training (trainer/memory/runtime_oom.py): one line with the need, what pre-flight approved
and the fix; exit 2, which the supervisor does not retry."""

import jax
import pytest

from configs import tiny
from trainer.base.errors import UserError
from trainer.memory import footprint, runtime_oom
from trainer.run import loop, preflight
from trainer.supervision import supervisor

XLA_OOM = ('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34.48GiB with allocator GPU_0_bfc; '
           'a Python traceback follows')


@pytest.mark.parametrize('text,expected', [
    (XLA_OOM, int(34.48 * 2**30)),
    ('Out of memory allocating 512.0MiB', 512 * 2**20),
    ('RESOURCE_EXHAUSTED: Out of memory', None),
])
def test_the_allocation_is_read_from_xlas_message(text, expected):
  assert runtime_oom.requested_bytes(text) == expected


class _FailsAtStep:
  """The approved compiled step, which runs out of device memory at its `at`-th call, as XLA reports it."""

  def __init__(self, compiled, at: int):
    self.compiled, self.at, self.calls, self.approved = compiled, at, 0, footprint.compiled_bytes(compiled)

  def __call__(self, *args):
    self.calls += 1
    if self.calls == self.at:
      raise jax.errors.JaxRuntimeError(XLA_OOM)
    return self.compiled(*args)

  def memory_analysis(self):
    return self.compiled.memory_analysis()


def test_an_oom_at_step_two_ends_in_one_line_naming_need_approval_and_fix(tmp_path, monkeypatch):
  wrapped = {}
  real = preflight.compile_checked

  def compile_checked(job):
    wrapped['step'] = _FailsAtStep(real(job), at=2)
    return wrapped['step']

  monkeypatch.setattr(preflight, 'compile_checked', compile_checked)
  config = tiny.get_config()
  config.train.device_memory_gb = 2.0
  with pytest.raises(UserError) as raised:
    loop.run(config, str(tmp_path / 'run'))
  message = str(raised.value)
  approved = footprint.gib(wrapped['step'].approved)
  assert wrapped['step'].calls == 2
  assert message.startswith('out of memory while training: the device was asked for one allocation of 34.48 GiB; '
                            f'pre-flight approved {approved} per device of 2.00 GiB (train.device_memory_gb=2)')
  assert '--config.train.batch_size=4' in message and '--config.train.remat_policy=full' in message
  assert '\n' not in message and getattr(raised.value, 'exit_code', 2) == 2
  retry, _ = supervisor.classify(2, {})
  assert not retry  # The supervisor ends the run on exit 2.


def test_other_errors_are_left_alone():
  config = tiny.get_config()
  assert runtime_oom.explain(ValueError('a bug'), None, config.train, jax.devices()) is None
  assert runtime_oom.explain(UserError('RESOURCE_EXHAUSTED: disk full'), None, config.train, jax.devices()) is None


GIB = 2**30


@pytest.mark.parametrize('stats,expected', [
    # 71.26 GiB pool, 10.72 GiB of state live: 60 GiB free, but no block of the 34.48 GiB asked for.
    ({'bytes_in_use': int(10.9 * GIB), 'bytes_limit': int(71.26 * GIB), 'largest_free_block_bytes': int(26 * GIB)},
     'largest free block 26.00 GiB: the free memory was there but split into smaller blocks (fragmentation).'),
    ({'bytes_in_use': int(40 * GIB), 'bytes_limit': int(71.26 * GIB), 'largest_free_block_bytes': int(31 * GIB)},
     "more was live than the step's 10.72 GiB of inputs."),
    ({'bytes_in_use': int(10.9 * GIB), 'bytes_limit': int(40 * GIB), 'largest_free_block_bytes': int(29 * GIB)},
     'the step asked for more than was free.'),
])
def test_the_allocators_state_at_the_failure_names_the_cause(stats, expected):
  line = runtime_oom.diagnosis(stats, int(34.48 * GIB), int(10.72 * GIB))
  assert line.startswith(' At the failure the allocator had ') and line.endswith(expected)


def test_no_allocator_figures_no_diagnosis():  # The CPU backend reports none.
  assert runtime_oom.diagnosis(None, int(34.48 * GIB), int(10.72 * GIB)) == ''


def test_after_step_one_a_split_pool_is_named_before_step_two_fails():
  temp = int(34.48 * GIB)
  split = {'bytes_in_use': int(10.9 * GIB), 'largest_free_block_bytes': int(26 * GIB)}
  whole = {'bytes_in_use': int(10.9 * GIB), 'largest_free_block_bytes': int(60 * GIB)}
  assert runtime_oom.allocator_line(temp, [whole, split]) == (
      'After step 1: 10.90 GiB in use, largest free block 26.00 GiB; each step asks for its temporaries as one '
      'block of 34.48 GiB. No free block is that large: the next step will run out of memory (fragmentation).')
  assert 'No free block' not in runtime_oom.allocator_line(temp, [whole])
  assert runtime_oom.allocator_line(temp, [None]) is None  # The CPU reports nothing.
