"""Matmul FLOPs of a compiled step, read from its optimized HLO, and the dense-experts guard built on them.

`compiled.cost_analysis()` answers None for steps compiled for GPUs on a host without one (plan mode's
`--topology=h100`), and counts a loop body once. This reads the HLO text instead: every `dot` instruction
(2 * output elements * contracted elements), in fused computations too, times how often its computation runs
(a `while` with a known trip count runs its body that many times). Custom calls (cuDNN attention, Triton kernels)
are not seen, so the count is what XLA itself runs as matmuls; `kernels=True` adds the Triton grouped matmuls of
trainer/models/grouped_matmul.py at their grid's size (2 x padded rows x D x F; tiles of no group, which the kernel
skips at run time, included), so a step's per-device expert work shows.

The guard: a dropless MoE step whose XLA matmuls exceed the traced FLOPs (the active experts' work,
trainer/observe/traced_flops.py) by more than DENSE_RATIO runs experts on tokens not routed to them: XLA's GPU lowering
of `ragged_dot` does that (moe_1b b8 for an H100: BENCHMARKS.md "Grouped matmul for experts").
"""

import math
import re
from collections import defaultdict

DENSE_RATIO = 1.3  # Compiled matmul FLOPs over the active count above which the step runs idle experts.

_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\][^ ]* (\w[\w\-]*)\((.*)')
_CALLEES = re.compile(r'\b(calls|body|condition|to_apply)=%?([\w.\-]+)|\b(branch_computations)=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}')
_GROUPED_MATMUL = re.compile(r'operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}.*op_name="[^"]*/grouped_matmul')
_SHAPE = re.compile(r'\w+\[([\d,]*)\]')


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(',') if d]


def _grouped_matmul_flops(rest: str, out_dims: list[int]) -> float:
  """A Triton grouped matmul's FLOPs from its operands: the padded rows (rows, D) times the output's last width F."""
  found = _GROUPED_MATMUL.search(rest)
  rows_D = next((s for s in map(_dims, _SHAPE.findall(found.group(1))) if len(s) == 2), None) if found else None
  return 2.0 * rows_D[0] * rows_D[1] * out_dims[-1] if rows_D and out_dims else 0.0


def dot_flops(hlo_text: str, kernels: bool = False) -> float:
  """Matmul FLOPs of one execution of the optimized HLO module `hlo_text` (`compiled.as_text()`); `kernels`: with the
  Triton grouped matmuls."""
  shapes, dots, calls, entry, current = {}, defaultdict(float), defaultdict(list), None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line[:1].isspace():  # A computation's header (instructions are indented).
      current = head.group(1)
      if line.startswith('ENTRY'):
        entry = current
      continue
    if current is None or ' = ' not in line:
      continue
    rest = line.split(' = ', 1)[1]
    found = _INSTRUCTION.match(line)  # Array-shaped results; a tuple-shaped one (a while loop) has none.
    if found:
      name, _, dims, op, rest = found.groups()
      shapes[(current, name)] = _dims(dims)
    if found and op == 'dot':
      lhs = rest.split(',')[0].strip().lstrip('%').split(')')[0]
      contracting = _CONTRACTING.search(rest)
      lhs_shape = shapes.get((current, lhs))
      if lhs_shape is not None and contracting:
        dots[current] += 2.0 * math.prod(_dims(dims)) * math.prod(lhs_shape[d] for d in _dims(contracting.group(1)))
    if found and op == 'custom-call' and kernels:
      dots[current] += _grouped_matmul_flops(rest, _dims(dims))
    trip = _TRIP.search(rest)
    for kind, callee, branches, callees in _CALLEES.findall(rest):
      for callee in [callee] if callee else callees.replace('%', '').split(', '):
        calls[current].append((callee.strip(), int(trip.group(1)) if trip and kind == 'body' else 1))
  runs = defaultdict(float)

  def visit(computation: str, times: float, depth: int = 0) -> None:
    if depth > 64:
      return
    runs[computation] += times
    for callee, n in calls.get(computation, ()):
      visit(callee, times * n, depth + 1)

  if entry is not None:
    visit(entry, 1.0)
  return sum(flops * runs[c] for c, flops in dots.items())


def dense_experts_line(compiled_flops: float, active_flops: float, moe_dropless: bool) -> str | None:
  """One line naming the fix when a dropless MoE step's compiled matmuls exceed the active count by DENSE_RATIO;
  None otherwise."""
  if not moe_dropless or not active_flops or compiled_flops <= DENSE_RATIO * active_flops:
    return None
  return (f'The compiled step runs {compiled_flops / active_flops:.1f}x the active FLOPs as XLA matmuls: its MoE '
          f'grouped matmuls run every expert on every token (XLA pads ragged_dot on this backend). On NVIDIA GPUs '
          f'the launcher uses its Triton grouped matmul (expert widths must be multiples of 16); elsewhere set '
          f'--config.model.expert_capacity_factor=1.25 (capacity mode: batched matmuls near the active FLOPs).')
