"""Where an MoE step's time goes: moe_1b at batch 8 (dropless) traced for a few steps, its kernels grouped and ranked.

  python benchmarks/moe_profile.py --out=$OUT [--steps=3] [--warmup=2]
  python benchmarks/moe_profile.py --out=/tmp/prof --smoke     # CPU: the shrunk row of bench_gpu.py, seconds

The acceptance command runs it as the row `moe_b8_profile` (benchmarks/bench_gpu_acceptance.py --rows=...).
After `--warmup` untraced steps, `--steps` steps run under jax.profiler with create_perfetto_trace=True; the
trace's kernels (events carrying an `hlo_op`: GPU kernels, or XLA CPU thunks) are summed per HLO op, each op is
named by the jax source scope the compiled HLO's metadata gives it, and sorted into CATEGORIES by the first pattern
that matches. Writes OUT/moe_b8_profile.md (the table), OUT/moe_b8_profile.json and the trace folder
OUT/moe_b8_profile_trace; prints the JSON last. Names are matched loosely (jax and XLA rename kernels between
versions; the device image runs jax 0.11.2), and whatever matches nothing is 'rest', never dropped.
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

ROW = 'moe_b8_profile'
# (category, pattern searched in 'function | jax scope | HLO op | kernel', lower case); the first match wins. The
# function is the one whose line made the HLO op (trainer/models/expert_math.py's route, dropless, ...): jax's scopes
# name the module path and the primitive, not the function.
CATEGORIES = (
    ('all-to-all / collectives', r'all-to-all|all_to_all|alltoall|all-gather|all_gather|all-reduce|all_reduce|'
                                 r'reduce-scatter|reduce_scatter|collective-permute|ppermute|nccl'),
    ('grouped matmul backward', r'^(swiglu_ragged|ragged_dot|_ragged|grouped|with_capacity.*dot).*transpose\('),
    ('grouped matmul forward', r'^(swiglu_ragged|ragged_dot|_ragged|grouped|with_capacity.*dot)|ragged_dot|'
                               r'grouped_matmul'),
    ('router', r'^(route|choose|_sow_router_terms|sow_next)\b|moe/.*top_k'),
    ('sort / permute / gather-scatter', r'^(dropless|with_capacity|capacity_slots|dispatch|_exchange)|'
                                        r'moe/.*(sort|gather|scatter)'),
    ('attention', r'attention|cudnn|flash|\bmha\b|splash'),
)


def _frame_functions(hlo_text: str) -> dict[str, str]:
  """{stack_frame_id: the function of that frame} from the FunctionNames / FileLocations / StackFrames tables a
  compiled module's text carries (jax keeps user frames only, so it is the model's function that made the op)."""
  tables, section = {'FunctionNames': {}, 'FileLocations': {}, 'StackFrames': {}}, None
  for line in hlo_text.splitlines():
    if line.strip() in tables:
      section = line.strip()
    elif section and (row := re.match(r'^(\d+)\s+(.*)$', line.strip())):
      tables[section].setdefault(row.group(1), row.group(2))
    elif not line.strip() or line.startswith(('%', 'ENTRY', 'HloModule')):
      section = None
  field = lambda text, key: (re.search(rf'{key}=(\d+)', text) or [None, ''])[1]
  functions = {}
  for frame, text in tables['StackFrames'].items():
    location = tables['FileLocations'].get(field(text, 'file_location_id'), '')
    functions[frame] = tables['FunctionNames'].get(field(location, 'function_name_id'), '').strip('"')
  return functions


def hlo_scopes(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{HLO instruction name: (its function, its jax scope)} from a compiled module's text: the scope is the metadata's
  op_name, the function the one its stack_frame_id names."""
  scopes, functions = {}, _frame_functions(hlo_text)
  for match in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}', hlo_text, re.MULTILINE):
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', match.group(2)))
    scope, function = fields.get('op_name', '').strip('"'), functions.get(fields.get('stack_frame_id', ''), '')
    if scope or function:
      scopes.setdefault(match.group(1), (function, scope))
  return scopes


def kernel_times(trace_path: pathlib.Path) -> dict[str, dict]:
  """{HLO op: {'us': summed duration, 'count', 'kernel': one kernel name}} of every event naming an `hlo_op`
  (older traces: a `long_name` beside an `hlo_module`) in a perfetto trace (.json or .json.gz). Where the trace has
  device processes ('/device:GPU:0', ...) only their events count: the host's launches of the same ops are not
  device time. A CPU trace has none, and its XLA thunks on the host threads are the kernels."""
  opener = gzip.open if trace_path.suffix == '.gz' else open
  with opener(trace_path, 'rt') as f:
    data = json.load(f)
  events = data.get('traceEvents', []) if isinstance(data, dict) else data
  devices = {e.get('pid') for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and '/device:' in str((e.get('args') or {}).get('name', '')).lower()}
  ops = collections.defaultdict(lambda: {'us': 0.0, 'count': 0, 'kernel': ''})
  for event in events:
    args = event.get('args') or {}
    if event.get('ph') != 'X' or not isinstance(args, dict) or (devices and event.get('pid') not in devices):
      continue
    op = args.get('hlo_op') or (args.get('long_name') if 'hlo_module' in args else None)
    if not op:
      continue
    entry = ops[str(op)]
    entry['us'] += float(event.get('dur') or 0.0)
    entry['count'] += 1
    entry['kernel'] = entry['kernel'] or str(event.get('name', ''))
  return dict(ops)


def categorize(op: str, function: str, scope: str, kernel: str) -> str:
  text = f'{function} | {scope} | {op} | {kernel}'.lower()
  return next((name for name, pattern in CATEGORIES if re.search(pattern, text)), 'rest')


def table(ops: dict[str, dict], scopes: dict[str, str], steps: int, top: int = 25) -> dict:
  """The profile as data: per-category and top-op device time per step, with shares of the traced kernel time."""
  total = sum(o['us'] for o in ops.values()) or 1.0
  rows = []
  for op, o in ops.items():
    function, scope = scopes.get(op, ('', ''))
    rows.append({'op': op, 'function': function, 'scope': scope, 'kernel': o['kernel'], 'count': o['count'],
                 'ms_per_step': o['us'] / 1e3 / steps, 'share': o['us'] / total,
                 'category': categorize(op, function, scope, o['kernel'])})
  rows.sort(key=lambda r: -r['ms_per_step'])
  categories = collections.defaultdict(float)
  for r in rows:
    categories[r['category']] += r['ms_per_step']
  by_category = [{'category': c, 'ms_per_step': ms, 'share': ms * steps * 1e3 / total}
                 for c, ms in sorted(categories.items(), key=lambda kv: -kv[1])]
  return {'steps': steps, 'kernel_ms_per_step': total / 1e3 / steps, 'categories': by_category, 'top': rows[:top]}


def markdown(profile: dict, title: str) -> str:
  lines = [f'## {title}', '', f"{profile['steps']} traced steps, {profile['kernel_ms_per_step']:.2f} ms of kernels "
           f'per step (summed over streams/threads).', '', '| category | ms / step | share |', '|---|---|---|']
  lines += [f"| {c['category']} | {c['ms_per_step']:.3f} | {c['share']:.1%} |" for c in profile['categories']]
  lines += ['', '| HLO op | category | ms / step | share | calls | function | jax scope |',
            '|---|---|---|---|---|---|---|']
  lines += [f"| {r['op']} | {r['category']} | {r['ms_per_step']:.3f} | {r['share']:.1%} | {r['count']} | "
            f"{r['function']} | {r['scope'][-90:]} |" for r in profile['top']]
  return '\n'.join(lines) + '\n'


def trace_row(out: pathlib.Path, steps: int, warmup: int, smoke: bool) -> dict:
  """Builds benchmarks/bench_gpu.py's moe_b8 row (the launcher's Job), runs it, traces `steps` steps, writes the
  table; returns the profile with the step time measured outside the trace."""
  import time

  import jax

  from benchmarks import bench_gpu
  from trainer.run import job as job_lib

  config = bench_gpu.row_config('moe_b8', None, smoke)
  job = job_lib.build_job(config, jax.devices()[:1] if smoke else None, log_fn=print)
  compiled = job.compile_train_step()
  state = job.init_state(job.config.train.seed)
  batch = {k: jax.device_put(jax.random.randint(jax.random.key(i), s.shape, 0, 256).astype(s.dtype), s.sharding)
           for i, (k, s) in enumerate(job.abstract_batch.items())}
  for _ in range(warmup):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  trace_dir = out / f'{ROW}_trace'
  started = time.perf_counter()
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    for _ in range(steps):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
  step_ms = 1e3 * (time.perf_counter() - started) / steps
  traces = sorted(trace_dir.rglob('perfetto_trace.json.gz')) or sorted(trace_dir.rglob('*.trace.json.gz'))
  if not traces:
    raise SystemExit(f'moe_profile.py: jax.profiler wrote no perfetto trace under {trace_dir}.')
  profile = table(kernel_times(traces[-1]), hlo_scopes(compiled.as_text()), steps)
  profile.update(row=ROW, device=jax.devices()[0].device_kind, traced_step_ms=step_ms, trace=str(traces[-1]))
  (out / f'{ROW}.json').write_text(json.dumps(profile, indent=2))
  (out / f'{ROW}.md').write_text(markdown(profile, f'{ROW}: moe_1b batch 8 dropless on {profile["device"]}, '
                                                   f'{step_ms:.1f} ms per traced step'))
  return profile


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='Folder for the table, its JSON and the trace.')
  parser.add_argument('--steps', type=int, default=3, help='Traced steps.')
  parser.add_argument('--warmup', type=int, default=2, help='Untraced steps first (the first compiles nothing: '
                                                            'the step is compiled ahead of time, but warms caches).')
  parser.add_argument('--smoke', action='store_true', help="CPU: bench_gpu.py's shrunk moe_b8.")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  profile = trace_row(out, max(1, args.steps), max(1, args.warmup), args.smoke)
  summary = {'row': ROW, 'device': profile['device'], 'traced_step_ms': profile['traced_step_ms'],
             'kernel_ms_per_step': profile['kernel_ms_per_step'],
             'categories': {c['category']: round(c['share'], 4) for c in profile['categories']},
             'table': str(out / f'{ROW}.md')}
  print(json.dumps(summary))
  return summary


# With XLA's CUDA graphs (the launcher's default on GPUs) the trace shows each graph as one kernel: on an H200 half the
# kernel time of this row sat in graphs it could not attribute (BENCHMARKS.md "MoE at scale"). A profile is for
# attribution, so the row runs without them: appended, as XLA takes a flag's last value, over the GPU flags the
# acceptance command hands its children (trainer/run/gpu_env.py). Set before jax is imported.
NO_GRAPHS = '--xla_gpu_enable_command_buffer='

if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {NO_GRAPHS}".strip()
  main()
