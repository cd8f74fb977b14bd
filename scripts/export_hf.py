"""Write a run's newest checkpoint as a Hugging Face model folder that transformers and vLLM load.

  .venv/bin/python scripts/export_hf.py --workdir=DIR --output=OUT [--step=latest] [--dtype=bfloat16]
      [--max_shard_gb=5] [--params=raw|ema] [--lora=merge|peft]

Reads the run's config from WORKDIR/config.json, restores the parameters of the
newest intact checkpoint (or --step) onto one CPU device (or, with --params=ema,
their moving average: train.ema_decay), and writes OUT/config.json
(LlamaForCausalLM, Qwen2ForCausalLM for a model with q/k/v biases, Qwen3ForCausalLM
with query/key norms, MistralForCausalLM when imported as one) and the weights as
safetensors (in the imported checkpoint's dtype unless --dtype says; float32 for a
model trained from scratch), split into files of at most --max_shard_gb with
model.safetensors.index.json when larger. A run imported from a Hugging Face folder
keeps its special token ids, context length and RoPE scaling, and its
generation_config.json and tokenizer files travel along (the tokenizer's: else those
scripts/prepare_data.py kept with the data); a run trained from scratch takes its
token ids from the data's tokenizer (trainer/hf/serving.py). Then:

  transformers.AutoModelForCausalLM.from_pretrained(OUT)

and `--config.model.init_from=hf:OUT` imports it back, bit for bit (tests/test_hf_export.py).
Only the built-in Llama (model.name='llama') exports.

A LoRA run (model.lora_rank > 0, docs/lora.md): --lora=merge (the default) folds the adapters into the weights, a
plain folder like any other; --lora=peft writes the frozen base weights to OUT and the adapters to OUT/adapter/
(adapter_config.json, adapter_model.safetensors) for `peft.PeftModel.from_pretrained(base, OUT/adapter)`.
"""

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from trainer.safety import startup_signals  # noqa: E402  (first: a signal in any phase is one line, 128 + it)
if __name__ == '__main__':  # Not in a test that imports it.
  startup_signals.install_for_tool('export_hf.py')
from trainer.base import interpreter  # noqa: E402
interpreter.require_packages('export_hf.py')
from absl import logging  # noqa: E402
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # Restored onto one CPU device; don't claim an accelerator.


LORA_MODES = ('merge', 'peft')
ADAPTER = 'adapter'  # --lora=peft: the PEFT adapter folder's name inside --output.


def export(workdir: str, output: str, step: str = 'latest', dtype: str | None = None, max_shard_gb: float = 5.0,
           params: str = 'raw', lora_mode: str = 'merge'):
  """Writes `output`; returns (the checkpoint step exported, the file names written)."""
  from scripts import sample

  from trainer.base import storage
  from trainer.base.errors import UserError
  from trainer.hf import peft_adapter, save, serving
  from trainer.models import lora
  from trainer.safety import tool_outputs
  tool_outputs.refuse_existing('--output', output)  # Before the restore: a link or an existing folder in a second.
  run = storage.path(workdir)
  config = sample.load_run_config(run)
  if config.model.name != 'llama':
    raise UserError(f"--workdir={workdir!r} trained model.name={config.model.name!r}; only the built-in Llama "
                    f"(model.name='llama') exports to a Hugging Face folder.")
  if lora_mode not in LORA_MODES:
    raise UserError(f'--lora={lora_mode!r}: choose one of {", ".join(LORA_MODES)}.')
  adapted = lora.enabled(config.model)
  if lora_mode == 'peft' and not adapted:
    raise UserError(f'--lora=peft: --workdir={workdir!r} trained no adapters (model.lora_rank=0); export it without '
                    f'--lora.')
  restored, _, weights = sample.restore_model(config, run, step, params)
  with tool_outputs.written_whole(output) as partial:  # Renamed to --output once every file is written.
    model_weights = (lora.merge(weights, config.model) if lora_mode == 'merge' else lora.base(weights)) if adapted \
        else weights
    names = save.export(config.model, model_weights, pathlib.Path(partial), dtype, int(max_shard_gb * (1 << 30)),
                        serving.of_run(config))
    if adapted and lora_mode == 'peft':
      base_path = str(pathlib.Path(output).resolve())
      names += [f'{ADAPTER}/{n}' for n in peft_adapter.write(config.model, weights, pathlib.Path(partial) / ADAPTER,
                                                               base_path)]
  logging.info('Exported step %d of %s to %s: %s', restored, workdir, output, ', '.join(written(output)))
  return restored, names


def written(output: str) -> list[str]:
  """Every file of the export, as the user will find them (config.json, the weights, the index, the tokenizer's,
  generation_config.json): what the closing line lists."""
  return sorted(p.name for p in pathlib.Path(output).iterdir())


def main(argv=None):
  # argparse, not absl flags: this module imports scripts/sample.py, whose absl flags share these names.
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--workdir', required=True, help='the run folder (or gs:// URL): config.json and checkpoints/')
  parser.add_argument('--output', required=True, help='local folder to create for the model (must not exist)')
  parser.add_argument('--step', default='latest', help="checkpoint step to export, or 'latest' (newest intact)")
  parser.add_argument('--dtype', default=None, help="written weights: 'float32', 'bfloat16' or 'float16'; default: "
                      "the imported checkpoint's (float32 for a model trained from scratch)")
  parser.add_argument('--max_shard_gb', type=float, default=5.0, help='largest safetensors file, in GiB')
  parser.add_argument('--params', default='raw', choices=('raw', 'ema'),
                      help="'raw': the parameters as trained; 'ema': their moving average (train.ema_decay > 0)")
  parser.add_argument('--lora', default='merge', choices=LORA_MODES,
                      help="a LoRA run: 'merge' the adapters into the weights, or write the base and a 'peft' adapter "
                      "folder (OUT/adapter)")
  args = parser.parse_args(argv)
  from trainer.observe import console
  from trainer.base.errors import UserError
  from parallel import platforms
  platforms.skip_absent_tpu()  # No libtpu start-up lines where no TPU chip is (parallel/platforms.py).
  console.quiet_library_info()
  try:
    step, _ = export(args.workdir, args.output, args.step, args.dtype, args.max_shard_gb, args.params, args.lora)
  except UserError as e:
    print(f'export_hf.py: error: {" ".join(str(e).split())}', file=sys.stderr)
    sys.exit(2)
  print(f'wrote {args.output} (step {step}): {", ".join(written(args.output))}')


if __name__ == '__main__':
  main()
