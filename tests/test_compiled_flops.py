"""Matmul FLOPs read from a compiled step's HLO (trainer/observe/compiled_flops.py), and the dense-experts guard: a
dropless MoE step whose compiled matmuls run every expert on every token is named in one line with the fix."""

import jax
import jax.numpy as jnp
import pytest

from configs import tiny
from trainer.observe import compiled_flops
from trainer.run import job as job_lib
from trainer.run import preflight


def _hlo(fn, *shapes):
  return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()


def test_a_matmul_counts_two_flops_per_multiply_add():
  assert compiled_flops.dot_flops(_hlo(lambda a, b: a @ b, (64, 32), (32, 48))) == 2 * 64 * 32 * 48


def test_a_loop_body_counts_once_per_trip():
  def layers(x, w):
    return jax.lax.scan(lambda h, w_i: (jnp.tanh(h @ w_i), None), x, w)[0]
  assert compiled_flops.dot_flops(_hlo(layers, (16, 32), (6, 32, 32))) == 6 * 2 * 16 * 32 * 32


def test_batched_matmuls_count_their_batch():
  assert compiled_flops.dot_flops(_hlo(lambda a, b: jnp.einsum('bij,bjk->bik', a, b), (3, 8, 16), (3, 16, 4))) == (
      3 * 2 * 8 * 16 * 4)


@pytest.mark.parametrize('compiled,active,dropless,fires', [
    (4.6e13, 3.6e13, True, False), (1.7e14, 3.6e13, True, True), (1.7e14, 3.6e13, False, False)])
def test_the_guard_fires_above_the_ratio_for_dropless_moe_only(compiled, active, dropless, fires):
  line = compiled_flops.dense_experts_line(compiled, active, dropless)
  assert (line is not None) == fires
  if fires:
    assert line.startswith('The compiled step runs 4.7x the active FLOPs as XLA matmuls') and (
        '--config.model.expert_capacity_factor=1.25' in line)


def _moe(capacity_factor=None):
  c = tiny.get_config()
  c.model.num_experts, c.model.experts_per_token, c.model.expert_mlp_dim = 8, 2, 64
  c.model.expert_capacity_factor = capacity_factor
  return c


def test_the_guard_fires_on_a_step_whose_ragged_dot_xla_pads_to_every_expert():
  """On CPU XLA runs ragged_dot as a dense matmul over every expert: today's GPU path too (BENCHMARKS.md)."""
  job = job_lib.build_job(_moe(), jax.devices()[:1])
  line = preflight.dense_experts(job, job.compile_train_step())
  assert line is not None and 'every expert on every token' in line
  capacity = job_lib.build_job(_moe(capacity_factor=1.25), jax.devices()[:1])
  assert preflight.dense_experts(capacity, capacity.compile_train_step()) is None


def test_the_triton_grouped_matmuls_count_at_their_grid_size_when_asked():
  """A custom call is unseen by default; with kernels=True a grouped matmul (a line as XLA's GPU compiler writes it)
  counts 2 x padded rows x D x F."""
  call = ('  ROOT %pallas_call.70 = bf16[4160,2048]{1,0} custom-call(%a, %b, %c), custom_call_target='
          '"__gpu$xla.gpu.triton", operand_layout_constraints={s32[65]{0}, bf16[4160,1024]{1,0}, '
          'bf16[8,1024,2048]{2,1,0}}, metadata={op_name="jit(train_step)/layers/moe/jit(ragged_dot)/grouped_matmul/'
          'pallas_call"}')
  hlo = f'ENTRY %main (a: s32[65]) -> bf16[4160,2048] {{\n{call}\n}}\n'
  assert compiled_flops.dot_flops(hlo) == 0
  assert compiled_flops.dot_flops(hlo, kernels=True) == 2 * 4160 * 1024 * 2048
