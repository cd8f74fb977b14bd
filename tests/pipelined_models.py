"""A brought model that meets the pipeline contract (trainer/training/pipeline_checks.py): its builder takes `pipeline=`
and runs its stacked layers, whose parameters' leading axis is named 'layers', through trainer.pipeline.run."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer import pipeline as pipeline_lib


def _layer(params, x_BLD):
  return x_BLD + jnp.tanh(x_BLD @ params['w'])


class StackLM(nn.Module):
  vocab_size: int
  width: int
  num_layers: int
  mesh: object = None
  pipeline: pipeline_lib.Schedule | None = None

  @nn.compact
  def __call__(self, tokens_BL):
    named = lambda init, *names: nn.with_logical_partitioning(init, names)
    x = nn.Embed(self.vocab_size, self.width, embedding_init=named(nn.initializers.normal(1.0), 'vocab', 'embed'))(
        tokens_BL)
    stacked = {'w': self.param('w', named(nn.initializers.normal(0.3), 'layers', 'embed', 'mlp'),
                               (self.num_layers, self.width, self.width))}
    if self.pipeline is None:
      x = jax.lax.scan(lambda x, p: (_layer(p, x), None), x, stacked)[0]
    else:
      x = pipeline_lib.run(_layer, stacked, x, (), self.pipeline, self.mesh, batch_axes=('data', 'fsdp', 'expert'))
    return nn.Dense(self.vocab_size, use_bias=False, kernel_init=named(nn.initializers.lecun_normal(), 'embed',
                                                                       'vocab'))(x)


def stack_lm(config, mesh=None, pipeline=None) -> StackLM:
  return StackLM(config.model.vocab_size, config.model.d_model, config.model.num_layers, mesh, pipeline)
