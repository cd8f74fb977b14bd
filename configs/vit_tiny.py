"""A CPU-sized ViT classifier on synthetic 32x32x3 images: for tests and a minutes-long run with no dataset.

Run:
  .venv/bin/python launch.py --config=configs/vit_tiny.py --workdir=/tmp/vit_tiny_run

6 pre-LayerNorm blocks of width 128 (4 heads, MLP 512) over 4x4 patches (64 per image), 10 classes:
1,205,642 parameters. `data.source='synthetic'` draws each image as a class template (a coarse grid of colours)
plus noise (trainer/data/arrays.py: SyntheticImages), so the loss falls from log(10) = 2.30. Measured with a
hand-written loop of the same model, optimizer and schedule on a shared 2-core CPU: ~0.9 s a step, loss 0.23 by
step 90 and 99.6% held-out accuracy at step 100 (chance is 10%), so the 200 steps take about 3 minutes.
Point it at real images with
`--config.data.source=arrays --config.data.path=my_images.npz` (uint8 or float images of shape 32x32x3, integer
labels in [0, 10)).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.train.steps = 200
  c.train.batch_size = 64
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 30
  c.train.weight_decay = 0.05
  c.train.eval_every_steps = 50
  c.train.eval_batches = 4
  c.data.source = 'synthetic'
  c.data.image_shape = (32, 32, 3)
  c.model.name = 'vit'
  c.model.task = 'classifier'
  c.model.num_layers = 6
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.mlp_dim = 512
  c.model.num_classes = 10
  c.model.patch_size = 4
  c.ckpt.every_steps = 100
  c.log.every_steps = 25
  return c
