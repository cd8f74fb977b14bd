"""ViT-B/16 on 224x224x3 images with 1000 classes (ImageNet-1k sized): 86,566,120 parameters.

Run (an accelerator; on CPU this is far too slow):
  .venv/bin/python launch.py --config=configs/vit_base.py --workdir=/tmp/vit_base_run --config.data.path=/data/imagenet224

12 pre-LayerNorm blocks of width 768 (12 heads, MLP 3072) over 16x16 patches (196 per image), global average
pooling and a linear head. `data.path` is an .npz file holding `images` (N, 224, 224, 3), uint8 (scaled to [0, 1]
on read) or float, and `labels` (N,) integers in [0, 1000); or, for a set too big for memory, a folder holding
`images.npy` and `labels.npy`, which are memory-mapped. One way to write the folder form:

  images = np.lib.format.open_memmap('/data/imagenet224/images.npy', 'w+', np.uint8, (n, 224, 224, 3))
  for i, (image, label) in enumerate(decoded_and_resized_examples):  # e.g. PIL: resize to 224x224, RGB
    images[i], labels[i] = image, label
  images.flush(); np.save('/data/imagenet224/labels.npy', labels.astype(np.int32))

(a small set fits one file: `np.savez('set.npz', images=images_uint8, labels=labels)`). data.eval_percent of
the rows are held out for the accuracy eval. Try the pipeline without data first with
`--config.data.source=synthetic`.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.train.steps = 100_000
  c.train.batch_size = 1024
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 10_000
  c.train.weight_decay = 0.05
  c.train.adam_b2 = 0.999
  c.train.eval_every_steps = 2_000
  c.train.eval_batches = 16
  c.data.source = 'arrays'
  c.data.image_shape = (224, 224, 3)
  c.data.eval_percent = 2
  c.model.name = 'vit'
  c.model.task = 'classifier'
  c.model.num_layers = 12
  c.model.d_model = 768
  c.model.num_heads = 12
  c.model.mlp_dim = 3072
  c.model.num_classes = 1000
  c.model.patch_size = 16
  c.ckpt.every_steps = 2_000
  c.log.every_steps = 100
  return c
