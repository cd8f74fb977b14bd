"""Hugging Face checkpoints in and out of the built-in Llama (issue 26; docs/hf.md).

One entry point per direction:
- in: `load.configure(config)` (config.json -> model.* keys, before the Job is built) and
  `load.load_params(...)` (safetensors -> the run's sharded parameters, on a fresh start);
- out: `save.export(...)` (a checkpoint's parameters -> config.json and safetensors), used by
  scripts/export_hf.py.
`architectures.py` maps the configs, `layout.py` the tensors, `safetensors_files.py` reads slices.
"""
