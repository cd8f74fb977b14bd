"""The real train step of a long-row config compiled for a TPU slice (plan mode, libtpu) with rows split over
`mesh.context`: it compiles, runs splash per chunk, and needs far less per-chip temporary memory than the same
global shape without the split."""

import importlib.util

import pytest

from configs import tiny
from trainer.run import plan


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_context_four_needs_at_most_0_4x_the_temporaries_of_whole_rows_on_v5p():
  """4 rows x 16,384 tokens a step (one global shape) planned three ways on v5p:
  - fsdp=4 on v5p:2x2x1 (4 chips): context=1, each chip holds one whole row (the issue's baseline: adding chips on
    data or fsdp would not shrink a row);
  - fsdp=4 x tensor=4 on v5p:2x2x4 (16 chips): context=1 on the same slice, heads and mlp split 4 ways but every
    token of a row on each chip;
  - fsdp=4 x context=4 on v5p:2x2x4: each chip holds a quarter of a row.

  Measured (libtpu 0.0.51, 2026-11-25): context=4 needs 279,281,664 bytes against 800,456,704 with whole rows on 4
  chips (0.35x: issue 27's goal is at most 0.4x) and 456,736,768 with tensor=4 (0.61x). Against tensor=4, which
  also divides each row's attention work, 0.4x is not reached at this one-layer width: each chip holds the gathered
  keys/values of the whole row and their float32 gradients (splash's dk/dv per chunk) next to activations that are a
  quarter of a row; that bound is the measured one, to catch regressions."""
  config = tiny.get_config()
  config.data.seq_len, config.train.batch_size = 16_384, 4
  # llama_1b's proportions at a sixteenth of its width: heads of 64, 4 query heads per key/value head, mlp 4 x d.
  config.model.update(num_layers=1, d_model=1024, num_heads=16, num_kv_heads=4, mlp_dim=4096)
  temp_bytes = {}
  for name, topology, context, tensor in (('context4', 'v5p:2x2x4', 4, 1), ('tensor4', 'v5p:2x2x4', 1, 4),
                                          ('whole_rows', 'v5p:2x2x1', 1, 1)):
    config.mesh.data, config.mesh.fsdp, config.mesh.context, config.mesh.tensor = 1, 4, context, tensor
    lines = []
    temp_bytes[name] = plan.run(config, topology=topology, print_fn=lines.append).temp_bytes
    if context == 4:
      assert 'splash per chunk of 2048 tokens' in '\n'.join(lines)
  print(temp_bytes)
  assert temp_bytes['context4'] <= 0.4 * temp_bytes['whole_rows']
  assert temp_bytes['context4'] <= 0.65 * temp_bytes['tensor4']
