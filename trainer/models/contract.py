"""What a brought model is checked against before it trains: it runs under the strategy, and it lines up with targets.

Both checks are for models the launcher did not write (`model.name` an import
path); the built-in ones are tested under every strategy.

- `check_strategy`: the train step is traced (abstract values, nothing
  compiled) under the configured strategy and mesh, so a model that cannot run
  there (a sharding constraint 'shard_map' or 'pmap' cannot honour, a keyword it
  does not take, parameters 'pmap' cannot replicate) ends in one line naming the
  model, the strategy and what to change, before the long compile.
- `check_alignment` (model.task='lm', no loss of its own): the launcher's
  batches are already shifted, logits[t] scoring targets[t] = inputs[t + 1]. A
  model that shifts its inputs again trains one token further ahead, and one
  that sees later inputs learns to copy them; neither shows in the loss at
  step 1 (both start near ln(vocab)). The probe changes one input token, at
  position p, and compares the logits: at every t < p they must not move (no
  look-ahead) and at p they must (logits[t] reads inputs[t]).
"""

import traceback

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from absl import logging

from parallel import context as context_lib
from parallel import sharding
from trainer import data
from trainer.base import frames
from trainer.base.errors import UserError
from trainer.models import adapters

_CONSTRAINT_HINTS = ('mesh context', 'resource axis', 'with_sharding_constraint', 'sharding_constraint',
                     'not found in mesh', 'manual')


def _cause(e: Exception, name: str) -> tuple[str, str, str]:
  """(the whole message on one line, where it was raised: the deepest frame that is not a library's, as file:line,
  and whose that frame is: 'user' or 'launcher', trainer/base/frames.py)."""
  who, where = frames.blamed(e, name)
  return frames.one_line(e), where, who


def _raised_in_sharded_matmul(e: Exception) -> bool:
  """Whether jax's einsum/dot raised it over a PartitionSpec: a model passing out_sharding= (sharding in types)."""
  raised = traceback.extract_tb(e.__traceback__)  # jax filters its own frames out: the model's line tells.
  return any('out_sharding' in (f.line or '') or f.name in ('einsum', 'dot', 'matmul', 'dot_general') for f in raised)


# How the launcher's attention brings keys/values across the split: all at once, or around a ring
# (model.context_scheme, trainer/attention/context.py).
_CROSSING = ('all_gather', 'ppermute')


def _gathers_over(jaxpr, axis: str) -> bool:
  """Whether the jaxpr (or one inside it) gathers keys/values over mesh axis `axis`, at once or around a ring."""
  for eqn in jaxpr.eqns:
    names = eqn.params.get('axis_name', ()) if eqn.primitive.name in _CROSSING else ()
    if axis in ((names,) if isinstance(names, str) else tuple(names)):
      return True
    if any(_gathers_over(getattr(sub, 'jaxpr', sub), axis) for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
      return True
  return False


def _check_attends_across_context(traced, name: str, parts: int) -> None:
  """mesh.context > 1: the step must run the launcher's attention across the split (it gathers or passes keys/values
  over `context`); attention of the model's own would see only each device's part of every row, silently."""
  if parts > 1 and not _gathers_over(traced.jaxpr.jaxpr, context_lib.AXIS):
    raise UserError(f'model.name={name!r} under mesh.context={parts}: its step gathers nothing over the context '
                    f'axis, so its attention would see only each device\'s part of a row. Call '
                    f'trainer.attention.dot_product_attention(..., mesh=mesh, rules=rules) with the mesh and rules '
                    f'its builder is given (docs/context.md), or set mesh.context=1.')


def check_strategy(job) -> None:
  """One UserError when the brought model cannot be traced under the job's strategy and mesh."""
  config, mesh = job.config, job.mesh
  name, strategy = config.model.name, config.parallel.strategy
  if strategy == 'pmap':
    split = [(path, named) for path, named in jax.tree_util.tree_flatten_with_path(job.shardings.params)[0]
             if not named.is_fully_replicated]
    if split:
      boxes = jax.tree.leaves(job.task.model.abstract_boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
      specs = jax.tree.leaves(job.shardings.params)
      names = sorted({n for box, s in zip(boxes, specs) if not s.is_fully_replicated
                      for n, axis in zip(box.names, s.spec) if n is not None and axis is not None})
      rules = '(' + ''.join(f"('{n}', None), " for n in names).rstrip(' ') + ')'
      path, named = split[0]
      raise UserError(f"model.name={name!r}: parameter {sharding.path_name(path)} is split over the mesh "
                      f"({tuple(named.spec)}) by its own axis names, but parallel.strategy='pmap' keeps every "
                      f"parameter whole on every device; use parallel.strategy='jit' or 'shard_map', or keep them "
                      f"whole with --config.parallel.extra_axis_rules=\"{rules}\".")
  try:
    abstract = sharding.with_shardings(job.abstract, job.shardings)
    traced = job.train_step.trace(abstract, job.abstract_batch)
    if config.train.eval_batches > 0:  # Eval is partitioned apart from the train step: checked before it too.
      job.eval_step.trace(abstract.params, job.abstract_batch)
  except UserError:
    raise
  except Exception as e:  # Whatever the model raised while traced: one line, with the fix where it is known.
    keyword = adapters.call_error(e, name, {}) if isinstance(e, TypeError) else e  # A keyword its call requires.
    if isinstance(keyword, UserError):
      raise keyword from e
    _refuse(e, name, strategy, mesh, job.task.model.module_class)
  _check_attends_across_context(traced, name, mesh.shape.get(context_lib.AXIS, 1))
  logging.info('model.name=%r traces under parallel.strategy=%r on mesh %s.', name, strategy, dict(mesh.shape))


def _refuse(e: Exception, name: str, strategy: str, mesh, module_class: type) -> None:
  """Raises the one-line UserError for what the model raised while traced."""
  cause, where, who = _cause(e, name)
  lowered = cause.lower()
  other = " or try --config.parallel.strategy=jit" if strategy != 'jit' else ''
  packed = [k for k in data.PACKED_KEYS if isinstance(e, TypeError) and f"'{k}'" in cause]
  if packed:
    raise UserError(adapters.packing_refusal(name, module_class, packed[0])) from e
  if 'of type auto' in lowered or _raised_in_sharded_matmul(e):
    fix = ("the model shards for a mesh with Explicit axes (out_sharding= on its einsums/dots, or "
           "jax.sharding.reshard), but the launcher's mesh axes are Auto (Manual inside 'shard_map'): remove those "
           "out_sharding= arguments (e.g. choose the model's own no-sharding config); the launcher shards "
           "parameters from their names")
  elif strategy != 'jit' and any(h in lowered for h in _CONSTRAINT_HINTS):
    fix = (f"the model pins activation shardings, which only parallel.strategy='jit' can honour (under "
           f"{strategy!r} it runs on each device's shard); use --config.parallel.strategy=jit")
  elif who == 'launcher':
    fix = f"this failed inside the launcher ({where}), not the model: please report it with this line{other}"
  else:
    fix = f"change the model where it raised ({where or 'see the traceback above'}){other}"
  raise UserError(f'model.name={name!r} cannot run under parallel.strategy={strategy!r} on mesh '
                  f'{dict(mesh.shape)}: {cause} (raised at {where or "an unknown place"}). To fix: {fix}.') from e


def check_alignment(job, seed: int) -> None:
  """One UserError when logits[t] does not read inputs[t], or reads a later input (see the module docstring)."""
  task, config = job.task, job.config
  params = jax.jit(task.model.init, out_shardings=job.shardings.params)(jax.random.key(seed))
  rows = job.mesh.shape['data'] * job.mesh.shape['fsdp']  # The model may pin its batch over these axes.
  length, vocab = config.data.seq_len, config.model.vocab_size
  p = length // 2
  if p == 0:
    return  # One position: nothing to compare it with.
  tokens = np.asarray(jax.random.randint(jax.random.key(seed + 1), (rows, length), 1, vocab), np.int32)
  changed = tokens.copy()
  changed[:, p] = tokens[:, p] % (vocab - 1) + 1  # Another token, never 0 (padding in some vocabularies).
  extra = {'segment_ids': np.ones_like(tokens), 'positions': np.broadcast_to(np.arange(length, dtype=np.int32),
                                                                            tokens.shape)}
  keys = [k for k in data.PACKED_KEYS if k in task.batch_shapes()]

  @jax.jit
  def moved(params, a, b):
    outputs = [task.outputs(params, {'inputs': x, 'targets': x, **{k: extra[k] for k in keys}}).astype(jnp.float32)
               for x in (a, b)]
    return jnp.max(jnp.abs(outputs[0] - outputs[1]), axis=(0, 2))  # Per position.

  change = np.asarray(moved(params, tokens, changed))
  scale = max(float(change.max()), 1e-30)
  name = config.model.name
  if getattr(task.objective, 'feed', 'inputs') == 'targets':
    _check_unshifted(change, p, scale, name)
    return
  if change[:p].max() > 1e-3 * scale:
    first = int(np.argmax(change[:p] > 1e-3 * scale))
    raise UserError(f'model.name={name!r} is not causal: changing inputs[{p}] changed the logits at position {first}, '
                    f'before it. An lm model must score targets[t] = inputs[t+1] from inputs[0..t] only, or it learns '
                    f'to copy its targets; mask attention causally (or set --config.model.check_alignment=False if '
                    f'this is intended).')
  if change[p] <= 1e-3 * scale:
    raise UserError(f'model.name={name!r}: its logits at position {p} do not depend on inputs[{p}], so it shifts its '
                    f'inputs itself; the launcher\'s batches are already shifted (logits[t] scores targets[t] = '
                    f'inputs[t+1]), so it would train one token further ahead. Remove the model\'s own shift, or set '
                    f'--config.model.unshifted_inputs=True to feed it unshifted rows (or set '
                    f'--config.model.check_alignment=False if this is intended).')
  logging.info('model.name=%r: logits[t] read inputs[t] and no later input (alignment probe at position %d).', name, p)


def _check_unshifted(change, p: int, scale: float, name: str) -> None:
  """model.unshifted_inputs: the model is fed the targets and shifts them itself, so logits[t] read fed[t-1]."""
  if change[:p].max() > 1e-3 * scale:
    first = int(np.argmax(change[:p] > 1e-3 * scale))
    raise UserError(f'model.name={name!r} is not causal: changing its input at {p} changed the logits at position '
                    f'{first}, before it; mask attention causally (or set --config.model.check_alignment=False if '
                    f'this is intended).')
  if change[p] > 1e-3 * scale:
    raise UserError(f'model.name={name!r}: model.unshifted_inputs=True feeds it the targets for it to shift right, but '
                    f'its logits at position {p} read its input at {p}: it does not shift. Set '
                    f'--config.model.unshifted_inputs=False.')
  if p + 1 < len(change) and change[p + 1] <= 1e-3 * scale:
    raise UserError(f'model.name={name!r}: with model.unshifted_inputs=True its logits at position {p + 1} should read '
                    f'its input at {p} (it shifts right by one), and they do not; check how the model shifts its rows.')
