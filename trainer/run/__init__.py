"""The run on top of everything: the Job built once with its memory choice, its compiled step checked before step 1 (or
reported by plan mode), the loop (train, evaluate, log, save), the compilation cache, the GPU environment set before
jax loads, Python's garbage collector tuned for the start-up's traces."""
