"""MoE dispatch figures for BENCHMARKS.md: the MoE layer's forward and backward, timed side by side.

  python benchmarks/bench_moe.py [--tokens=4096] [--d_model=512] [--experts=8] [--top_k=2] [--expert_mlp_dim=1024]
      [--rounds=15]

Each round times, once each and in turn (so load on a shared machine hits all
alike), the jitted gradient of one MoE layer (trainer/models/moe.py) on
`tokens` tokens for:

- dropless: tokens sorted by expert through jax.lax.ragged_dot (the default);
- capacity 1.0 / 1.25: (E, C, D) buffers and batched matmuls, overflow dropped;
- dense loop: the reference of the same active FLOPs, a Python loop over the
  experts, each expert's tokens gathered and run as plain matmuls (what
  ragged_dot computes, written without it); its group sizes are fixed at trace
  time, so it is what a grouped matmul at best costs;
- all experts: every expert on every token (E/K times the active FLOPs), what
  a layer without dispatch would run.

Prints the median milliseconds of each and its ratio to the dense loop.
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from trainer.models import moe  # noqa: E402


def _routing(x, params, k):
  return moe.route(x, params['router'], k)


def _dense_loop(params, x, experts_np, weights):
  """Each expert's tokens (known on the host) as a plain SwiGLU matmul: the same active FLOPs, no grouped matmul."""
  out = jnp.zeros_like(x)
  for e in range(params['gate'].shape[0]):
    token, slot = np.nonzero(experts_np == e)
    if not len(token):
      continue
    h = jax.nn.silu(x[token] @ params['gate'][e]) * (x[token] @ params['up'][e])
    out = out.at[token].add((h @ params['down'][e]) * weights[token, slot][:, None])
  return out


def _all_experts(params, x, experts, weights):
  h = jax.nn.silu(jnp.einsum('td,edf->etf', x, params['gate'])) * jnp.einsum('td,edf->etf', x, params['up'])
  every = jnp.einsum('etf,efd->etd', h, params['down'])
  combine = jnp.sum(jax.nn.one_hot(experts, params['gate'].shape[0]) * weights[..., None], axis=1)
  return jnp.einsum('etd,te->td', every, combine)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tokens', type=int, default=4096)
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--experts', type=int, default=8)
  parser.add_argument('--top_k', type=int, default=2)
  parser.add_argument('--expert_mlp_dim', type=int, default=1024)
  parser.add_argument('--rounds', type=int, default=15)
  args = parser.parse_args()
  T, D, E, K, F = args.tokens, args.d_model, args.experts, args.top_k, args.expert_mlp_dim
  keys = jax.random.split(jax.random.key(0), 5)
  params = {'router': jax.random.normal(keys[0], (D, E)) / D ** 0.5,
            'gate': jax.random.normal(keys[1], (E, D, F)) / D ** 0.5,
            'up': jax.random.normal(keys[2], (E, D, F)) / D ** 0.5,
            'down': jax.random.normal(keys[3], (E, F, D)) / F ** 0.5}
  x = jax.random.normal(keys[4], (T, D))
  _, weights, experts = _routing(x, params, K)
  experts_np = np.asarray(experts)

  def layer(kind):
    def forward(p, x):
      _, w, ex = _routing(x, p, K)
      experts_args = (p['gate'], p['up'], p['down'])
      if kind == 'dropless':
        return moe.dropless(x, ex, w, *experts_args)
      if kind.startswith('capacity'):
        cfg = moe.MoeConfig(E, K, F, capacity_factor=float(kind.split()[1]))
        return moe.with_capacity(x, ex, w, *experts_args, cfg.capacity(T))[0]
      if kind == 'dense loop':
        return _dense_loop(p, x, experts_np, w)
      return _all_experts(p, x, ex, w)
    return jax.jit(jax.grad(lambda p, x: jnp.sum(forward(p, x) ** 2), argnums=(0, 1)))

  kinds = ['dropless', 'capacity 1.0', 'capacity 1.25', 'dense loop', 'all experts']
  fns = {kind: layer(kind) for kind in kinds}
  for fn in fns.values():
    jax.block_until_ready(fn(params, x))  # Compile, and warm.
  times = {kind: [] for kind in kinds}
  for _ in range(args.rounds):
    for kind, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(params, x))
      times[kind].append(time.perf_counter() - start)
  loads = np.bincount(experts_np.reshape(-1), minlength=E)
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}; T={T} D={D} E={E} K={K} F={F}; '
        f'tokens per expert {loads.min()}..{loads.max()}; forward + backward, median of {args.rounds}')
  reference = statistics.median(times['dense loop'])
  for kind in kinds:
    median = statistics.median(times[kind])
    print(f'| {kind} | {median * 1e3:.1f} ms | {median / reference:.2f} |')


if __name__ == '__main__':
  main()
