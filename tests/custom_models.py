"""Models a user brings, defined outside trainer/: the launcher finds them by import path.

`MlpLM` (Flax NNX) is the README's example, verbatim between the markers
(tests/test_tasks.py checks that). `LinenMlpLM` is an ordinary Linen module,
not written for the launcher: `linen_mlp_lm(config)` is all the adapter needs.
The rest are broken on purpose, for the error messages.
"""

import flax.linen as nn
import jax
import optax

# --- README example start ---
import jax.numpy as jnp
from flax import nnx


def named(init, *names):
  """An initializer whose parameter carries logical axis names for the mesh rules."""
  return nnx.with_partitioning(init, names)


class MlpLM(nnx.Module):
  """Predicts the next token from the current one: embedding -> tanh MLP -> logits."""

  def __init__(self, config, *, rngs: nnx.Rngs):
    m = config.model
    self.embed = nnx.Embed(m.vocab_size, m.d_model, rngs=rngs,
                           embedding_init=named(nnx.initializers.normal(1.0), 'vocab', 'embed'))
    self.hidden = nnx.Linear(m.d_model, m.mlp_dim, rngs=rngs,
                             kernel_init=named(nnx.initializers.lecun_normal(), 'embed', 'mlp'),
                             bias_init=named(nnx.initializers.zeros, 'mlp'))
    self.out = nnx.Linear(m.mlp_dim, m.vocab_size, use_bias=False, rngs=rngs,
                          kernel_init=named(nnx.initializers.lecun_normal(), 'mlp', 'vocab'))

  def __call__(self, tokens_BL):  # int32 (batch, length) -> float32 logits (batch, length, vocab)
    return self.out(jnp.tanh(self.hidden(self.embed(tokens_BL))))
# --- README example end ---


class LinenMlpLM(nn.Module):
  """The same network as a plain Linen module with its own fields."""
  vocab_size: int
  width: int

  @nn.compact
  def __call__(self, tokens_BL):
    named = lambda init, *names: nn.with_logical_partitioning(init, names)
    x = nn.Embed(self.vocab_size, self.width, embedding_init=named(nn.initializers.normal(1.0), 'vocab', 'embed'))(
        tokens_BL)
    x = nn.Dense(self.width, kernel_init=named(nn.initializers.lecun_normal(), 'embed', 'mlp'),
                 bias_init=named(nn.initializers.zeros_init(), 'mlp'))(x)
    return nn.Dense(self.vocab_size, use_bias=False, kernel_init=named(nn.initializers.lecun_normal(), 'mlp', 'vocab'))(
        jnp.tanh(x))


def linen_mlp_lm(config) -> LinenMlpLM:
  """The adapter's whole contract for Linen: config -> module."""
  return LinenMlpLM(vocab_size=config.model.vocab_size, width=config.model.d_model)


class MlpLMWithOwnLoss(MlpLM):
  """A custom loss: mean cross entropy plus a metric of its own."""

  def loss(self, batch):
    logits = self(batch['inputs'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']).mean()
    return loss, {'loss': loss, 'mean_logit': logits.mean()}


class MlpLMWithHead(MlpLM):
  """Offers train.loss_chunks its hidden states and head (README, "Bring your own model")."""

  def __call__(self, tokens_BL, hidden_and_head: bool = False):
    hidden_BLD = jnp.tanh(self.hidden(self.embed(tokens_BL)))
    if hidden_and_head:
      return hidden_BLD, self.out.kernel[...]
    return self.out(hidden_BLD)


class NnxWithoutNames(nnx.Module):
  def __init__(self, config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(config.model.vocab_size, 8, rngs=rngs)
    self.out = nnx.Linear(8, config.model.vocab_size, rngs=rngs)

  def __call__(self, tokens_BL):
    return self.out(self.embed(tokens_BL))


class LinenWithoutNames(nn.Module):
  vocab_size: int

  @nn.compact
  def __call__(self, tokens_BL):
    return nn.Dense(self.vocab_size)(nn.Embed(self.vocab_size, 8)(tokens_BL))


def linen_without_names(config) -> LinenWithoutNames:
  return LinenWithoutNames(config.model.vocab_size)


class NnxUnknownAxis(MlpLM):
  def __init__(self, config, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    self.scale = nnx.Param(jnp.ones((config.model.vocab_size,)), out_sharding=('logits',))

  def __call__(self, tokens_BL):
    return super().__call__(tokens_BL) * self.scale


class AttentionLM(nn.Module):
  """One causal self-attention layer over embeddings; its own jax.nn.dot_product_attention unless `launcher`, which
  calls trainer.attention.dot_product_attention with the mesh and rules its builder was given."""
  vocab_size: int
  width: int
  launcher: bool = False
  mesh: object = None
  rules: tuple = ()

  @nn.compact
  def __call__(self, tokens_BL, positions=None):
    from trainer import attention
    named = lambda init, *names: nn.with_logical_partitioning(init, names)
    x = nn.Embed(self.vocab_size, self.width, embedding_init=named(nn.initializers.normal(1.0), 'vocab', 'embed'))(
        tokens_BL)
    qkv = nn.DenseGeneral((3, 1, self.width), kernel_init=named(nn.initializers.lecun_normal(), 'embed', None,
                                                                 'heads', 'head_dim'))(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.launcher:
      out = attention.dot_product_attention(q, k, v, causal=True, mesh=self.mesh, rules=self.rules)
    else:
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return nn.Dense(self.vocab_size, use_bias=False, kernel_init=named(nn.initializers.lecun_normal(), 'embed',
                                                                       'vocab'))(out[:, :, 0])


def own_attention_lm(config) -> AttentionLM:
  return AttentionLM(vocab_size=config.model.vocab_size, width=config.model.d_model)


def launcher_attention_lm(config, mesh=None, rules=()) -> AttentionLM:
  return AttentionLM(vocab_size=config.model.vocab_size, width=config.model.d_model, launcher=True, mesh=mesh,
                     rules=tuple(rules))


class NnxTutorialLM(nnx.Module):
  """The JAX AI Stack's LLM tutorial's way: NamedShardings on a mesh of its own ('batch', 'model'), the bias given
  its kernel's spec, one name longer than its rank."""

  def __init__(self, config, *, rngs: nnx.Rngs):
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count() // 2, 2), ('batch', 'model'))
    shard = lambda init, *names: nnx.with_partitioning(init, NamedSharding(mesh, P(*names)))
    m = config.model
    self.embed = nnx.Embed(m.vocab_size, m.d_model, rngs=rngs,
                           embedding_init=shard(nnx.initializers.normal(1.0), None, 'model'))
    self.hidden = nnx.Linear(m.d_model, m.mlp_dim, rngs=rngs,
                             kernel_init=shard(nnx.initializers.xavier_uniform(), None, 'model'),
                             bias_init=shard(nnx.initializers.zeros_init(), None, 'model'))
    self.out = nnx.Linear(m.mlp_dim, m.vocab_size, use_bias=False, rngs=rngs,
                          kernel_init=shard(nnx.initializers.xavier_uniform(), 'model', None))

  def __call__(self, tokens_BL):
    return self.out(jnp.tanh(self.hidden(self.embed(tokens_BL))))
