"""Export: the built-in Llama's parameters -> a Hugging Face model folder (config.json, safetensors, tokenizer).

`export(model_config, params, output, ...)` writes what
`transformers.AutoModelForCausalLM.from_pretrained(output)` loads: config.json
(Llama, Qwen2 when the model has q/k/v biases, Qwen3 with query/key norms, Mistral when
imported as one; trainer/hf/architectures.py) with the fields `serving` adds (token ids, context length:
trainer/hf/serving.py),
the tensors in Hugging Face's names and layouts (trainer/hf/layout.py, the inverse
of the import), in files of at most `max_shard_bytes` with
model.safetensors.index.json when there is more than one, and `serving`'s files
(generation_config.json, the tokenizer's). One parameter is gathered to the host at a time, and one file's tensors are
held at most.
"""

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from trainer.base import confined
from trainer.base.errors import UserError
from trainer.hf import architectures, layout, safetensors_files, serving as serving_lib

DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16}


def export(model_config, params, output: pathlib.Path, dtype: str | None = None, max_shard_bytes: int = 5 << 30,
           serving: serving_lib.Serving | None = None) -> list[str]:
  """Writes the folder; returns the names of the safetensors files written. `dtype` None: `serving.dtype`."""
  serving = serving or serving_lib.Serving({}, None, 'float32', ())
  dtype = dtype or serving.dtype
  if dtype not in DTYPES:
    raise UserError(f'--dtype={dtype!r}: choose one of {tuple(DTYPES)}.')
  if output.exists():
    raise UserError(f'--output={str(output)!r} exists; choose a new folder (nothing is overwritten).')
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  flat = dict(layout.flatten(params))
  output.mkdir(parents=True)
  written, weight_map, current, size, total = [], {}, {}, 0, 0

  def flush():  # Under a provisional name: the count of files is known only at the end.
    written.append(output / f'part-{len(written)}.safetensors')
    confined.check_target(written[-1])  # save_file opens it itself, following a link.
    save_file(current, written[-1], metadata={'format': 'pt'})  # transformers reads only 'pt'-marked files.
    written[-1].chmod(confined.created_mode())  # save_file leaves 0600; readable like config.json, by the umask.
    weight_map.update({t: len(written) - 1 for t in current})

  for placement in layout.placements(abstract):
    value = np.asarray(jax.device_get(flat[placement.path])).astype(DTYPES[dtype])
    for name, tensor in placement.to_hf(value):
      if current and size + tensor.nbytes > max_shard_bytes:
        flush()
        current, size = {}, 0
      current[name], size, total = tensor, size + tensor.nbytes, total + tensor.nbytes
  flush()
  names = ([safetensors_files.SINGLE] if len(written) == 1 else
           [f'model-{i + 1:05d}-of-{len(written):05d}.safetensors' for i in range(len(written))])
  for path, name in zip(written, names):
    path.rename(output / name)
  if len(names) > 1:
    index = {'metadata': {'total_size': total}, 'weight_map': {t: names[i] for t, i in sorted(weight_map.items())}}
    confined.write_text(output / safetensors_files.INDEX, json.dumps(index, indent=2) + '\n')
  config = {**architectures.hf_config(model_config, dtype, serving.architecture), **serving.fields}
  confined.write_text(output / 'config.json', json.dumps(config, indent=2, sort_keys=True) + '\n')
  for path in serving.files:
    confined.copy(path, output / path.name)  # serving kept each to its folder.
  return names
