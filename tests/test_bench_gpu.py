"""benchmarks/bench_gpu.py runs its rows through the launcher's Job, data and loop: --smoke on CPU, in-process;
benchmarks/bench_attention.py checks kernels against float32 XLA and catches leaks across documents."""

import importlib.util
import tempfile

import numpy as np
import pytest

from conftest import REPO


@pytest.fixture(scope='module')
def bench():
  spec = importlib.util.spec_from_file_location('bench_gpu', REPO / 'benchmarks' / 'bench_gpu.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_smoke_row_reports_throughput_and_data_wait_but_no_made_up_mfu_on_cpu(bench, capsys, tmp_path,
                                                                               monkeypatch):
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))  # Where the row's workdir goes.
  row, minimal = bench.main(['--smoke', '--rows=gpt2_b32,gpt2_b32_minimal', '--steps=3', '--warmup=1'])
  assert not list(tmp_path.iterdir())  # The row's workdir is gone.
  assert row['row'] == 'gpt2_b32' and row['unit'] == 'tokens' and row['devices'] == 1
  assert row['per_s'] == pytest.approx(8 * 32 / (row['step_ms'] / 1e3), rel=1e-6)  # batch 8 x 32 tokens.
  # CPU: no peak FLOP/s in trainer/observe/flops.py's table, no memory stats; nothing is made up. TFLOP/s is measured.
  assert row['mfu'] is None and row['mfu_6n'] is None and row['peak_gib'] is None and row['tflops'] > 0
  assert 0 <= row['data_wait_pct'] < 100
  assert 0 < row['compiled_gib'] < 1  # The compiled step's own figure, as plan mode prints it.
  out = capsys.readouterr().out
  assert row['attention'] == 'xla'  # What trainer/attention runs on CPU.
  assert ('| row | device | attention | per s | step (ms) | TFLOP/s per device | MFU | MFU 6N | peak GiB '
          '| compiled GiB | data wait |') in out
  assert '| gpt2_b32 | 1 x cpu | xla |' in out
  assert f"| {row['tflops']:.3g} | - | - | - | {row['compiled_gib']:.2f} |" in out
  # The hand-written reference on the same model: the same FLOPs per step, so TFLOP/s scale with the step time.
  assert minimal['row'] == 'gpt2_b32_minimal' and minimal['attention'] == 'xla' and minimal['data_wait_pct'] is None
  assert minimal['per_s'] == pytest.approx(8 * 32 / (minimal['step_ms'] / 1e3), rel=1e-6)
  assert minimal['tflops'] * minimal['step_ms'] == pytest.approx(row['tflops'] * row['step_ms'], rel=1e-6)
  assert 0 < minimal['compiled_gib'] < 1 and minimal['mfu'] is None
  assert f"| gpt2_b32_minimal | 1 x cpu | xla |" in out and out.rstrip().endswith('| - |')


def test_every_row_builds_its_config_and_attention_is_passed(bench):
  for name in bench.ROWS:
    config = bench.row_config(name, None, smoke=False)
    assert config.ckpt.every_steps == 10**9 and config.train.eval_every_steps == 0
  # References exist for the synthetic-token rows only; text and images have no hand-written twin.
  assert set(bench.REFERENCES) == {'gpt2_b32_minimal', 'gpt2_b64_minimal'} | {
      f'{name}_minimal' for name in bench.ROWS if name.startswith('llama_b16_') and not name.endswith('_chunked')}
  assert bench.row_config('gpt2_b64_chunked', None, smoke=False).train.loss_chunks == 8
  with pytest.raises(SystemExit, match=r"unknown --rows \['vit_b256_minimal'\]"):
    bench.main(['--smoke', '--rows=vit_b256_minimal'])
  assert bench.row_config('gpt2_b32_packed', None, smoke=False).data.packing
  assert bench.row_config('llama_b16_save_qkv_proj', None, smoke=False).train.remat_policy == 'save_qkv_proj'
  assert bench.row_config('vit_b256', None, smoke=False).train.batch_size == 256
  assert bench.row_config('gpt2_b32', None, smoke=False).model.attention == 'auto'
  assert bench.row_config('gpt2_b32', 'xla', smoke=False).model.attention == 'xla'
  with pytest.raises(SystemExit, match=r"unknown --rows \['gpt3'\]"):
    bench.main(['--rows=gpt3'])


def test_attention_bench_checks_numerics_and_catches_a_kernel_that_leaks_across_documents(capsys):
  spec = importlib.util.spec_from_file_location('bench_attention', REPO / 'benchmarks' / 'bench_attention.py')
  bench_attention = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench_attention)
  ids = bench_attention.documents(3, 64, 4)
  assert [sorted(set(row)) for row in ids.tolist()] == [[1, 2, 3, 4]] * 3 and (np.diff(ids, axis=1) >= 0).all()
  rows = bench_attention.main(['--cases=llama', '--batch=1', '--seq_len=64', '--kernels=xla,leaky', '--repeats=1'])
  by = {(r['kernel'], r['packed']): r for r in rows}
  assert by['xla', True]['leak'] == 0 and by['xla', True]['err_dk'] == 0  # The float32 reference itself.
  assert by['leaky', True]['leak'] > 0.1 and by['leaky', True]['err_out'] > 0.1  # Attends across documents.
  assert by['leaky', False]['err_out'] == 0  # One document per row: nothing to leak.
  (bf16,) = bench_attention.main(['--cases=gpt2', '--batch=1', '--seq_len=64', '--kernels=xla', '--repeats=1',
                                  '--dtype=bfloat16'])[1:2]
  assert bf16['packed'] and bf16['leak'] == 0 and 1e-4 < bf16['err_out'] < 2e-2 and bf16['err_dq'] < 2e-2
  assert '| llama | 1x64 32/8x64 | True | leaky |' in capsys.readouterr().out


def _acceptance():
  spec = importlib.util.spec_from_file_location('bench_gpu_acceptance', REPO / 'benchmarks' / 'bench_gpu_acceptance.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_acceptance_command_writes_one_json_and_one_log_on_cpu(tmp_path, capsys):
  import json
  result = _acceptance().main(['--out', str(tmp_path), '--smoke', '--launches=2', '--steps=2', '--warmup=1'])
  assert sorted(p.name for p in tmp_path.iterdir()) == ['acceptance.json', 'acceptance.log']
  assert json.loads((tmp_path / 'acceptance.json').read_text()) == result
  jobs = result['default_job']
  assert jobs['crashes'] == 0 and [r['exit_code'] for r in jobs['launches']] == [0, 0]
  assert all(r['tokens_per_s'] > 0 for r in jobs['launches'])
  assert [r['row'] for r in result['rows']] == ['gpt2_b32', 'gpt2_b32_minimal', 'moe_b8']
  assert all('error' not in r and r['table_line'].startswith(f"| {r['row']} | 1 x cpu |") for r in result['rows'])
  assert result['versions']['jax'] and result['device'] == 'cpu'
  log = (tmp_path / 'acceptance.log').read_text()
  assert '===== launch 2/2: configs/tiny.py (exit 0)' in log and '===== row moe_b8 (exit 0)' in log
  assert 'default job: 0 of 2 launches crashed; rows: 3 of 3 ran' in capsys.readouterr().out


def test_a_crashing_launch_is_counted_with_its_last_line(tmp_path):
  import time
  acceptance = _acceptance()
  log = acceptance.Log(tmp_path / 'acceptance.log')
  jobs = acceptance.launches(1, 'configs/tiny.py', ['--config.train.steps=4'], log, time.monotonic() + 600,
                             env={'LAUNCH_TEST_FAULT': 'crash@2'})  # An exception in step 2: exit 1.
  assert jobs['crashes'] == 1 and jobs['launches'][0]['exit_code'] == 1 and jobs['launches'][0]['failure']
  assert '(exit 1)' in log.path.read_text()


def test_the_moe_profile_row_traces_a_real_step_and_groups_its_kernels(tmp_path):
  """--rows=moe_b8_profile on CPU (the shrunk moe_b8): a real jax.profiler trace parsed into categories whose shares
  sum to 1, the grouped matmuls forward and backward told apart by the HLO's source frames, and written to OUT."""
  import json
  result = _acceptance().main(['--out', str(tmp_path), '--smoke', '--launches=0', '--steps=2', '--warmup=1',
                               '--rows=moe_b8_profile'])
  row = result['rows'][0]
  assert row['row'] == 'moe_b8_profile' and 'error' not in row, row
  profile = json.loads((tmp_path / 'moe_b8_profile.json').read_text())
  shares = {c['category']: c['share'] for c in profile['categories']}
  assert abs(sum(shares.values()) - 1) < 1e-6 and profile['steps'] == 2
  assert shares['grouped matmul forward'] > 0.05 and shares['grouped matmul backward'] > 0.05
  assert {'router', 'sort / permute / gather-scatter', 'attention'} <= set(shares)
  assert any(r['function'] == 'swiglu_ragged' for r in profile['top'])
  table = (tmp_path / 'moe_b8_profile.md').read_text()
  assert '| grouped matmul backward |' in table and '| HLO op | category |' in table


def test_the_moe_profile_parser_reads_gpu_kernel_names(tmp_path):
  """A GPU-shaped perfetto trace (kernels on a device's stream, hlo_op in args; an event without one is not a
  kernel, nor the host's launch of one): each op summed over its calls, named by its frame's function, and an
  all-to-all found by its name."""
  import gzip
  import json
  spec = importlib.util.spec_from_file_location('moe_profile', REPO / 'benchmarks' / 'moe_profile.py')
  prof = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(prof)
  hlo = '\n'.join([
      'HloModule jit_train_step', '', 'FunctionNames', '1 "route"', '2 "swiglu_ragged"', '',
      'FileLocations', '1 {file_name_id=1 function_name_id=1 line=3}', '2 {file_name_id=1 function_name_id=2 line=9}',
      '', 'StackFrames', '1 {file_location_id=1 parent_frame_id=1}', '2 {file_location_id=2 parent_frame_id=1}', '',
      'ENTRY %main {',
      '  %fusion.1 = f32[8] fusion(%p), metadata={op_name="jit(train_step)/jvp(Llama)/moe/top_k" stack_frame_id=1}',
      '  %custom-call.7 = f32[8] custom-call(%p), metadata={op_name="jit(train_step)/transpose(jvp(Llama))/moe/'
      'ragged_dot" stack_frame_id=2}',
      '  %all-to-all.3 = f32[8] all-to-all(%p), metadata={op_name="jit(train_step)/moe/shard_map"}', '}'])
  events = [{'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
            {'ph': 'M', 'pid': 2, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
            {'ph': 'X', 'pid': 1, 'name': 'triton_grouped_gemm', 'dur': 300.0, 'args': {'hlo_op': 'custom-call.7'}},
            {'ph': 'X', 'pid': 1, 'name': 'triton_grouped_gemm', 'dur': 100.0, 'args': {'hlo_op': 'custom-call.7'}},
            {'ph': 'X', 'pid': 1, 'name': 'topk_kernel', 'dur': 50.0, 'args': {'hlo_op': 'fusion.1'}},
            {'ph': 'X', 'pid': 1, 'name': 'ncclDevKernel_SendRecv', 'dur': 50.0, 'args': {'hlo_op': 'all-to-all.3'}},
            {'ph': 'X', 'pid': 1, 'name': 'MemcpyD2D', 'dur': 9999.0, 'args': {}},
            {'ph': 'X', 'pid': 2, 'name': 'KernelThunk', 'dur': 9999.0, 'args': {'hlo_op': 'custom-call.7'}}]
  path = tmp_path / 'perfetto_trace.json.gz'
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': events}, f)
  profile = prof.table(prof.kernel_times(path), prof.hlo_scopes(hlo), steps=2)
  assert profile['kernel_ms_per_step'] == 0.25
  assert {c['category']: c['share'] for c in profile['categories']} == {
      'grouped matmul backward': 0.8, 'router': 0.1, 'all-to-all / collectives': 0.1}
  assert [(r['op'], r['function'], r['count']) for r in profile['top']] == [
      ('custom-call.7', 'swiglu_ragged', 2), ('fusion.1', 'route', 1), ('all-to-all.3', '', 1)]
