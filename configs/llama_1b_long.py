"""llama_1b (configs/llama_1b.py) at 131,072 tokens a row, each row split over 4 devices of `mesh.context`.

One row of 128k tokens of llama_1b (its loss unchunked) does not fit one v5p chip whatever the rematerialization
(the compiler asks 116.77 GiB of temporaries at remat 'full', over 95.73 GiB of HBM): the sequence is split instead
(docs/context.md). Whole rows with this preset's chunked loss were planned at 32k and 64k tokens only (10.56 and
13.90 GiB a chip, against 6.99 and 8.15 GiB at context=4); at 128k that is not measured. On a
v5p:2x2x4 slice (16 chips), fsdp=4 x context=4 holds 4 rows a step, each chip a quarter of one row:

  python launch.py --config=configs/llama_1b_long.py --plan --topology=v5p:2x2x4 --config.data.source=synthetic \
      --config.data.packing=False    # needs requirements-tpu-plan.txt; fits: 11.93 GiB of 95 per chip
  python launch.py --config=configs/llama_1b_long.py --workdir=/tmp/llama_1b_long --config.data.path=/data/shards

Without the split a chip holds at least one whole row (116.77 GiB of temporaries, refused, at remat 'full' for
llama_1b on v5p:2x2x1 with its loss unchunked; BENCHMARKS.md "Long sequences"). Batch: 4 x 131,072 =
0.5M tokens a step, as llama_1b's 256 x 2048.
"""

from configs import llama_1b


def get_config():
  c = llama_1b.get_config()
  c.data.seq_len = 131_072
  c.data.packing = True  # Documents shorter than a row are packed, never attending across each other.
  c.data.max_documents_per_row = 256
  c.train.batch_size = 4
  c.train.remat_policy = 'full'
  c.train.loss_chunks = 16  # (4 rows x 32k tokens a chip) x 128,256 float32 logits would be 64 GiB whole.
  c.mesh.data = 1
  c.mesh.fsdp = 4
  c.mesh.context = 4
  return c
