"""A mixture-of-experts SwiGLU MLP: a float32 router, top-k experts per token, dropless or capacity dispatch.

Shape letters: T tokens (batch x length, flattened), D d_model, E experts, K experts
per token, F expert hidden width, A = T*K token-to-expert assignments, C capacity
(assignments one expert takes in capacity mode).

Routing is Mixtral's: softmax over all experts in float32, the top K kept and
renormalized to sum to 1. Two auxiliary terms keep the router healthy, both
sown into the `aux_loss` collection already weighted and divided by the number
of MoE layers, so the launcher adds their mean over layers to the loss
(trainer/models/sown.py): the Switch Transformer load-balancing loss
E * sum_e f_e * P_e (f_e the fraction of assignments to expert e, P_e its mean
router probability; 1 when balanced) and the router z-loss mean(logsumexp^2).
Beside them, or instead, `router_bias_rate` > 0 balances without a loss term:
a per-expert bias on the choice only (trainer/models/router_bias.py).

Dispatch:
- dropless (`capacity_factor` None or 0): assignments are sorted by expert and run
  through `jax.lax.ragged_dot`, one grouped matmul per projection whose group sizes
  are the experts' token counts: no token is dropped, and the primitive's contract
  (and the traced FLOPs count, trainer/observe/traced_flops.py) is the active experts' work.
  Why ragged_dot, given what it costs here: it is the one XLA primitive with that
  contract whose fast lowerings are owned upstream (TPU; cuDNN, hipBLASLt and Triton
  grouped GEMMs on GPUs), so the layer gets them without a kernel of its own. Where a
  backend has none, XLA pads each group to all tokens and runs a dense batched dot:
  measured on this CPU (benchmarks/bench_moe.py, BENCHMARKS.md "MoE dispatch"), forward
  and backward take 7.0x a loop of plain matmuls over each expert's tokens (the same
  active FLOPs), more than running every expert on every token (4.9x), while the
  capacity mode below takes 1.14x at factor 1.0 and 1.26x at 1.25. So on CPU the capacity
  mode is the fast one; `dispatch_note` says so in the log. XLA's GPU lowering pads
  it too (compiled for an H100: 4.6x the active FLOPs as matmuls), so on NVIDIA GPUs
  (`for_platform`) the layer runs trainer/models/grouped_matmul.py's Pallas Triton
  kernel instead, whose FLOPs are the active experts'.
- capacity (`capacity_factor` > 0): each expert takes at most C = ceil(factor * A / E)
  assignments, first choices of all tokens before any second choice (GShard's priority),
  in token order within a choice; the rest are dropped (the token keeps its residual
  path only) and counted. Buffers (E, C, D) run as one batched matmul.

Expert weights carry the logical names ('expert', 'embed', 'expert_mlp'): the 'expert'
rule splits them over the `expert` mesh axis. With more than one device on that axis
(the jit strategy gives the layer its mesh) tokens travel to their experts' devices
all-to-all: trainer/models/expert_parallel.py. Both run the local math of trainer/models/expert_math.py.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer.base.errors import UserError
from trainer.models import expert_parallel, grouped_matmul, router_bias, sown
from trainer.models.expert_math import (capacity_of, capacity_slots, dropless, route,  # noqa: F401  (moe.* for callers)
                                         swiglu_ragged, with_capacity)

EXPERT_AXES_IN = ('expert', 'embed', 'expert_mlp')  # Gate and up projections (E, D, F).
EXPERT_AXES_OUT = ('expert', 'expert_mlp', 'embed')  # Down projection (E, F, D).


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  num_experts: int
  experts_per_token: int
  expert_mlp_dim: int
  capacity_factor: float | None = None  # None or 0: dropless.
  aux_loss_weight: float = 0.0  # Load-balancing loss weight.
  z_loss_weight: float = 0.0  # Router z-loss weight.
  num_moe_layers: int = 1  # The sown loss terms are divided by it: the loss gets their mean over layers.
  router_bias_rate: float = 0.0  # > 0: trainer/models/router_bias.py's balancing bias, moved this much a step.
  kernel: str = 'ragged_dot'  # Dropless grouped matmuls: 'ragged_dot' (jax.lax) or 'triton' (grouped_matmul.py).
  exchange: str = 'auto'  # Dropless tokens over mesh.expert (expert_parallel.exchange_of); for_platform resolves it.
  # Dropless over mesh.expert: None, a receive buffer for the worst case (nothing drops); f > 0, for f times the
  # balanced load, the overflow dropped (expert_parallel.py, expert_ragged.py).
  buffer_factor: float | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @property
  def dropless(self) -> bool:
    return not self.capacity_factor

  def capacity(self, num_tokens: int) -> int:
    return capacity_of(self.capacity_factor, num_tokens, self.experts_per_token, self.num_experts)


def for_platform(cfg: MoeConfig, platform: str) -> MoeConfig:
  """`cfg` with the grouped-matmul kernel of `platform`: on NVIDIA GPUs ('gpu') the Pallas Triton kernel, since
  XLA's GPU lowering of ragged_dot runs every expert on every assignment (trainer/models/grouped_matmul.py); on TPU
  and CPU jax.lax.ragged_dot."""
  return dataclasses.replace(cfg, kernel='triton' if platform == 'gpu' else 'ragged_dot',
                             exchange=expert_parallel.exchange_of(cfg.exchange, platform))


def dispatch_note(cfg: MoeConfig, platform: str) -> str:
  """One log line: the dispatch mode and kernel the MoE layers run, and on CPU what dropless costs."""
  if not cfg.dropless:
    return (f'MoE: {cfg.num_experts} experts, top-{cfg.experts_per_token}, capacity mode (factor '
            f'{cfg.capacity_factor:g}: (experts, capacity, d_model) buffers on batched matmuls, overflow dropped and '
            f'logged as */dropped_fraction)' + ('; model.expert_buffer_factor applies to dropless routing only, unused '
                                                'here' if cfg.buffer_factor is not None else ''))
  kernel = grouped_matmul.NAME if cfg.kernel == 'triton' else 'jax.lax.ragged_dot'
  note = f'MoE: {cfg.num_experts} experts, top-{cfg.experts_per_token}, dropless on {kernel} (grouped matmuls)'
  note += f'; over mesh.expert tokens travel by {expert_parallel.EXCHANGE_NAMES[cfg.exchange]}'
  if cfg.buffer_factor is not None:
    note += (f' into receive buffers of {cfg.buffer_factor:g}x the balanced load (model.expert_buffer_factor): '
             'overflow is dropped and logged as */dropped_fraction; '
             '--config.model.expert_buffer_factor=0 keeps it exact')
  if platform == 'cpu':
    note += ('; on cpu XLA pads ragged_dot to every expert, about 7x the time of the active FLOPs (BENCHMARKS.md "MoE '
             'dispatch"): --config.model.expert_capacity_factor=1.25 runs near 1.3x')
  return note


class MoeMlp(nn.Module):
  """x (B, L, D) -> (B, L, D): the weighted sum of each token's top-k experts (SwiGLU MLPs)."""
  cfg: MoeConfig
  # The jit strategy's mesh: with several devices each routes and runs its own tokens under shard_map, tokens going to
  # their experts' devices all-to-all over `expert` (trainer/models/expert_parallel.py); None: the dispatch below.
  mesh: jax.sharding.Mesh | None = None

  @nn.compact
  def __call__(self, x_BLD):
    cfg = self.cfg
    B, L, D = x_BLD.shape
    E, K, F = cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim
    init = lambda axes: nn.with_logical_partitioning(nn.initializers.lecun_normal(batch_axis=(0,)), axes)
    # The router is small and read by every token: replicated except over fsdp, and always float32 in use.
    router_DE = self.param('router', nn.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', None)),
                           (D, E), cfg.param_dtype)
    weight = lambda name, shape, axes: self.param(name, init(axes), shape, cfg.param_dtype).astype(cfg.dtype)
    gate_EDF = weight('gate', (E, D, F), EXPERT_AXES_IN)
    up_EDF = weight('up', (E, D, F), EXPERT_AXES_IN)
    down_EFD = weight('down', (E, F, D), EXPERT_AXES_OUT)

    x_TD = x_BLD.reshape(B * L, D)
    logits_TE, weights_TK, experts_TK = route(x_TD, router_DE, K)
    bias_E = router_bias.declare(self, E) if cfg.router_bias_rate else None
    if bias_E is not None:  # The bias chooses the experts; the weights stay the router's (route's top-k is unused).
      weights_TK, experts_TK = router_bias.choose(jax.nn.softmax(logits_TE, axis=-1), bias_E, K)
    dropped = None
    if expert_parallel.splits(self.mesh, x_BLD.shape):  # Each device its own tokens (over `expert`: all-to-all).
      out_BLD, dropped = expert_parallel.dispatch(
          x_BLD, experts_TK.reshape(B, L, K), weights_TK.reshape(B, L, K), gate_EDF, up_EDF, down_EFD,
          mesh=self.mesh, capacity_factor=cfg.capacity_factor, kernel=cfg.kernel, exchange=cfg.exchange,
          buffer_factor=cfg.buffer_factor if cfg.dropless else None)
      out_TD = out_BLD.reshape(B * L, D)
    elif cfg.dropless:
      out_TD = dropless(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, cfg.kernel)
      if cfg.buffer_factor is not None:  # No exchange, nothing dropped: the same metrics as over `expert`.
        dropped = jnp.zeros((), jnp.float32)
    else:
      out_TD, dropped = with_capacity(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD,
                                      cfg.capacity(B * L))
    load_E = self._sow_router_terms(logits_TE, experts_TK, dropped)
    if bias_E is not None:
      router_bias.sow_next(self, bias_E, load_E, cfg.router_bias_rate)
    return out_TD.reshape(B, L, D).astype(cfg.dtype)

  def _sow_router_terms(self, logits_TE, experts_TK, dropped):
    cfg = self.cfg
    E = cfg.num_experts
    load_E = jnp.mean(jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=jnp.float32), axis=1), axis=0) / cfg.experts_per_token
    balance = E * jnp.sum(load_E * jnp.mean(jax.nn.softmax(logits_TE, axis=-1), axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
    # Loss terms: weighted, and divided by the MoE layers so the loss gets their mean over layers.
    sown.loss_term(self, 'moe_balance_loss', cfg.aux_loss_weight * balance / cfg.num_moe_layers)
    sown.loss_term(self, 'moe_router_z_loss', cfg.z_loss_weight * z / cfg.num_moe_layers)
    # Per-layer health, unweighted: load as a multiple of the balanced share (1 / E).
    sown.metric(self, 'balance_loss', balance)
    sown.metric(self, 'router_z_loss', z)
    sown.metric(self, 'load_max', E * jnp.max(load_E))
    sown.metric(self, 'load_min', E * jnp.min(load_E))
    sown.metric(self, 'load_cv', jnp.std(load_E) / jnp.mean(load_E))
    sown.metric(self, 'load_per_expert', E * load_E)
    if dropped is not None:
      sown.metric(self, 'dropped_fraction', dropped)
    return load_E


def _interval(model_config) -> int | None:
  """model.moe_layers as k (every k-th layer is MoE), or None when it is neither 'all' nor a positive int."""
  layers = getattr(model_config, 'moe_layers', 'all')
  if layers == 'all':
    return 1
  return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def from_model_config(model_config, dtype=jnp.float32, param_dtype=jnp.float32) -> MoeConfig | None:
  """The MoeConfig of `config.model` (None when model.num_experts is 0: a dense model)."""
  m = model_config
  if not m.get('num_experts', 0):
    return None
  return MoeConfig(num_experts=m.num_experts, experts_per_token=m.experts_per_token,
                   expert_mlp_dim=m.expert_mlp_dim or m.mlp_dim, capacity_factor=m.expert_capacity_factor,
                   aux_loss_weight=float(m.router_aux_loss_weight), z_loss_weight=float(m.router_z_loss_weight),
                   router_bias_rate=float(m.get('router_bias_rate', 0.0)),  # A config.json from before it: none.
                   num_moe_layers=max(1, m.num_layers // _interval(m)), dtype=dtype, param_dtype=param_dtype,
                   exchange=m.get('expert_exchange', 'auto'),
                   buffer_factor=m.get('expert_buffer_factor') or None)  # 0: exact, as None.


def llama_fields(model_config, dtype, param_dtype) -> dict:
  """The LlamaConfig fields of the MoE settings: moe, moe_interval, shared_expert."""
  moe_config = from_model_config(model_config, dtype, param_dtype)
  if moe_config is None:
    return {}
  return {'moe': moe_config, 'moe_interval': _interval(model_config),
          'shared_expert': bool(model_config.shared_expert)}


def num_moe_layers(model_config) -> int:
  return model_config.num_layers // _interval(model_config) if getattr(model_config, 'num_experts', 0) else 0


def inactive_params(model_config) -> int:
  """Parameters a token does not use: the experts it is not routed to, in every MoE layer (0 for a dense model)."""
  m = model_config
  if not getattr(m, 'num_experts', 0):
    return 0
  return num_moe_layers(m) * (m.num_experts - m.experts_per_token) * 3 * m.d_model * (m.expert_mlp_dim or m.mlp_dim)


def check_config(model_config, scanned: bool) -> None:
  """Raises UserError, naming the key and the fix, for MoE settings that cannot build."""
  m = model_config
  experts = m.get('num_experts', 0)
  if not experts:
    return
  if not isinstance(experts, int) or experts < 0:
    raise UserError(f'model.num_experts={experts!r} must be a positive integer (0 = a dense model).')
  if not 1 <= m.experts_per_token <= experts:
    raise UserError(f'model.experts_per_token={m.experts_per_token} must be between 1 and '
                    f'model.num_experts={experts}.')
  k = _interval(m)
  if k is None:
    raise UserError(f"model.moe_layers={m.moe_layers!r}: use 'all', or k (an int) for every k-th layer.")
  if k > m.num_layers:
    raise UserError(f'model.moe_layers={k} leaves no MoE layer among model.num_layers={m.num_layers}; '
                    f"use 'all' or k <= {m.num_layers}.")
  if scanned and m.num_layers % k:
    raise UserError(f'model.moe_layers={k} must divide model.num_layers={m.num_layers} when layers are scanned '
                    f'(a group of {k} blocks is scanned); change either, or set --config.model.scan_layers=False.')
  factor = m.expert_capacity_factor
  if factor is not None and (not isinstance(factor, (int, float)) or factor < 0):
    raise UserError(f'model.expert_capacity_factor={factor!r} must be > 0 (capacity mode) or None/0 (dropless).')
  buffer = m.get('expert_buffer_factor')
  if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, (int, float)) or not buffer >= 0):
    raise UserError(f'model.expert_buffer_factor={buffer!r} must be > 0 (receive buffers of that many times the '
                    'balanced load over mesh.expert, the overflow dropped), or 0 or None (room for all: exact).')
