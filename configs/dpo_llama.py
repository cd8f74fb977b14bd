"""Preference-tune (DPO) a published or fine-tuned Llama, Qwen2 or Mistral on chosen/rejected pairs (docs/dpo.md).

The reference is the starting weights (model.init_from), kept frozen in memory beside the trained copy:

  # 1. Tokenize the pairs with the model's own tokenizer and chat template
  #    (one {"prompt": ..., "chosen": ..., "rejected": ...} a line; strings or message lists):
  .venv/bin/python scripts/prepare_data.py --input=pairs.jsonl --output=/data/pairs --tokenizer=/models/sft-out
  # 2. DPO from those weights (an SFT run of this launcher: export it first with scripts/export_hf.py):
  .venv/bin/python launch.py --config=configs/dpo_llama.py --workdir=/runs/dpo \\
      --config.model.init_from=hf:/models/sft-out --config.data.path=/data/pairs
  # 3. Export as any run: scripts/export_hf.py --workdir=/runs/dpo --output=/models/dpo-out

A pair is two attention segments of a row (prompt + chosen, prompt + rejected), so data.seq_len must hold both; a
longer pair is refused with the length that fits. data.packing (finetune_llama's) puts as many whole pairs in a
row as fit. Size it first with --plan: the frozen reference adds one
copy of the parameters (no gradients, no optimizer state). On a tiny model the reward margin and accuracy rise
within 40 steps (tests/test_dpo.py).
"""

from configs import finetune_llama


def get_config():
  c = finetune_llama.get_config()  # Its data source, schedule, remat, checkpoints and logging.
  c.train.objective = 'dpo'
  c.train.dpo_beta = 0.1  # TRL's default.
  c.data.seq_len = 2048  # Whole pairs a row: prompt + chosen and prompt + rejected side by side.
  c.train.learning_rate = 5e-7  # DPO's usual step: much smaller than SFT's.
  return c
