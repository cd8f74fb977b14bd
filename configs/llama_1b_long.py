"""llama_1b (configs/llama_1b.py) at 131,072 tokens a row, each row split over 8 devices of `mesh.context`, with
nothing rematerialized.

What the split buys at this length is memory for the fastest step: planned for v5p:2x2x8 (32 chips, libtpu; the
numbers in BENCHMARKS.md "Long sequences"), fsdp=4 x context=8 keeps every activation (remat 'none') in 55.55 GiB
of a chip's 95, while the same slice without the axis, fsdp=4 x tensor=8 (heads split, whole rows), is refused by
the compiler (over 114 GiB of temporaries); one whole row a chip (v5p:2x2x1) is refused even keeping only the
matmul outputs (remat 'dots_saveable': over 164 GiB). With the chunked loss and remat 'full', a whole row of this
model does fit one chip (23.78 GiB on v5p:2x2x1), recomputing the forward pass in every backward one: on fewer
chips, add --config.train.remat_policy=full and a smaller mesh.context.

  .venv/bin/python launch.py --config=configs/llama_1b_long.py --plan --topology=v5p:2x2x8 --config.data.source=synthetic \
      --config.data.packing=False    # needs requirements-tpu-plan.txt; fits: 55.55 GiB of 95 per chip
  .venv/bin/python launch.py --config=configs/llama_1b_long.py --workdir=/tmp/llama_1b_long --config.data.path=/data/shards

Batch: 4 x 131,072 = 0.5M tokens a step, as llama_1b's 256 x 2048.
"""

from configs import llama_1b


def get_config():
  c = llama_1b.get_config()
  c.data.seq_len = 131_072
  c.data.packing = True  # Documents shorter than a row are packed, never attending across each other.
  c.data.max_documents_per_row = 256
  c.train.batch_size = 4
  c.train.remat_policy = 'none'  # Fits only because each chip holds an eighth of a row (see above).
  c.train.loss_chunks = 16  # A chip's 16,384 tokens x 128,256 float32 logits: 7.8 GiB whole, and their gradient.
  c.mesh.data = 1
  c.mesh.fsdp = 4
  c.mesh.context = 8
  return c
