"""The logical axis names public Flax code gives its parameters, each mapped to the mesh axis that splits it right.

A brought model (docs/brought_models.md) names its parameters' dimensions in its
authors' vocabulary. Names the launcher's own rules (configs/base.py
`parallel.logical_axis_rules`: embed, heads, kv_heads, mlp, vocab, head_dim,
norm, layers, ...) already cover are not repeated; these come after them, so
`parallel.extra_axis_rules` and `parallel.logical_axis_rules` win over them, and
a name in no rule is still refused (parallel/param_names.py). Each split follows
Megatron's: attention heads and the MLP's hidden width over 'tensor', the model
width over 'fsdp', a head's own width and low-rank bottlenecks' partner dimensions
whole where a second split of the same tensor would cut across heads.

Flax assigns a mesh axis to at most one dimension of a tensor, rule by rule in
order: MaxText's query kernel ('embed', 'q_heads', 'kv') gets fsdp, tensor, and
nothing for 'kv', and t5x's ('embed', 'joined_kv') gets fsdp, tensor.
"""

# (name, mesh axis or None, whose vocabulary, what the dimension is). One table: docs/brought_models.md shows it.
PUBLIC_NAMES = (
    ('joined_kv', 'tensor', 'flax examples, t5x/flaxformer', 'heads x head width, joined (attention out kernel)'),
    ('kv', None, 'flax examples (lm1b, wmt), t5x, MaxText', "one head's width"),
    ('q_heads', 'tensor', 'MaxText', 'query heads'),
    ('kv_head_dim', None, 'MaxText', "one key/value head's width"),
    ('q_lora', 'fsdp', 'MaxText (DeepSeek attention)', "the query's low-rank bottleneck"),
    ('kv_lora', 'fsdp', 'MaxText (DeepSeek attention)', "the keys' and values' low-rank bottleneck"),
    ('num_activations', None, 'MaxText', 'the gate and up projections stacked'),
    ('embed_no_exp', 'fsdp', 'MaxText (MoE)', "an expert's model width"),
    ('exp', 'expert', 'MaxText (MoE)', 'experts'),
    ('mlp_activations', None, 't5x', 'the gate and up projections stacked'),
    ('relpos_buckets', None, 't5x', 'relative position buckets'),
    ('abspos_buckets', None, 't5x', 'absolute position buckets'),
    ('stack', None, 't5x', 'scanned layers'),
    ('tp', 'tensor', 'tunix, flax examples gemma', 'its mesh axis for tensor parallelism'),
    ('model', 'tensor', 't5x, flax partitioning guides', 'its mesh axis for model (tensor) parallelism'),
    ('mp', 'tensor', 'older pjit code', 'its mesh axis for model parallelism'),
    ('replica', 'data', 'big_vision', 'its mesh axis for replicas'),
    ('act_batch', ('data', 'fsdp', 'expert'), 'big_vision', "activations' batch (as the launcher's 'batch')"),
)


def rules(named: set[str]) -> tuple[tuple[str, object], ...]:
  """The public names' rules, less those a configured rule already names (`named`)."""
  return tuple((name, axis) for name, axis, _, _ in PUBLIC_NAMES if name not in named)
