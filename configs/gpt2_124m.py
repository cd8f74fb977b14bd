"""A Llama-style decoder at GPT-2 small's size: 123.6M parameters (GPT-2 small: 124.4M).

Run, on tokens written by scripts/prepare_data.py with a GPT-2-style tokenizer
(any local tiktoken or SentencePiece file of <= 50304 tokens):

  .venv/bin/python scripts/prepare_data.py --input=TEXT_DIR --output=/data/shards --tokenizer=gpt2.tiktoken
  .venv/bin/python launch.py --config=configs/gpt2_124m.py --workdir=/tmp/gpt2_run --config.data.path=/data/shards

or without data, to measure throughput and memory:

  .venv/bin/python launch.py --config=configs/gpt2_124m.py --workdir=/tmp/gpt2_run --config.data.source=synthetic

Same shape as GPT-2 small (12 layers, d_model 768, 12 heads, 1024-token
context, tied input/output embeddings) with Llama's parts instead of GPT-2's:
RMSNorm, RoPE instead of learned positions, and a bias-free SwiGLU MLP of width
2048, whose three matrices hold what GPT-2's two 4x768-wide ones do, so the
count stays at GPT-2's. The vocabulary is GPT-2's 50257 padded to 50304, a
multiple of 64, for even shards and faster matmuls. Parameters: 38.6M in the
(tied) embedding table + 12 x 7.08M per block + 768 = 123,587,328.
Batch: 512 sequences x 1024 tokens = 0.5M tokens a step, GPT-3-small's
schedule at 6e-4; 10k steps is ~5B tokens. remat 'auto' picks the policy with the
least recomputation that fits the device, and microbatches (train.grad_accum_steps)
when none fits; `launch.py --plan` shows the choice without training.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 10_000
  c.train.batch_size = 512
  c.train.learning_rate = 6e-4
  c.train.warmup_steps = 700
  c.train.remat_policy = 'auto'
  c.train.eval_every_steps = 500
  c.train.eval_batches = 20
  c.data.source = 'array_record'  # Token shards from scripts/prepare_data.py in data.path; or 'synthetic'.
  c.data.seq_len = 1024
  c.model.num_layers = 12
  c.model.d_model = 768
  c.model.num_heads = 12
  c.model.mlp_dim = 2048
  c.model.vocab_size = 50304
  c.model.tie_embeddings = True
  c.ckpt.every_steps = 1000
  c.log.every_steps = 50
  return c
