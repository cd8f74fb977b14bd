"""The ViT classifier end to end through the launcher, on an .npz of images: accuracy in training and eval."""

import numpy as np

from conftest import read_metrics
from trainer.data.arrays import SyntheticImages


def test_vit_on_npz_images_learns_and_logs_accuracy(launcher, tmp_path):
  source = SyntheticImages((16, 16, 3), num_classes=4, seed=0, template_seed=0)
  examples = [source[i] for i in range(640)]
  images = np.stack([np.clip(e['images'] * 255, 0, 255).astype(np.uint8) for e in examples])  # uint8 like real data
  np.savez(tmp_path / 'images.npz', images=images, labels=np.array([e['labels'] for e in examples]))
  workdir = tmp_path / 'run'
  result = launcher('--config=configs/vit_tiny.py', f'--workdir={workdir}', '--config.data.source=arrays',
                    f'--config.data.path={tmp_path}/images.npz', '--config.data.image_shape=(16, 16, 3)',
                    '--config.model.num_classes=4', '--config.model.num_layers=2', '--config.model.d_model=32',
                    '--config.model.num_heads=2', '--config.model.mlp_dim=64', '--config.train.batch_size=32',
                    '--config.train.steps=40', '--config.train.warmup_steps=3', '--config.train.learning_rate=5e-3', '--config.train.eval_every_steps=20',
                    '--config.train.eval_batches=2', '--config.data.eval_percent=10', '--config.log.every_steps=20',
                    '--config.ckpt.every_steps=40')
  assert result.returncode == 0, result.stderr[-3000:]
  records = {r['step']: r for r in read_metrics(workdir)}
  first, last = records[1], records[40]
  assert last['loss'] < first['loss'] - 0.3, records
  assert {'accuracy', 'images_per_s', 'eval_loss', 'eval_accuracy'} <= set(last)
  assert 'tokens_per_s' not in last and 'eval_perplexity' not in last
  # TFLOP/s from the ViT's traced step (tests/test_flops.py checks the count); no MFU on CPU (no known peak).
  assert last['tflops_per_device'] > 0 and 'mfu' not in last
  assert f"{last['tflops_per_device']:.3g} TFLOP/s/device" in result.stderr
  assert last['eval_accuracy'] > 0.5, records  # 4 classes: chance is 0.25.
  assert 'eval_accuracy' in records[20]
