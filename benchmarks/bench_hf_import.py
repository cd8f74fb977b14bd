"""Host memory of a Hugging Face import: each process's peak RSS against the checkpoint's bytes.

  python benchmarks/bench_hf_import.py --model=/tmp/llama1b [--num_processes=2] [--devices_per_process=4]

Writes (once; kept for reruns, never committed) a randomly drawn float32 Llama of Llama 3.2 1B's shape
(configs/llama_1b.py: 1.24B parameters, tied embeddings, 4.9 GB) as sharded safetensors plus its config.json,
then starts `--num_processes` processes of `--devices_per_process` fake CPU devices each, joined by
jax.distributed. Each builds the Job of a fully sharded run (mesh fsdp = every device) with
`model.init_from=hf:MODEL`, imports the weights (trainer/hf/load.py: every process reads only the slices its
devices hold) and reports its peak resident memory (VmHWM) and the parameter bytes its devices hold. The goal
(issue 26): each process's peak under 0.75x the checkpoint's bytes, near half with 2 processes.
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPE = dict(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, mlp_dim=8192, vocab_size=128256)


def write_model(folder: pathlib.Path, max_file_bytes: int = 1 << 30) -> int:
  """A random float32 Llama 3.2 1B in safetensors files of ~1 GiB; returns the weights' bytes."""
  from safetensors.numpy import save_file
  s, rng = SHAPE, np.random.default_rng(0)
  d, k = s['d_model'], s['d_model'] // s['num_heads']
  shapes = {'model.embed_tokens.weight': (s['vocab_size'], d), 'model.norm.weight': (d,)}
  for i in range(s['num_layers']):
    p = f'model.layers.{i}.'
    shapes.update({p + 'self_attn.q_proj.weight': (d, d), p + 'self_attn.k_proj.weight': (s['num_kv_heads'] * k, d),
                   p + 'self_attn.v_proj.weight': (s['num_kv_heads'] * k, d), p + 'self_attn.o_proj.weight': (d, d),
                   p + 'mlp.gate_proj.weight': (s['mlp_dim'], d), p + 'mlp.up_proj.weight': (s['mlp_dim'], d),
                   p + 'mlp.down_proj.weight': (d, s['mlp_dim']), p + 'input_layernorm.weight': (d,),
                   p + 'post_attention_layernorm.weight': (d,)})
  folder.mkdir(parents=True)
  files, current, size = [], {}, 0
  for name, shape in shapes.items():
    current[name] = rng.standard_normal(shape, np.float32) * 0.02
    size += current[name].nbytes
    if size >= max_file_bytes:
      files.append(current)
      current, size = {}, 0
  files.append(current) if current else None
  weight_map, total = {}, 0
  for i, tensors in enumerate(files):
    name = f'model-{i + 1:05d}-of-{len(files):05d}.safetensors'
    save_file(tensors, folder / name, metadata={'format': 'pt'})
    weight_map.update({t: name for t in tensors})
    total += sum(t.nbytes for t in tensors.values())
  (folder / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {'total_size': total},
                                                                   'weight_map': weight_map}))
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': d,
            'num_hidden_layers': s['num_layers'], 'num_attention_heads': s['num_heads'],
            'num_key_value_heads': s['num_kv_heads'], 'intermediate_size': s['mlp_dim'],
            'vocab_size': s['vocab_size'], 'rms_norm_eps': 1e-5, 'rope_theta': 500000.0, 'tie_word_embeddings': True,
            'hidden_act': 'silu', 'torch_dtype': 'float32'}
  (folder / 'config.json').write_text(json.dumps(config, indent=2))
  return total


def _status_bytes(field: str) -> int:
  status = pathlib.Path('/proc/self/status').read_text()
  return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ':'))) * 1024


def child(model: str, process_id: int, num_processes: int, port: int) -> None:
  """One process of the measured import: joins the others, imports, prints one JSON line."""
  import jax
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes, process_id)
  from configs import base
  from trainer.run import job as job_lib
  from trainer.hf import load as hf_load
  c = base.get_config()
  c.model.init_from = f'hf:{model}'
  c.data.source, c.data.seq_len = 'synthetic', 128
  c.train.batch_size = jax.device_count()
  c.mesh.data, c.mesh.fsdp = 1, -1
  config = hf_load.configure(c)
  job = job_lib.build_job(config)
  before = _status_bytes('VmRSS')  # jax, the Job and Python: what any run holds before reading a weight.
  start = time.perf_counter()
  params = hf_load.load_params(config, job.abstract.params, job.shardings.params)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  held = sum(s.data.nbytes for p in jax.tree.leaves(params) for s in p.addressable_shards)
  print(json.dumps({'process': process_id, 'peak_rss_bytes': _status_bytes('VmHWM'), 'params_held_bytes': held,
                    'rss_before_import_bytes': before, 'import_s': round(seconds, 1)}), flush=True)
  jax.distributed.shutdown()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--model', required=True, help='folder of the random 1B model (written if missing)')
  parser.add_argument('--num_processes', type=int, default=2)
  parser.add_argument('--devices_per_process', type=int, default=4)
  parser.add_argument('--child', type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument('--port', type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  model = pathlib.Path(args.model)
  if args.child is not None:
    child(str(model), args.child, args.num_processes, args.port)
    return
  if not model.exists():
    print(f'writing a random float32 Llama 3.2 1B to {model} ...', flush=True)
    write_model(model)
  checkpoint_bytes = sum(f.stat().st_size for f in model.glob('*.safetensors'))
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': f'--xla_force_host_platform_device_count={args.devices_per_process}'}
  procs = [subprocess.Popen([sys.executable, __file__, f'--model={model}', f'--num_processes={args.num_processes}',
                             f'--child={i}', f'--port={port}'], env=env, stdout=subprocess.PIPE, text=True)
           for i in range(args.num_processes)]
  results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
  for r in results:
    print(f"process {r['process']}: peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB = "
          f"{r['peak_rss_bytes'] / checkpoint_bytes:.2f}x the checkpoint's {checkpoint_bytes / 1e9:.2f} GB; its "
          f"devices hold {r['params_held_bytes'] / 1e9:.2f} GB of parameters; RSS before the import "
          f"{r['rss_before_import_bytes'] / 1e9:.2f} GB; import {r['import_s']} s")


if __name__ == '__main__':
  main()
