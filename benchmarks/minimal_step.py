"""The hand-written train step the benchmarks hold the launcher's against (benchmarks/bench_step.py, bench_gpu.py).

What one would write without the launcher, on the launcher's own model: cross entropy, `jax.value_and_grad`,
the job's optax update, params and optimizer state donated, the job's shardings. No metrics, guard or loop.
"""

import jax
import optax

from parallel import sharding


def build(job):
  """A jitted `step(params, opt_state, batch) -> (params, opt_state, loss)` for a language-model Job."""
  bind, tx = job.task.model.bind, job.tx

  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = bind(p)(batch['inputs'])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  s = job.shardings
  return jax.jit(step, in_shardings=(s.params, s.opt_state, job.batch_shardings),
                 out_shardings=(s.params, s.opt_state, sharding.replicated(job.mesh)), donate_argnums=(0, 1))
