# shellcheck shell=bash
# The environment launch.py gets on NVIDIA GPUs, shared by scripts/launch_gpu_node.sh
# and scripts/launch_slurm.sh (sourced, never run). gpu_env_settings fills GPU_ENV
# with NAME=VALUE entries; a value the user already exported is respected.
#
# Checked against the jax/jaxlib pinned in requirements.txt (0.10.2): an XLA flag
# that does not exist aborts XLA at start-up, and tests/test_launch_scripts.py starts
# jax with these flags to catch a flag that a jaxlib upgrade removed.
#
# --xla_gpu_enable_command_buffer: XLA's defaults minus cuDNN (below), not off:
# fusions and cuBLAS in CUDA graphs cut kernel-launch overhead, the bottleneck of
# small models like configs/default.py. Turn them all off per run with
# XLA_FLAGS=--xla_gpu_enable_command_buffer= (the user's flags win, see below).
#
# Left at XLA's defaults on purpose:
# - --xla_gpu_enable_triton_gemm=false: advice from when Triton matmuls were not
#   autotuned against cuBLAS; today XLA's autotuner times both per matmul (with
#   --xla_gpu_cublas_fallback=true), so forcing cuBLAS only removes candidates.
# - --xla_gpu_enable_highest_priority_async_stream: already true by default.
# - CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_* tuning: hardware- and model-specific;
#   NVIDIA's own guide now advises against the former on Blackwell.

gpu_env_settings() {
  GPU_ENV=()

  # Fail at start-up rather than train on the CPU: without it, jax falls back to
  # the CPU with a warning when the CUDA plugin is missing (the venv needs
  # pip install "jax[cuda12]==<the jax pin>", or cuda13 for CUDA 13 drivers).
  GPU_ENV+=("JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}")

  # The latency-hiding scheduler (off by default in XLA:GPU) runs the collectives
  # that data parallelism and FSDP insert (parameter all-gathers, gradient
  # reduce-scatters and all-reduces) asynchronously, overlapped with compute,
  # instead of stalling the GPUs on each. Recommended by the JAX GPU performance
  # tips and set in NVIDIA's JAX containers. The user's XLA_FLAGS come after it,
  # and XLA takes the last value of a repeated flag, so theirs win.
  #
  # cuDNN calls stay out of CUDA graphs (-CUDNN): recorded into one, cuDNN's graph
  # failed to capture at the first step in 2 of 4 launches on an H100 (the
  # measurement and the flag's choice: trainer/run/gpu_env.py, which launch.py applies
  # to any GPU launch; set here too so --dry_run shows it).
  GPU_ENV+=("XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=-CUDNN${XLA_FLAGS:+ $XLA_FLAGS}")

  # Memory: keep jax's preallocation (one pool up front, so no fragmentation and
  # no cudaMalloc inside the step) but take 90% of each GPU instead of 75%: the
  # process owns its GPUs, and the 10% left over is for what lives outside the
  # pool (cuBLAS/cuDNN workspaces, NCCL buffers, CUDA graphs). jaxlib 0.10 reads
  # XLA_CLIENT_MEM_FRACTION; the old name XLA_PYTHON_CLIENT_MEM_FRACTION still
  # works but setting both is an error, so a value under either name is kept.
  if [[ -z ${XLA_CLIENT_MEM_FRACTION:-} && -z ${XLA_PYTHON_CLIENT_MEM_FRACTION:-} ]]; then
    GPU_ENV+=("XLA_CLIENT_MEM_FRACTION=0.90")
  fi
}
