"""Largest relative drift of loss and grad_norm over 30 steps, per optimizer and strategy, against jit on (2, 2, 2).

The yardstick behind tests/test_optimizers.py::test_strategies_agree (BENCHMARKS.md, issue 37). Run from the
repository root: .venv/bin/python benchmarks/bench_strategy_drift.py
"""
import sys
sys.path.insert(0, 'tests'); sys.path.insert(0, '.')
import conftest
import numpy as np, tempfile
from conftest import read_metrics
from trainer.run import loop
import test_optimizers as t
for name in ['adafactor', 'muon', 'lion', 'sgd']:
  runs = {}
  for strat, mesh in [('jit', (2, 2, 2)), ('jit', (8, 1, 1)), ('shard_map', (8, 1, 1)), ('pmap', (8, 1, 1))]:
    d = tempfile.mkdtemp(prefix='i37-opt-')
    loop.run(t._config(name, strat, mesh), d)
    runs[strat + str(mesh[0])] = read_metrics(d)
  ref = runs['jit2']
  for k, r in runs.items():
    if k == 'jit2': continue
    out = []
    for key in ('loss', 'grad_norm'):
      a = np.array([x[key] for x in r]); b = np.array([x[key] for x in ref])
      out.append(f'{key} {(np.abs(a - b) / np.abs(b)).max():.2e}')
    a = np.array([x['grad_norm'] for x in r]); b = np.array([x['grad_norm'] for x in runs['jit8']])
    print(name, k, *out, 'vs jit8 gn', f'{(np.abs(a-b)/np.abs(b)).max():.2e}', flush=True)
