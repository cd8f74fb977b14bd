"""Python's cyclic garbage collector in a launch: young-generation passes 70x rarer, and what the imports built left
out of every pass.

Tracing a model (its init, train step and eval step) makes and drops a great many small Python objects: jaxpr
equations, tracers, avals. CPython starts a collection every 700 net allocations, and each pass walks the young
objects and, one pass in a hundred, every object the process holds, jax's and flax's modules included. A launch of
configs/tiny.py ran 596 collections, 0.41 s of its 4.43 s of CPU. With the threshold raised to 50,000 allocations and
the imports frozen: 39 collections, 0.10 s, and the launch took 3.66 s, more saved than the collections' own CPU,
measured and not explained (medians of 9 alternated rounds, benchmarks/bench_launch_gc.py; BENCHMARKS.md "A launch's
garbage collector").

Cycles still die, later: a pass starts after 50,000 net allocations instead of 700. What the freeze keeps is what
was imported, which lives as long as the process anyway.
"""

import gc

THRESHOLD = (50_000, 20, 100)  # CPython's default is (700, 10, 10).


def tune() -> None:
  """Fewer collections from here on: called before anything heavy is imported."""
  gc.set_threshold(*THRESHOLD)


def freeze_imports() -> None:
  """What exists now (the imported modules: jax, flax, optax, the trainer) moves to a generation no pass walks."""
  gc.freeze()
