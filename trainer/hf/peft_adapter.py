"""A LoRA run's adapters as a PEFT adapter folder: adapter_config.json and adapter_model.safetensors.

`peft.PeftModel.from_pretrained(base, folder)` loads it over the base model that scripts/export_hf.py --lora=peft
writes beside it (the frozen base weights, a plain Hugging Face folder). The tensor names are PEFT's for a
LlamaForCausalLM: 'base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight' (rank, in features) and
'...lora_B.weight' (out features, rank), in Hugging Face's (out, in) orientation of the layer's weight, which
trainer/hf/layout.py places; PEFT scales lora_B @ lora_A by lora_alpha / r, as Qwix does a @ b (trainer/models/lora.py).
"""

import json
import pathlib

import jax
import numpy as np
from safetensors.numpy import save_file

from trainer.base import confined
from trainer.hf import layout
from trainer.models import lora

CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'


def write(model_config, params, folder: pathlib.Path, base_path: str) -> list[str]:
  """Writes `folder` (created here) from the run's parameters (adapters included); returns the names written."""
  base = lora.base(params)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), base)
  by_path = {p.path: p for p in layout.placements(abstract)}
  tensors = lora.peft_tensors(jax.tree.map(np.asarray, params), by_path)
  folder.mkdir()
  confined.check_target(folder / WEIGHTS)  # save_file opens it itself, following a link.
  save_file(tensors, folder / WEIGHTS, metadata={'format': 'pt'})
  (folder / WEIGHTS).chmod(confined.created_mode())
  confined.write_text(folder / CONFIG, json.dumps(lora.peft_config(model_config, base_path), indent=2) + '\n')
  return [CONFIG, WEIGHTS]
