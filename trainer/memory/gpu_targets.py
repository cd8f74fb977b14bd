"""NVIDIA GPUs that plan mode compiles for without having one: `launch.py --plan --topology=h100:8`.

XLA's GPU compiler can take a description of its target (a GpuTargetConfig: compute capability, SM count, memory,
cuDNN version) in place of a device. jax's CUDA plugin turns one into compile-only devices
(`jax.experimental.topologies.get_topology_desc(platform='cuda', target_config=...)`), and the real train step
compiles for them on a CPU host, cuDNN's fused attention included, with the compiler's own memory analysis. That
analysis matched what the same steps peaked at on a real H100 (BENCHMARKS.md, "Plan mode for GPUs").

Needs the CUDA plugin and NVIDIA's libraries (requirements-gpu-plan.txt): jax asks the cuDNN library for its
version before it traces cuDNN's attention, and XLA builds cuDNN's graphs with it.
"""

import importlib.util
import os
import re

import jax

from trainer.base.errors import UserError
from trainer.memory import footprint

# The target descriptions (GpuTargetConfigProto, text format): what the compiler reads of the device. The H100
# SXM 80GB's figures are those of XLA's own description of it (xla/backends/gpu/target_config/specs/h100_sxm.txtpb),
# cut to the fields this jaxlib reads; device_memory_size is 79.1 GiB.
TARGETS = {
    'h100': """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 10
}
device_description_str: "NVIDIA H100 80GB HBM3"
""",
}
# The share of a GPU's memory XLA's allocator takes in a launcher run (XLA_CLIENT_MEM_FRACTION, scripts/gpu_env.sh):
# what a GPU plan is judged against unless train.device_memory_gb or --plan_memory_gb says otherwise.
MEM_FRACTION = 0.90
_MEMORY = re.compile(r'device_memory_size: (\d+)')
_SYNTAX = re.compile(r'^(?P<name>[a-z0-9]+)(?::(?:(?P<hosts>\d+)x)?(?P<gpus>\d+))?$')


def is_gpu_topology(topology: str) -> bool:
  """Whether --topology names a GPU target ('h100', 'h100:8', 'h100:2x8') rather than a TPU slice."""
  found = _SYNTAX.match(topology.lower())
  return bool(found) and found.group('name') in TARGETS


def devices(topology: str) -> list[jax.Device]:
  """Compile-only devices for 'NAME[:[HOSTSx]GPUS]': GPUS per host (default 1) on HOSTS hosts (default 1)."""
  found = _SYNTAX.match(topology.lower())
  hosts, gpus = int(found.group('hosts') or 1), int(found.group('gpus') or 1)
  if not hosts or not gpus:
    raise UserError(f'--topology={topology!r} names no GPU; write e.g. h100, h100:8 (one host) or h100:2x8.')
  from jax.experimental import topologies
  try:
    described = topologies.get_topology_desc(platform='cuda', topology=f'1x{hosts}x{gpus}',
                                             target_config=TARGETS[found.group('name')])
  except NotImplementedError as e:  # jax has no topology factory for 'cuda': no CUDA plugin loaded.
    if cuda_plugin_installed():
      raise UserError(f"--topology={topology!r}: jax's CUDA plugin is installed but did not load; without a GPU it "
                      'loads only when JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 is set before jax starts (launch.py sets '
                      'it for --topology).') from e
    raise UserError(f"--topology={topology!r} needs jax's CUDA plugin and NVIDIA's libraries, an optional extra of "
                    f'several GB: pip install -r requirements-gpu-plan.txt (or run --plan without --topology).') from e
  return list(described.devices)


def cuda_plugin_installed() -> bool:
  """Whether jax's CUDA plugin is installed (loaded or not)."""
  if importlib.util.find_spec('jax_plugins') is None:  # The namespace jax discovers its plugins in.
    return False
  return any(importlib.util.find_spec(f'jax_plugins.xla_cuda{version}') for version in (12, 13))


def memory_limit(device: jax.Device) -> footprint.Limit:
  """The budget of one compile-only GPU: MEM_FRACTION of its memory, as a launcher run on it would allocate."""
  target = next(text for text in TARGETS.values() if f'"{device.device_kind}"' in text)
  memory = int(_MEMORY.search(target).group(1))
  fraction = float(os.environ.get('XLA_CLIENT_MEM_FRACTION') or os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')
                   or MEM_FRACTION)
  return footprint.Limit(int(memory * fraction), f"{fraction:.0%} (XLA_CLIENT_MEM_FRACTION) of one "
                                                 f"{device.device_kind}'s {footprint.gib(memory)}")


def is_deviceless(device: jax.Device) -> bool:
  """A compile-only GPU described by a target on a host whose own backend is not a GPU."""
  return device.platform == 'gpu' and jax.default_backend() != 'gpu'


def compiler_failed(error: Exception) -> UserError:
  """XLA's GPU compiler failing without a GPU, as one line: it depends on the jaxlib (docs/performance.md, "Plan mode").

  Seen: jax 0.10.2 refused vit_base's step with XLA attention ("Couldn't find output tile sizes that satisfy hlo"),
  which jax 0.11.2 compiled.
  """
  text = ' '.join(str(error).split())[:300]
  return UserError(f"XLA's GPU compiler could not compile the step for the described GPU without one ({text}). Plan "
                   f'it on a GPU host, or with a newer jax and its CUDA plugin.')


def check_traceable(call) -> None:
  """UserError before compile when jax would refuse to trace cuDNN's attention for a GPU this host does not have.

  jax's own cuDNN checks (jax/_src/cudnn/fused_attention_stablehlo.py) read the architecture from this host's
  default backend, not from the compile target: off a Hopper GPU (a CPU host, an A100) they take it for pre-Hopper,
  which refuses packed rows and head dims over 128 even for an H100 target. `call` is trainer.attention's Call.
  """
  local = jax.devices()[0]
  if local.platform == 'gpu' and float(getattr(local, 'compute_capability', 0) or 0) >= 9.0:
    return
  if call.packed:
    raise UserError('--plan --topology for a GPU cannot trace cuDNN attention over packed rows on this host: jax '
                    'checks the local GPU for Hopper first. Plan it on a Hopper GPU host, or here with '
                    "--config.data.packing=False or --config.model.attention='xla'.")
  if call.head_dim > 128:
    raise UserError(f'--plan --topology for a GPU cannot trace cuDNN attention with head dim {call.head_dim} on this '
                    'host: jax allows over 128 only after checking the local GPU for Hopper. Plan it on a Hopper '
                    "GPU host, or here with --config.model.attention='xla'.")
