"""train.quantization on models brought by import path (tests/custom_models.py): Qwix intercepts their dots.

An NNX model (embedding, a hidden Linear, an output Linear) and a Linen one (embedding, a fused q/k/v DenseGeneral,
jax's attention core in the top module, an output Dense): their layer matmuls (hidden; q/k/v) lower to fp8 dots,
the output head, the embedding and the attention core do not, and the launch log says which ran where. Trained
from one seed in fp8 and bf16 on the tiny config's text, the final eval losses agree within 2%. A model whose only
matmuls are its embedding and head is refused in one line.
"""

import logging
import math
import re

import jax
import jax.numpy as jnp
import pytest

from configs import tiny
from conftest import read_metrics
from trainer.base.errors import UserError
from trainer.run import loop
from trainer.training import task as task_lib

STEPS = 24
MODELS = {'nnx': 'tests.custom_models:MlpLM', 'linen': 'tests.custom_models:own_attention_lm'}
# Each model's quantized module, and the dots that stay in bf16 (output head; the Linen model's attention core).
QUANTIZED = {'nnx': ('hidden', 'out (output head)'),
             'linen': ('DenseGeneral_0', 'Dense_0 (output head); (top) (no parameter operand: attention core)')}


def _config(framework: str, mode: str | None, steps: int = STEPS):
  c = tiny.get_config()
  c.model.name = MODELS[framework]
  c.train.steps, c.train.compute_dtype, c.train.quantization = steps, 'bfloat16', mode
  c.train.eval_every_steps, c.train.eval_batches, c.log.progress_bar = steps, 2, 'off'
  c.train.learning_rate = 1e-2  # One layer each: a larger step learns the text's bytes within STEPS.
  return c


def _dot_operand_types(framework: str, mode: str | None) -> list[tuple[str, ...]]:
  """The operand element types of every dot in the lowered gradient of the model's mean logit."""
  model = task_lib.build_task(_config(framework, mode)).model
  tokens = jnp.zeros((2, 8), jnp.int32)
  grad = jax.grad(lambda p: jnp.mean(model.bind(p)(tokens).astype(jnp.float32)))
  text = jax.jit(grad).lower(model.abstract_params).as_text()
  return [tuple(re.findall(r'tensor<[0-9x]*x(\w+)>', line)[:2]) for line in re.findall(r'dot_general[^\n]*', text)]


@pytest.mark.parametrize('framework, layer_dots, other_dots', [('nnx', 1, 1), ('linen', 1, 3)])
def test_a_brought_models_layer_matmuls_run_fp8_and_the_launch_says_which(framework, layer_dots, other_dots,
                                                                          caplog):
  with caplog.at_level(logging.INFO, logger='absl'):
    dots = _dot_operand_types(framework, 'fp8')
  fp8 = [d for d in dots if any(t.startswith('f8') for t in d)]
  # Each layer matmul: a forward dot in E4M3 and two backward ones with the gradient in E5M2.
  assert len(fp8) == 3 * layer_dots and sum(d == ('f8E4M3FN', 'f8E4M3FN') for d in fp8) == layer_dots, dots
  # The output head (forward and two backward; the input's gradient is dropped at the embedding's ids) and the
  # Linen model's attention core stay in bf16.
  assert len(dots) - len(fp8) >= other_dots + 1, dots
  assert not any(t.startswith('f8') for d in _dot_operand_types(framework, None) for t in d)
  quantized, kept = QUANTIZED[framework]
  assert f'the matmuls of {quantized} run float8_e4m3fn forward, float8_e5m2 gradients; in train.compute_dtype ' \
         f'stay {kept}' in caplog.text


@pytest.fixture(scope='module')
def evals(tmp_path_factory):
  """{(framework, mode): final eval loss} of each model trained STEPS steps from one seed."""
  root = tmp_path_factory.mktemp('quantized_brought')
  final = {}
  for framework in MODELS:
    for mode in (None, 'fp8'):
      workdir = root / f'{framework}-{mode}'
      loop.run(_config(framework, mode), str(workdir), devices=jax.devices()[:1])
      final[framework, mode] = [r['eval_loss'] for r in read_metrics(workdir) if 'eval_loss' in r][-1]
  return final


@pytest.mark.parametrize('framework', MODELS)
def test_a_brought_model_trained_in_fp8_ends_within_2_percent_of_bf16(evals, framework):
  bf16, fp8 = evals[framework, None], evals[framework, 'fp8']
  assert bf16 < 0.85 * math.log(256), evals  # The premise: the runs learn the text (a fresh model's loss is ln 256).
  assert abs(fp8 - bf16) <= 0.02 * bf16, (fp8, bf16)
  assert fp8 != bf16, evals  # The quantized matmuls ran.


def test_a_brought_model_with_no_layer_matmul_is_refused_in_one_line():
  config = _config('nnx', 'fp8')
  config.model.name = 'tests.custom_models:NnxWithoutNames'  # An embedding and an output Linear only.
  with pytest.raises(UserError) as refused:  # launch.py turns it into its one `error:` line, exit 2.
    task_lib.build_task(config)
  assert str(refused.value).startswith(
      "train.quantization='fp8': model.name='tests.custom_models:NnxWithoutNames' has no layer matmul to quantize "
      "(its matmuls with a parameter are ['out']: embeddings and the output head") and '\n' not in str(refused.value)
