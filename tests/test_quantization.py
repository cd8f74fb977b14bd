"""train.quantization (trainer/models/quantization.py): which matmuls run fp8, the refusals, and the numerics.

The lowered gradient of the tiny Llama shows the layer matmuls' operands as float8 (E4M3 forward, E5M2 gradients
backward) and every other dot (the attention core, the output head) in the compute dtype. The refusals are
checked against device kinds a GPU or TPU would report. The numerics: the tiny config trained from one seed in
fp8, int8 and bf16, the quantized final losses within 2% of bf16's (emulated on CPU: the numbers an H100 or a
TPU would compute, within rounding of the accumulation order).
"""

import importlib.util
import logging
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from configs import tiny
from conftest import REPO, read_metrics, run_launcher, run_python
from trainer.base.errors import UserError
from trainer.memory import footprint, gpu_targets, remat
from trainer.models import llama, quantization
from trainer.observe import flops, traced_flops
from trainer.run import loop, plan

STEPS = 24


def _dot_operand_types(mode):
  """The operand element types of every dot in the lowered gradient of the tiny Llama's (2-layer, scanned) loss."""
  c = tiny.get_config()
  c.train.quantization, c.train.compute_dtype = mode, 'bfloat16'
  model = llama.build(c)
  tokens = jnp.zeros((2, c.data.seq_len), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)['params']
  text = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({'params': p}, tokens)))).lower(params).as_text()
  return [tuple(re.findall(r'tensor<[0-9x]*x(\w+)>', line)[:2]) for line in re.findall(r'dot_general[^\n]*', text)]


def test_fp8_runs_the_layer_matmuls_in_e4m3_forward_and_e5m2_backward():
  dots = _dot_operand_types('fp8')
  fp8 = [d for d in dots if any(t.startswith('f8') for t in d)]
  # Per (scanned) layer 7 kernels: q, k, v, out, gate, up, down; each has a forward dot and two backward ones.
  assert len(fp8) == 21, dots
  assert sum(d == ('f8E4M3FN', 'f8E4M3FN') for d in fp8) == 7  # Forward: activations and kernels in E4M3.
  assert all('f8E5M2' in d for d in fp8 if d != ('f8E4M3FN', 'f8E4M3FN'))  # Backward: the gradient in E5M2.
  # What stays in bf16/f32: the attention core (2 forward, 4 backward) and the output head (forward, backward).
  assert len(dots) - len(fp8) == 8
  assert not any(t.startswith('f8') for d in _dot_operand_types(None) for t in d)


def test_int8_runs_the_same_matmuls_in_int8():
  dots = _dot_operand_types('int8')
  assert sum(all(t == 'i8' for t in d) for d in dots) == 21, dots


def _device(platform, kind, capability=None):
  return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


@pytest.mark.parametrize('mode, device, words', [
    ('fp8', _device('gpu', 'NVIDIA A100-SXM4-80GB', '8.0'), 'needs fp8 tensor cores'),
    ('fp8', _device('gpu', 'Tesla V100-SXM2-16GB', '7.0'), 'needs fp8 tensor cores'),
    ('int8', _device('gpu', 'NVIDIA H100 80GB HBM3', '9.0'), "use train.quantization='fp8'"),
    ('int8', _device('tpu', 'TPU v4'), 'has no int8 matrix path'),
    ('fp8', _device('tpu', 'TPU v6 lite'), "use train.quantization='int8' or unset"),
    ('fp8', _device('tpu', 'TPU v5p'), 'has no fp8 matrix path'),
])
def test_a_chip_without_the_format_is_refused_in_one_line(mode, device, words):
  with pytest.raises(UserError, match=re.escape(words)) as refused:
    quantization.check(mode, device)
  assert f'train.quantization={mode!r}' in str(refused.value) and '\n' not in str(refused.value)


@pytest.mark.parametrize('mode, device', [
    ('fp8', _device('gpu', 'NVIDIA H100 80GB HBM3', '9.0')), ('fp8', _device('gpu', 'NVIDIA L4', '8.9')),
    ('fp8', _device('gpu', 'NVIDIA B200', '10.0')), ('int8', _device('tpu', 'TPU v5 lite')),
    ('int8', _device('tpu', 'TPU v6 lite')), ('fp8', _device('tpu', 'TPU7x')), (None, _device('gpu', 'Tesla T4', '7.5')),
])
def test_a_chip_with_the_format_is_accepted(mode, device):
  quantization.check(mode, device)


def test_cpu_says_the_quantized_step_is_emulated(caplog):
  with caplog.at_level(logging.INFO):
    quantization.check('fp8', jax.devices()[0])
  assert 'emulated, for testing numerics, not speed' in caplog.text


def test_quantized_lora_is_refused_in_one_line(tmp_path):
  run = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path / "run"}', '--config.train.quantization=int8',
                     '--config.model.lora_rank=4')
  assert run.returncode == 2, run.stderr[-2000:]
  assert "train.quantization='int8' with model.lora_rank=4: quantized LoRA is not supported yet" in run.stderr
  assert 'Traceback' not in run.stderr


def _tiny(mode, steps=STEPS):
  c = tiny.get_config()
  c.train.steps, c.train.compute_dtype, c.train.quantization = steps, 'bfloat16', mode  # Text: Python's stdlib.
  c.train.eval_batches, c.log.every_steps, c.log.progress_bar = 0, 1, 'off'
  return c


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(root, {mode: every step's training loss}) of the tiny config trained STEPS steps from one seed in ROOT/mode."""
  root = tmp_path_factory.mktemp('quantization')
  losses = {}
  for mode in (None, 'fp8', 'int8'):
    loop.run(_tiny(mode), str(root / str(mode)), devices=jax.devices()[:1])
    losses[mode] = [r['loss'] for r in read_metrics(root / str(mode)) if 'loss' in r]
  return root, losses


@pytest.mark.parametrize('mode', ['fp8', 'int8'])
def test_quantized_training_ends_within_2_percent_of_bf16(trained, mode):
  bf16, quantized = trained[1][None], trained[1][mode]
  assert len(quantized) == len(bf16) == STEPS
  assert bf16[-1] < 0.8 * bf16[0]  # The premise: the runs learn something in STEPS steps.
  assert abs(quantized[-1] - bf16[-1]) <= 0.02 * bf16[-1], (quantized[-1], bf16[-1])
  assert quantized != bf16  # The quantized matmuls ran: the losses are not bit-equal.


def test_a_bf16_checkpoint_resumes_into_fp8_and_back_with_a_line_saying_so(trained, caplog):
  root = trained[0]
  config = _tiny('fp8', steps=STEPS + 2)
  config.train.accept_schedule_change = True  # Two more steps move the cosine schedule: not what is tested here.
  with caplog.at_level(logging.INFO, logger='absl'):
    loop.run(config, str(root / 'None'), devices=jax.devices()[:1])
  assert (f"Resuming step {STEPS}, saved with train.compute_dtype layer matmuls, with fp8 ones "
          f"(train.quantization None -> 'fp8')") in caplog.text
  losses = [r['loss'] for r in read_metrics(root / 'None') if 'loss' in r]
  # The two fp8 steps started from the trained weights (a fresh model's loss is ln(256) = 5.5).
  assert len(losses) == STEPS + 2 and max(losses[STEPS:]) < 0.8 * losses[0]
  # And back: the fp8 checkpoint resumes into bf16 matmuls.
  config = _tiny(None, steps=STEPS + 4)
  config.train.accept_schedule_change = True
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='absl'):
    loop.run(config, str(root / 'None'), devices=jax.devices()[:1])
  assert (f"Resuming step {STEPS + 2}, saved with fp8 layer matmuls, with train.compute_dtype ones "
          f"(train.quantization 'fp8' -> None)") in caplog.text
  losses = [r['loss'] for r in read_metrics(root / 'None') if 'loss' in r]
  assert len(losses) == STEPS + 4 and max(losses[STEPS + 2:]) < 0.8 * losses[0]


def test_an_fp8_run_exports_float_weights_equal_to_its_own(trained, tmp_path):
  """The quantized dots keep no 8-bit weights (current scaling: params stay float32), so the Hugging Face export is
  the run's float32 weights, as a bf16 run's would be."""
  import numpy as np
  from safetensors.numpy import load_file

  from scripts import export_hf, sample
  run = trained[0] / 'fp8'
  export_hf.export(str(run), str(tmp_path / 'hf'))
  tensors = {}
  for f in sorted((tmp_path / 'hf').glob('*.safetensors')):
    tensors.update(load_file(f))
  assert tensors and {t.dtype for t in tensors.values()} == {np.dtype('float32')}, {t.dtype for t in tensors.values()}
  _, _, weights = sample.restore_model(sample.load_run_config(run), run, 'latest', 'raw')
  embed = np.asarray(jax.tree_util.tree_leaves({k: v for k, v in weights.items() if 'embed' in k.lower()})[0])
  assert np.array_equal(tensors['model.embed_tokens.weight'], embed.reshape(tensors['model.embed_tokens.weight'].shape))


@pytest.mark.skipif(not gpu_targets.cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin: pip install -r requirements-gpu-plan.txt")
def test_llama_1b_compiled_for_an_h100_runs_its_layer_matmuls_as_fp8_in_no_more_memory():
  run = run_python([sys.executable, str(REPO / 'benchmarks' / 'bench_quantization.py'), '--batch_size=1'], timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  shares = dict(re.findall(r'^(bf16|fp8): layer matmul FLOPs in fp8 dots ([\d.]+)%', run.stdout, re.M))
  memory = dict(re.findall(r'^(bf16|fp8): .*compiled step ([\d.]+) GiB', run.stdout, re.M))
  assert float(shares['bf16']) == 0 and float(shares['fp8']) >= 90, run.stdout
  assert float(memory['fp8']) <= float(memory['bf16']), run.stdout


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_the_tiny_llama_compiled_for_a_v5p_slice_runs_its_layer_matmuls_in_int8():
  # libtpu reads XLA_FLAGS too, and aborts on the CPU-only flags the tests set (conftest.TEST_XLA_FLAGS).
  env = {**os.environ, 'XLA_FLAGS': ' '.join(f for f in os.environ['XLA_FLAGS'].split() if '_cpu_' not in f)}
  run = subprocess.run([sys.executable, str(REPO / 'benchmarks' / 'bench_quantization.py'), '--topology=v5p:2x2x1',
                        '--config=configs/tiny.py', '--batch_size=8'], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  ops = dict(re.findall(r'^(bf16|int8): layer matmul ops in int8 [\d.]+% \((\{.*?\})\)', run.stdout, re.M))
  # 2 scanned layers' 7 kernels, 3 ops each (forward, both gradients): s8 x s8 convolutions (TPU's dot) in int8.
  assert ops == {'bf16': "{('bf16', 'bf16'): 21}", 'int8': "{('s8', 's8'): 21}"}, run.stdout


def test_the_plan_counts_the_fp8_flops_and_the_step_time_at_the_fp8_peak():
  printed = []
  plan.run(_tiny('fp8'), print_fn=printed.append)
  report = '\n'.join(printed)
  traced = float(re.search(r'FLOPs per step: ([\d.e+]+)', report).group(1))
  quantized, share = re.search(r"train.quantization='fp8': ([\d.e+]+) of these FLOPs \(([\d.]+)%\) in fp8 dots",
                               report).groups()
  # The 7 layer kernels (2 layers x 10,240 weights), 3 dots each (forward and both gradients) of 2 x 8 x 32 tokens.
  assert float(quantized) == pytest.approx(3 * 2 * 8 * 32 * 20_480, rel=1e-3) and float(share) == pytest.approx(
      100 * float(quantized) / traced, abs=0.1)
  # Beside the bf16 peak's line, the H100's at its fp8 peak (twice); no TPU has fp8 matrix units in the table.
  assert re.search(r'h100 +989 TFLOP/s bf16: .*\n +fp8 layer matmuls at 1,978 TFLOP/s', report), report
  assert report.count('fp8 layer matmuls at') == 2  # H100 and H200.


def test_mfu_is_against_the_bf16_peak_and_against_each_dots_own_peak():
  counted = traced_flops.Count(flops=100e12, quantized=60e12)
  ideal = flops.ideal_seconds(counted, flops.PEAK_FLOPS['h100'], 'fp8', 'h100')
  assert ideal == pytest.approx(40e12 / 989e12 + 60e12 / 1978e12)
  assert flops.ideal_seconds(counted, flops.PEAK_FLOPS['v5p'], 'fp8', 'v5p') == pytest.approx(100e12 / 459e12)
  assert flops.quantized_peak_flops('int8', 'v6e') == 2 * 918e12 and flops.quantized_peak_flops('int8', 'v4') is None
  metrics = flops.Throughput(100e12, 1, 989e12, None, ('fp8', ideal)).metrics(step_time_s=0.2)
  assert metrics['mfu'] == pytest.approx(100e12 / 0.2 / 989e12) and metrics['mfu_fp8'] == pytest.approx(ideal / 0.2)


def test_remat_auto_measures_the_quantized_step_and_remembers_it_apart(tmp_path):
  config = _tiny('fp8')
  config.train.remat_policy = 'auto'
  measured = []

  def measure(candidate, devices):
    measured.append(candidate.train.quantization)
    return (1 << 20) if candidate.train.remat_policy == 'full' else (1 << 30), None

  limit = footprint.Limit(256 << 20, 'a test')
  resolved, choice = remat.resolve(config, jax.devices()[:1], limit, measure_fn=measure)
  assert measured and set(measured) == {'fp8'} and resolved.train.quantization == 'fp8'
  assert choice.remat_policy == 'full'
  # A bf16 run's choice is not taken for an fp8 resume: the fingerprint tells the two apart.
  bf16 = _tiny(None)
  bf16.train.remat_policy = 'auto'
  assert remat.fingerprint(bf16, jax.devices()[:1], limit) != remat.fingerprint(config, jax.devices()[:1], limit)
