"""What the brought-model checks cost at launch: the strategy trace and the alignment probe, per test model.

Run from the repository root (8 fake CPU devices, as the tests use):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_brought_models.py
Prints a markdown table: model, framework, glue lines, job build without / with the trace check, probe seconds.
A second trace of the same jitted step hits jax's trace cache, so the check's cost is the difference of two builds.
"""

import inspect
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import tiny  # noqa: E402
from tests.third_party import glue  # noqa: E402
from trainer.models import contract  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402


def _config(builder):
  c = tiny.get_config()
  c.model.name = f'tests.third_party.glue:{builder}'
  c.parallel.extra_axis_rules = glue.RULES[builder]
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.data.source = 'synthetic'
  c.train.compute_dtype = 'float32'
  return c


def main():
  print('| model | framework | glue lines | build_job without the trace check (s) | with it (s) | alignment probe (s) |')
  print('|---|---|---|---|---|---|')
  check = contract.check_strategy
  for builder in ('meshy', 'prefix', 'gemma_style'):
    lines = len(inspect.getsource(getattr(glue, builder)).strip().splitlines())
    contract.check_strategy = lambda job: None
    start = time.perf_counter()
    job_lib.build_job(_config(builder))
    bare_s = time.perf_counter() - start
    contract.check_strategy = check
    start = time.perf_counter()
    job = job_lib.build_job(_config(builder))
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    contract.check_alignment(job, 0)
    probe_s = time.perf_counter() - start
    print(f'| {builder} | {job.task.model.framework} | {lines} | {bare_s:.2f} | {build_s:.2f} | {probe_s:.2f} |')


if __name__ == '__main__':
  main()
