"""A seconds-long config for tests and smoke checks: the default job, shrunk.

Run:
  .venv/bin/python launch.py --config=configs/tiny.py --workdir=/tmp/tiny_run
"""

from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 8
  c.train.batch_size = 8
  c.train.warmup_steps = 2
  c.train.eval_every_steps = 0
  c.train.eval_batches = 2
  c.data.seq_len = 32
  c.model.num_layers = 2
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.mlp_dim = 64
  # The default job unrolls its 2 layers ('auto'); tests run the scanned path every deep preset takes.
  c.model.scan_layers = True
  c.ckpt.every_steps = 4
  c.log.every_steps = 2
  return c
