"""A mixture-of-experts decoder of about 1B parameters (0.96B), 0.36B of them active per token: 8 experts, top-2.

Mixtral-shaped (every layer MoE, softmax-then-top-2 routing, no shared expert) at
the width of OLMoE's small models: 16 layers, d_model 1024, 16 query heads
sharing 8 key/value heads, 8 SwiGLU experts of width 2048 per layer, vocabulary
50304 (GPT-2's, padded), untied head. Parameters: 103M in the embedding table
and head + 16 x 53.5M per block (50.3M of it experts); a token runs 2 of the 8
experts, so 6N and MFU count 0.30B non-embedding parameters (trainer/observe/flops.py).

Dropless routing on grouped matmuls (model.expert_capacity_factor None); set it to
1.25 for capacity mode. Experts split over the expert mesh axis, which splits
the batch too:

  .venv/bin/python launch.py --config=configs/moe_1b.py --workdir=/tmp/moe_1b --config.data.path=/data/shards \\
      --config.mesh.expert=8 --config.mesh.data=-1

or --config.data.source=synthetic to measure throughput; check the fit first with
`launch.py --config=configs/moe_1b.py --plan --plan_memory_gb=...` (or
--topology=v5p:8 / h100:8 with the optional plan requirements), which proposes a
larger mesh.expert when the experts do not fit. Batch: 256 x 2048 = 0.5M tokens a step.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.train.steps = 20_000
  c.train.batch_size = 256
  c.train.learning_rate = 4e-4
  c.train.warmup_steps = 2000
  c.train.eval_every_steps = 1000
  c.train.eval_batches = 20
  c.train.remat_policy = 'auto'
  c.data.source = 'array_record'  # Token shards from scripts/prepare_data.py in data.path; or 'synthetic'.
  c.data.seq_len = 2048
  c.model.num_layers = 16
  c.model.d_model = 1024
  c.model.num_heads = 16
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 2048  # Unused by MoE layers (every layer is one); expert_mlp_dim sizes the experts.
  c.model.vocab_size = 50304
  c.model.num_experts = 8
  c.model.experts_per_token = 2
  c.model.moe_layers = 'all'
  c.model.expert_mlp_dim = 2048
  c.model.router_aux_loss_weight = 0.01
  c.model.router_z_loss_weight = 0.001
  c.ckpt.every_steps = 1000
  c.log.every_steps = 50
  return c
