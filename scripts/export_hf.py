"""Write a run's newest checkpoint as a Hugging Face model folder that transformers and vLLM load.

  python scripts/export_hf.py --workdir=DIR --output=OUT [--step=latest] [--dtype=float32] [--max_shard_gb=5]
      [--params=raw|ema]

Reads the run's config from WORKDIR/config.json, restores the parameters of the
newest intact checkpoint (or --step) onto one CPU device (or, with --params=ema,
their moving average: train.ema_decay), and writes OUT/config.json
(LlamaForCausalLM, or Qwen2ForCausalLM for a model with q/k/v biases) and the
weights as safetensors, split into files of at most --max_shard_gb with
model.safetensors.index.json when larger. The tokenizer files travel along: those
scripts/prepare_data.py kept with the run's data (DATA/tokenizer/), else those of the
model.init_from folder the run started from. Then:

  transformers.AutoModelForCausalLM.from_pretrained(OUT)

and `--config.model.init_from=hf:OUT` imports it back, bit for bit (tests/test_hf_export.py).
Only the built-in Llama (model.name='llama') exports.
"""

import argparse
import os
import pathlib
import sys

from absl import logging

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # Restored onto one CPU device; don't claim an accelerator.

# Copied beside the weights when the run's tokenizer folder has them (generation_config.json: the imported model's).
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'tokenizer.model',
                   'generation_config.json', 'chat_template.jinja')


def tokenizer_files(config) -> tuple[pathlib.Path, ...]:
  """The tokenizer files to copy: the prepared data's, else the imported model folder's."""
  from trainer.hf import tokenizer as hf_tokenizer
  folder = hf_tokenizer.run_folder(config)
  return () if folder is None else tuple(folder / n for n in TOKENIZER_FILES if (folder / n).is_file())


def export(workdir: str, output: str, step: str = 'latest', dtype: str = 'float32', max_shard_gb: float = 5.0,
           params: str = 'raw'):
  """Writes `output`; returns (the checkpoint step exported, the file names written)."""
  from scripts import sample

  from trainer import storage
  from trainer.errors import UserError
  from trainer.hf import save
  run = storage.path(workdir)
  config = sample.load_run_config(run)
  if config.model.name != 'llama':
    raise UserError(f"--workdir={workdir!r} trained model.name={config.model.name!r}; only the built-in Llama "
                    f"(model.name='llama') exports to a Hugging Face folder.")
  out = pathlib.Path(output)
  if out.exists():
    raise UserError(f'--output={output!r} exists; choose a new folder (nothing is overwritten).')
  restored, _, weights = sample.restore_model(config, run, step, params)
  names = save.export(config.model, weights, out, dtype, int(max_shard_gb * (1 << 30)), tokenizer_files(config))
  logging.info('Exported step %d of %s to %s (%s)', restored, workdir, out, ', '.join(names))
  return restored, names


def main(argv=None):
  # argparse, not absl flags: this module imports scripts/sample.py, whose absl flags share these names.
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--workdir', required=True, help='the run folder (or gs:// URL): config.json and checkpoints/')
  parser.add_argument('--output', required=True, help='local folder to create for the model (must not exist)')
  parser.add_argument('--step', default='latest', help="checkpoint step to export, or 'latest' (newest intact)")
  parser.add_argument('--dtype', default='float32', help="written weights: 'float32', 'bfloat16' or 'float16'")
  parser.add_argument('--max_shard_gb', type=float, default=5.0, help='largest safetensors file, in GiB')
  parser.add_argument('--params', default='raw', choices=('raw', 'ema'),
                      help="'raw': the parameters as trained; 'ema': their moving average (train.ema_decay > 0)")
  args = parser.parse_args(argv)
  from trainer import console
  from trainer.errors import UserError
  console.quiet_library_info()
  try:
    step, names = export(args.workdir, args.output, args.step, args.dtype, args.max_shard_gb, args.params)
  except UserError as e:
    sys.exit(f'export_hf.py: error: {e}')
  print(f'wrote {args.output}: config.json, {", ".join(names)} (step {step})')


if __name__ == '__main__':
  main()
