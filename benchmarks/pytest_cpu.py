"""Where the test suite's CPU goes: a pytest plugin writing each test's CPU seconds, and a per-file table of them.

  PYTHONPATH=benchmarks PYTEST_CPU_OUT=/tmp/suite-cpu PYTEST_ADDOPTS="-p pytest_cpu" bash .ci/run
  python benchmarks/pytest_cpu.py /tmp/suite-cpu

Per test (setup, call and teardown): the test process's own CPU, its finished subprocesses' CPU (a launcher's
included), the wall time, and the jax compiles it ran in-process with their seconds. One JSON line per test, in a
file per xdist worker (PYTEST_CPU_OUT.gw0, ...). CPU is what a loaded 2-core machine runs out of, so it ranks files
better than their wall time, which depends on what ran beside them.
"""

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest

_EVENTS = {'compiles': 0, 'compile_s': 0.0}
_LISTENING = []


def _listen():
  if _LISTENING:
    return
  import jax  # pylint: disable=import-outside-toplevel  (only once a test runs: the conftest set XLA_FLAGS first)

  def on_duration(name, seconds, **_):
    if name == '/jax/core/compile/backend_compile_duration':
      _EVENTS['compiles'] += 1
      _EVENTS['compile_s'] += seconds

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  _LISTENING.append(True)


def _cpu() -> tuple[float, float]:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  forked = sys.modules.get('forked_python')  # tests/forked_python.py: commands forked from a server, not children.
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + (forked.CHILD_CPU[0] if forked else 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  """Measures around the whole protocol of one test."""
  _listen()
  before, (own, children), start = dict(_EVENTS), _cpu(), time.monotonic()
  yield
  own_after, children_after = _cpu()
  record = {'id': item.nodeid, 'self': own_after - own, 'children': children_after - children,
            'wall': time.monotonic() - start, 'end': time.time(), **{k: _EVENTS[k] - before[k] for k in _EVENTS}}
  path = f"{os.environ.get('PYTEST_CPU_OUT', '/tmp/suite-cpu')}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
  with open(path, 'a', encoding='utf-8') as f:
    f.write(json.dumps(record) + '\n')



def main(prefix: str, top: int = 15) -> None:
  records = [json.loads(line) for path in glob.glob(prefix + '.*') for line in open(path, encoding='utf-8')]
  cpu = lambda r: r['self'] + r['children']
  files = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
  for r in records:
    row = files[r['id'].split('::')[0]]
    row[0] += cpu(r)
    row[1] += r['children']
    row[2] += r['wall']
    row[3] += 1
  print(f'{len(records)} tests: {sum(map(cpu, records)):.0f} s of CPU ({sum(r["children"] for r in records):.0f} in '
        f'subprocesses), {sum(r["compile_s"] for r in records):.0f} s in {sum(r["compiles"] for r in records)} '
        f'in-process compiles; {sum(r["wall"] for r in records):.0f} s of test time')
  print('| file | tests | CPU s | of it in subprocesses | test time s |')
  print('|---|---|---|---|---|')
  for name, (total, children, wall, count) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f'| {name} | {count} | {total:.0f} | {children:.0f} | {wall:.0f} |')
  _timeline(prefix)


def _timeline(prefix: str) -> None:
  """Per worker: when its first test started and its last ended, and the files it ran last (the run's tail)."""
  workers = {}
  for path in sorted(glob.glob(prefix + '.*')):
    records = [json.loads(line) for line in open(path, encoding='utf-8')]
    if records and 'end' in records[0]:
      workers[path.rsplit('.', 1)[1]] = records
  if not workers:
    return
  zero = min(r['end'] - r['wall'] for records in workers.values() for r in records)
  print('| worker | first test starts s | last test ends s | its last files (start s) |')
  print('|---|---|---|---|')
  for worker, records in workers.items():
    starts = {}
    for r in records:
      starts.setdefault(r['id'].split('::')[0], r['end'] - r['wall'] - zero)
    last = ', '.join(f'{name.split("/")[-1]} ({start:.0f})' for name, start in list(starts.items())[-3:])
    print(f'| {worker} | {records[0]["end"] - records[0]["wall"] - zero:.0f} | {records[-1]["end"] - zero:.0f} | '
          f'{last} |')


if __name__ == '__main__':
  main(sys.argv[1], *map(int, sys.argv[2:3]))
