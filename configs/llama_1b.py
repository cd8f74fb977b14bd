"""A decoder at Llama 3.2 1B's size: 1,235,814,400 parameters (1.24B), grouped-query attention, tied embeddings.

Run, on tokens written by scripts/prepare_data.py with Llama 3's tokenizer
(Meta's `tokenizer.model` is a tiktoken BPE file: copy it to a `.tiktoken` name):

  .venv/bin/python scripts/prepare_data.py --input=TEXT_DIR --output=/data/shards --tokenizer=llama3.tiktoken
  .venv/bin/python launch.py --config=configs/llama_1b.py --workdir=/tmp/llama_1b --config.data.path=/data/shards \\
      --config.mesh.fsdp=-1 --config.mesh.data=1

or with --config.data.source=synthetic to measure throughput and memory; check
the fit first with `launch.py --plan --plan_memory_gb=...`.

Llama 3.2 1B's shape: 16 layers, d_model 2048, 32 query heads sharing 8
key/value heads (head dim 64), SwiGLU width 8192, vocabulary 128256, RoPE base
wavelength 500000, and the output head tied to the embedding table. Parameters:
262.7M in the table + 16 x 60.8M per block + 2048. Training here is at 2048
tokens of context (Llama 3.2 was pretrained at 8192) with Adam's first moment
stored in bfloat16: float32 parameters, gradients and second moment plus the
bfloat16 first moment are 14 bytes a parameter, ~17 GB before sharding over
fsdp. remat 'auto' picks the policy with the least recomputation that fits the
device (on one H100 at batch 16: 'full' 37.7 GiB, 'save_qkv_proj' 40.7 GiB,
'dots_with_no_batch_dims_saveable' 58.1 GiB), and raises train.grad_accum_steps
when none fits. Batch: 256 x 2048 = 0.5M tokens a step.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 20_000
  c.train.batch_size = 256
  c.train.learning_rate = 3e-4
  c.train.warmup_steps = 2000
  c.train.eval_every_steps = 1000
  c.train.eval_batches = 20
  c.train.adam_mu_dtype = 'bfloat16'
  c.train.remat_policy = 'auto'
  c.data.source = 'array_record'  # Token shards from scripts/prepare_data.py in data.path; or 'synthetic'.
  c.data.seq_len = 2048
  c.model.num_layers = 16
  c.model.d_model = 2048
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 8192
  c.model.vocab_size = 128256
  c.model.rope_max_wavelength = 500_000
  c.model.tie_embeddings = True
  c.ckpt.every_steps = 1000
  c.log.every_steps = 50
  return c
