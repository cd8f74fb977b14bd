"""The GPU path without a GPU: the launcher's real train step, lowered for CUDA on this CPU host, reaches cuDNN.

cuDNN cannot run here, and jax refuses to even trace its attention without a GPU: it asks the cuDNN library for its
version and the device for its compute capability first. `cuda_host` answers those two questions as one H100 would
(cuDNN 9.10, compute capability 9.0) and makes trainer/attention see a GPU mesh. jax.export then lowers the step
for the 'cuda' platform: the StableHLO an H100 would compile, with nothing compiled or run. What this proves is what
the model hands the kernel (dtypes, layouts, GQA, segment tables, remat, the backward) and that no (L, L) scores
are left anywhere in the step; numerics and speed need the GPU (benchmarks/bench_attention.py, benchmarks/bench_gpu.py).
Compiling it for an H100 without one needs jax's CUDA plugin: plan mode does that (tests/test_plan.py, skipped
without requirements-gpu-plan.txt).
"""

import re
import sys

import jax
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_lib

from configs import tiny, vit_tiny
from conftest import REPO
from parallel import sharding
from trainer import attention
from trainer.run import job as job_lib

sys.path.insert(0, str(REPO / 'benchmarks'))
import bench_gpu  # noqa: E402

FORWARD, BACKWARD = '__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'
# Shapes chosen so that L appears in no other dimension of the step: an (L, L) tensor can only be scores.
B, L, D, H, G = 4, 128, 64, 4, 2


class _Cudnn910:
  """Stands in for jax's cuDNN bindings: what the cuDNN library on an H100 image reports."""

  @staticmethod
  def cudnn_get_version() -> int:
    return 91000


@pytest.fixture
def cuda_host(monkeypatch):
  monkeypatch.setattr(cudnn_lib, 'cuda_versions', _Cudnn910)
  monkeypatch.setattr(cudnn_lib, 'check_compute_capability', lambda capability: float(capability) <= 9.0)
  monkeypatch.setattr(cudnn_lib, 'is_cuda_compute_capability_equal', lambda capability: float(capability) == 9.0)
  monkeypatch.setattr(attention, 'platform_of', lambda mesh=None: ('gpu', 9.0))


def llama_config(**overrides):
  c = tiny.get_config()
  c.train.batch_size, c.data.seq_len = B, L
  c.model.d_model, c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = D, H, G, 3 * D
  c.train.compute_dtype = 'bfloat16'  # 'auto' would read this host's platform (CPU: float32) for the model.
  for key, value in overrides.items():
    section, name = key.split('.')
    c[section][name] = value
  return c


def cuda_module(config) -> str:
  """The StableHLO text of `config`'s train step, lowered for CUDA on one (CPU) device."""
  job = job_lib.build_job(config, jax.devices()[:1])
  checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in (FORWARD, BACKWARD)]
  exported = jax.export.export(job.train_step, platforms=['cuda'], disabled_checks=checks)(
      sharding.with_shardings(job.abstract, job.shardings), job.abstract_batch)
  return exported.mlir_module()


def custom_calls(module: str, target: str) -> list[str]:
  """The lines calling `target`, each with its backend config (the JSON the GPU compiler builds cuDNN's graph from)."""
  return [line for line in module.splitlines() if f'custom_call @{target}(' in line]


def scores(module: str, length: int, heads: int, kv_heads: int) -> list[str]:
  """Materialized attention scores, probabilities or masks: tensors (..., heads or heads per kv head or 1, L, L).

  The dimension before (L, L) tells them from other tensors whose two minor dimensions happen to equal L, such as
  llama_1b's (layers, B, L, d_model) activations saved by its scanned blocks, where d_model = L = 2048.
  """
  before = '|'.join(str(n) for n in {heads, heads // kv_heads, 1})
  return re.findall(rf'tensor<(?:\d+x)+(?:{before})x{length}x{length}x\w+>', module)


@pytest.mark.parametrize('strategy', ['jit', 'shard_map'])
def test_llama_step_lowers_to_cudnn_forward_and_backward_and_keeps_no_scores(cuda_host, strategy):
  module = cuda_module(llama_config(**{'model.attention': 'auto', 'parallel.strategy': strategy}))
  forward, backward = custom_calls(module, FORWARD), custom_calls(module, BACKWARD)
  assert forward and backward
  assert all('\\22mask_type\\22: \\22CAUSAL\\22' in line for line in forward + backward)
  # Queries (B, L, H, K) and grouped keys/values (B, L, G, K) reach the kernel as they are, in bfloat16.
  assert f'tensor<{B}x{L}x{H}x{D // H}xbf16>, tensor<{B}x{L}x{G}x{D // H}xbf16>' in forward[0]
  assert scores(module, L, H, G) == []


def test_the_xla_kernel_materializes_scores_so_the_check_above_can_fail(cuda_host):
  module = cuda_module(llama_config(**{'model.attention': 'xla'}))
  assert custom_calls(module, FORWARD) == []
  assert scores(module, L, H, G)  # (B, G, H/G, L, L) logits and probabilities, forward and backward.


def test_packed_rows_size_cudnn_by_max_documents_per_row_not_by_sequence_length(cuda_host):
  module = cuda_module(llama_config(**{'model.attention': 'cudnn', 'data.packing': True,
                                       'data.max_documents_per_row': 8}))
  forward, backward = custom_calls(module, FORWARD), custom_calls(module, BACKWARD)
  assert forward and backward
  assert all('\\22mask_type\\22: \\22PADDING_CAUSAL\\22' in line for line in forward + backward)
  # The segment table (B, M) and offsets (B, M + 1), and float32 softmax statistics for B * M sequences.
  assert f'tensor<{B}x8xi32>, tensor<{B}x8xi32>, tensor<{B}x9xi32>, tensor<{B}x9xi32>' in forward[0]
  assert f'tensor<{B * 8}x{H}x{L}xf32>' in forward[0]
  assert f'tensor<{B * L}x{H}x{L}xf32>' not in module
  assert scores(module, L, H, G) == []


def test_without_a_bound_cudnn_keeps_statistics_for_a_sequence_per_token(cuda_host):
  """Why the launcher passes data.max_documents_per_row: M = L costs (B * L, H, L) float32 per layer."""
  q = jax.ShapeDtypeStruct((B, L, H, 16), 'bfloat16')
  kv = jax.ShapeDtypeStruct((B, L, G, 16), 'bfloat16')
  ids = jax.ShapeDtypeStruct((B, L), 'int32')

  def loss(q, k, v, ids):
    return attention.dot_product_attention(q, k, v, causal=True, segment_ids_BL=ids).astype('float32').sum()

  checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in (FORWARD, BACKWARD)]
  module = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=['cuda'],
                             disabled_checks=checks)(q, kv, kv, ids).mlir_module()
  assert f'tensor<{B * L}x{H}x{L}xf32>' in custom_calls(module, FORWARD)[0]


def test_vit_step_lowers_to_cudnn_without_a_mask(cuda_host):
  c = vit_tiny.get_config()
  c.model.attention, c.train.compute_dtype = 'auto', 'bfloat16'
  forward = custom_calls(cuda_module(c), FORWARD)
  assert forward and all('\\22mask_type\\22: \\22NO_MASK\\22' in line for line in forward)


@pytest.mark.parametrize('policy, forwards', [
    ('none', 1), ('dots_saveable', 1), ('save_attention_and_mlp_hidden', 1),  # The kernel's outputs are kept.
    ('full', 2), ('dots_with_no_batch_dims_saveable', 2), ('save_qkv_proj', 2),  # Recomputed in the backward.
])
def test_remat_policies_that_save_attention_keep_the_cudnn_forward(cuda_host, policy, forwards):
  module = cuda_module(llama_config(**{'model.attention': 'cudnn', 'train.remat_policy': policy}))
  assert len(custom_calls(module, FORWARD)) == forwards  # One scanned block: the forward loop, the backward loop.
  assert len(custom_calls(module, BACKWARD)) == 1


@pytest.mark.parametrize('row', ['gpt2_b64', 'gpt2_b32_packed', 'llama_b16_dots_with_no_batch_dims_saveable',
                                 'vit_b256'])
def test_the_gpu_benchmark_rows_lower_to_cudnn_with_no_scores(cuda_host, row):
  """The presets at the shapes benchmarks/bench_gpu.py times on an H100: every attention on cuDNN, no (L, L) tensor."""
  config = bench_gpu.row_config(row, attention=None, smoke=False)
  config.train.compute_dtype = 'bfloat16'  # What 'auto' gives on a GPU.
  if config.train.remat_policy == 'auto':  # Resolved by compiling candidates, which needs the GPU.
    config.train.remat_policy = 'none'
  module = cuda_module(config)
  assert custom_calls(module, FORWARD) and custom_calls(module, BACKWARD)
  call = attention.config_call(config.model, config.data, config.train.compute_dtype)
  assert scores(module, call.seq_len, call.q_shape[2], call.kv_shape[2]) == []


@pytest.mark.parametrize('bound, statistics', [(64, '1024x32x2048xf32'),  # 256 MiB a layer.
                                               (2048, '32768x32x2048xf32')])  # M = L: 8 GiB a layer.
def test_llama_1b_packed_statistics_grow_with_the_bound(cuda_host, bound, statistics):
  """llama_1b at bench_gpu's 16 x 2048: cuDNN's float32 softmax statistics are (16 * bound, 32 heads, 2048)."""
  config = bench_gpu.row_config('llama_b16_full', attention=None, smoke=False)
  config.train.compute_dtype = 'bfloat16'
  config.data.source, config.data.packing, config.data.max_documents_per_row = 'text', True, bound
  forward = custom_calls(cuda_module(config), FORWARD)
  assert forward and all(f'tensor<{statistics}>' in line for line in forward)


def test_a_chunked_loss_keeps_no_whole_logits_in_the_cuda_step(cuda_host):
  """train.loss_chunks=4: float32 logits exist only a quarter of the positions at a time, beside cuDNN attention."""
  V = tiny.get_config().model.vocab_size
  whole = cuda_module(llama_config(**{'model.attention': 'cudnn'}))
  assert f'tensor<{B}x{L}x{V}xf32>' in whole  # So the check below can fail.
  chunked = cuda_module(llama_config(**{'model.attention': 'cudnn', 'train.loss_chunks': 4}))
  assert f'tensor<{B}x{L}x{V}xf32>' not in chunked and f'tensor<{B}x{L // 4}x{V}xf32>' in chunked
  assert custom_calls(chunked, FORWARD) and custom_calls(chunked, BACKWARD)
