"""Decoding speed of scripts/sample.py for BENCHMARKS.md: the built-in Llama with its KV cache against the whole
window run for every token, side by side.

  python benchmarks/bench_sample.py [--seq_len=256] [--num_tokens=200] [--num_layers=4] [--d_model=256]
      [--num_heads=4] [--mlp_dim=1024] [--rounds=5]

A byte-level Llama (configs/tiny.py with these sizes) gets random float32 parameters; each round generates
`num_tokens` greedy tokens after a 4-token prompt with each path, in turn (so load on a shared machine hits both
alike), on one CPU device as sample.py runs, with the prefill included. Both paths are compiled by a first untimed
generation. Prints the
median tokens per second of each, their ratio, and whether the two generations agree (they must).
"""

import argparse
import functools
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs.tiny  # noqa: E402
from scripts import sample  # noqa: E402
from trainer.models import llama  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in [('seq_len', 256), ('num_tokens', 200), ('num_layers', 4), ('d_model', 256),
                        ('num_heads', 4), ('mlp_dim', 1024), ('rounds', 5)]:
    parser.add_argument(f'--{name}', type=int, default=default)
  args = parser.parse_args()
  config = configs.tiny.get_config()
  config.data.seq_len = args.seq_len
  for key in ('num_layers', 'd_model', 'num_heads', 'mlp_dim'):
    config.model[key] = getattr(args, key)
  model = llama.build(config)
  rng = np.random.default_rng(0)
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32)))
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.02, x.shape), x.dtype), abstract['params'])
  bind = lambda p: functools.partial(model.apply, {'params': p})
  paths = {'whole window': sample.WindowLogits(bind, params, args.seq_len),
           'kv cache': sample.CachedLogits(sample.cached_decoder(config), params, args.seq_len)}
  run = lambda next_logits: sample.generate(next_logits, list(b'def '), args.num_tokens, 0.0, 0)
  outputs = {name: run(next_logits) for name, next_logits in paths.items()}  # Compiles, untimed.
  times = {name: [] for name in paths}
  for _ in range(args.rounds):
    for name, next_logits in paths.items():
      start = time.perf_counter()
      run(next_logits)
      times[name].append(time.perf_counter() - start)
  rates = {name: args.num_tokens / statistics.median(t) for name, t in times.items()}
  print(f'{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.num_layers} layers, d_model {args.d_model}, '
        f'seq_len {args.seq_len}, {args.num_tokens} tokens, median of {args.rounds} rounds:')
  for name, rate in rates.items():
    print(f'  {name}: {rate:.1f} tokens/s')
  print(f'  kv cache / whole window: {rates["kv cache"] / rates["whole window"]:.2f}x; same tokens: '
        f'{outputs["kv cache"] == outputs["whole window"]}')


if __name__ == '__main__':
  main()
