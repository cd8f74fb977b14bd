"""Fine-tune a published Llama, Qwen2 or Mistral on prompt/completion pairs; the loss counts completions only.

The whole sequence, from a downloaded Hugging Face folder to an exported one (e.g. Llama-3.2-1B-Instruct:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json; nothing is downloaded here):

  # 1. Tokenize the pairs with the model's own tokenizer (one {"prompt": ..., "completion": ...} a line):
  .venv/bin/python scripts/prepare_data.py --input=train.jsonl --output=/data/sft --tokenizer=/models/Llama-3.2-1B-Instruct
  # 2. Fine-tune from the published weights (config.json sets the model; a resumed run keeps its own weights):
  .venv/bin/python launch.py --config=configs/finetune_llama.py --workdir=/runs/sft \\
      --config.model.init_from=hf:/models/Llama-3.2-1B-Instruct --config.data.path=/data/sft
  # 3. Export the newest checkpoint as a Hugging Face folder (config.json, safetensors, the tokenizer files):
  .venv/bin/python scripts/export_hf.py --workdir=/runs/sft --output=/models/sft-out
  # 4. Sample from the run (or load /models/sft-out with transformers or vLLM):
  .venv/bin/python scripts/sample.py --workdir=/runs/sft --prompt='Question: name a colour. Answer:' --temperature=0

Size it first with `launch.py --config=configs/finetune_llama.py --config.model.init_from=hf:... --plan`
(reads config.json only). Each packed row holds several examples; attention and the loss never cross them, and
the prompt tokens feed attention without counting in the loss: the log's trained_tokens counts those that do.
On the tiny test model (tests/fixtures/hf) the completion loss falls within 20 steps (tests/test_finetune.py).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.data.source = 'array_record'  # Shards of scripts/prepare_data.py --input=*.jsonl, with their loss mask.
  c.data.loss_mask = True
  c.data.packing = True
  c.data.seq_len = 1024
  c.data.eval_percent = 5
  c.train.steps = 1000
  c.train.batch_size = 32
  c.train.learning_rate = 2e-5  # Fine-tuning: a small step from the published weights.
  c.train.warmup_steps = 50
  c.train.weight_decay = 0.0
  c.train.eval_every_steps = 200
  c.train.remat_policy = 'auto'
  c.ckpt.every_steps = 200
  c.log.every_steps = 10
  return c
