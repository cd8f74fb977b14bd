"""Plan mode: the compiled step's memory and FLOPs without training, the memory budget, and TPU topologies."""

import importlib.util

import pytest

from configs import tiny
from parallel import sharding
from trainer import flops, plan
from trainer import job as job_lib
from trainer.errors import UserError

TINY = '--config=configs/tiny.py'


def test_plan_reports_mesh_memory_and_flops_of_the_compiled_step():
  config = tiny.get_config()
  config.mesh.fsdp = 2
  lines = []
  result = plan.run(config, print_fn=lines.append)
  text = '\n'.join(lines)
  assert result.mesh_shape == {'data': 4, 'fsdp': 2, 'tensor': 1}
  assert "mesh {'data': 4, 'fsdp': 2, 'tensor': 1} over 8 x cpu" in text
  job = job_lib.build_job(config)
  _, totals = sharding.sharding_table(job.abstract, job.shardings)
  assert result.params_bytes == totals['params_bytes_per_device']
  assert result.opt_state_bytes == totals['opt_state_bytes_per_device']
  # The state is donated: its buffers are the outputs' buffers.
  assert result.params_bytes + result.opt_state_bytes <= result.alias_bytes
  assert result.temp_bytes > 0
  assert result.total_bytes == (result.argument_bytes + result.output_bytes - result.alias_bytes
                                + result.temp_bytes + result.code_bytes)
  expected = flops.step_flops(config.model, config.train.batch_size, config.data.seq_len)
  assert result.flops == expected
  assert f'{expected.matmul:.4g}' in text and f'{expected.six_n:.4g}' in text
  assert 'v5p' in text and 'at 100% MFU' in text
  assert 'Fits' not in text  # No budget given: nothing to judge.


def test_plan_over_budget_fails_naming_changes_that_were_compiled_and_fit():
  config = tiny.get_config()  # data=8: more fsdp is possible, accumulation is not (1 sequence per device).
  base = plan.make_plan(config)
  lines = []
  with pytest.raises(UserError) as e:
    plan.run(config, memory_gb=(base.total_bytes - 1) / plan.GIB, print_fn=lines.append)
  message = str(e.value)
  assert 'over the budget' in message and '--plan_memory_gb=' in message
  assert 'Changes that fit:' in message and '--config.mesh.fsdp=2 --config.mesh.data=-1' in message
  text = '\n'.join(lines)
  assert 'Does not fit' in text and '--config.train.remat_policy=full' in text
  assert '--config.train.batch_size=4: not possible here' in text  # 4 sequences cannot split over 8 devices.


def test_launcher_plan_needs_no_workdir_and_topology_needs_plan(launcher):
  result = launcher(TINY, '--plan', '--config.model.num_layers=1')
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Plan: mesh {'data': 8, 'fsdp': 1, 'tensor': 1}" in result.stdout
  assert 'temporaries' in result.stdout and 'FLOPs per step' in result.stdout
  result = launcher(TINY, '--workdir=/tmp/unused', '--topology=v5p:2x2x2')
  assert result.returncode == 2
  assert result.stderr.strip() == 'launch.py: error: --plan_memory_gb and --topology only apply with --plan.'


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_topology_compiles_the_real_step_for_a_tpu_slice():
  config = tiny.get_config()
  lines = []
  result = plan.run(config, topology='v5p:2x2x2', print_fn=lines.append)
  text = '\n'.join(lines)
  assert result.device_kind == 'TPU v5' and result.mesh_shape == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert 'compute dtype bfloat16' in text  # 'auto' means bfloat16 on the TPU, not float32 as on this CPU.
  assert result.temp_bytes > 0 and result.alias_bytes >= result.params_bytes + result.opt_state_bytes
  assert 'Fits:' in text and 'of 95.00 GiB per device' in text  # Judged against one v5p chip's HBM.
