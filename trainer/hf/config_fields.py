"""The config.json fields the importer reads, each checked for type and range before any is used.

A hand-edited or foreign config.json (`"hidden_size": "64"`, `"num_attention_heads": -4`, `"vocab_size": 10**12`)
used to reach Python arithmetic as a traceback, retried by the supervisor as a crash, or, under `--plan`, XLA's
shape code, which aborted the process on a product of sizes past int64. Here every field architectures.py reads
gets a row of the checks configs/base.py's keys get (trainer/base/config_schema.py), and the array sizes the model
would build from them the same products: one UserError naming config.json, each bad field, its value and what it
must be, exit 2, never retried.
"""

from trainer.base import config_schema as schema
from trainer.base.errors import UserError

# Field -> check, for every field architectures.model_keys and _rope read when present (optional: it may be null).
FIELDS = {
    'architectures': schema.sequence(schema.TEXT),
    'hidden_size': schema.COUNT, 'num_attention_heads': schema.COUNT, 'num_hidden_layers': schema.COUNT,
    'intermediate_size': schema.COUNT, 'vocab_size': schema.COUNT,
    'head_dim': schema.optional(schema.COUNT), 'num_key_value_heads': schema.optional(schema.COUNT_OR_OFF),
    'rms_norm_eps': schema.number(0, 1, low_open=True, high_open=True),  # Present: read as a float, so not null.
    'tie_word_embeddings': schema.optional(schema.BOOL), 'hidden_act': schema.optional(schema.TEXT),
    'attention_bias': schema.optional(schema.BOOL), 'mlp_bias': schema.optional(schema.BOOL),
    'sliding_window': schema.optional(schema.COUNT), 'use_sliding_window': schema.optional(schema.BOOL),
    'rope_theta': schema.POSITIVE,
    'rope_scaling': schema.optional(schema.Check('an object', lambda v: isinstance(v, dict))),
    'rope_parameters': schema.optional(schema.Check('an object', lambda v: isinstance(v, dict))),
}
# Inside rope_scaling / rope_parameters.
ROPE_FIELDS = {
    'rope_type': schema.optional(schema.TEXT), 'type': schema.optional(schema.TEXT), 'rope_theta': schema.POSITIVE,
    'factor': schema.POSITIVE, 'low_freq_factor': schema.POSITIVE, 'high_freq_factor': schema.POSITIVE,
    'original_max_position_embeddings': schema.COUNT,
}
LLAMA3_FIELDS = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')
# config_schema.PRODUCTS are in model.* keys: the field each stands for.
AS_KEYS = {'vocab_size': 'model.vocab_size', 'hidden_size': 'model.d_model', 'num_hidden_layers': 'model.num_layers',
           'intermediate_size': 'model.mlp_dim', 'num_attention_heads': 'model.num_heads',
           'head_dim': 'model.head_dim'}


def _bad(fields: dict, checks: dict, prefix: str = '') -> list[str]:
  return [f'{prefix}{field}={schema.shown(fields[field])} must be {check.expected}'
          for field, check in checks.items() if field in fields and not check.accepts(fields[field])]


def check(hf, where: str) -> None:
  """UserError naming every field of config.json (`hf`, as json.loads read it) the import cannot use as it is."""
  if not isinstance(hf, dict):
    raise UserError(f'{where}: config.json holds a {type(hf).__name__}, not an object of fields; download it again.')
  missing = [f for f in ('hidden_size', 'num_attention_heads', 'num_hidden_layers', 'intermediate_size',
                         'vocab_size') if f not in hf]
  bad = [f'{f} is missing' for f in missing] + _bad(hf, FIELDS)
  for rope in ('rope_scaling', 'rope_parameters'):
    if isinstance(hf.get(rope), dict):
      bad += _bad(hf[rope], ROPE_FIELDS, f'{rope}.')
      if hf[rope].get('rope_type', hf[rope].get('type')) == 'llama3':  # Its four numbers, read unguarded.
        bad += [f'{rope}.{f} is missing' for f in LLAMA3_FIELDS if f not in hf[rope]]
  if not bad:
    named = {AS_KEYS[f]: f for f in AS_KEYS}
    bad = schema.oversized({key: hf.get(field) or 0 for field, key in AS_KEYS.items()}, lambda key: named[key])
    heads, d = hf['num_attention_heads'], hf['hidden_size']
    if not bad and not hf.get('head_dim') and d % heads:
      bad = [f'hidden_size={d} must divide by num_attention_heads={heads} (or head_dim be given)']
  if bad:
    raise UserError(f'{where}: config.json: {"; ".join(bad)}; the folder\'s config.json is damaged or not of a model '
                    f'this import reads (download it again, or fix the field).')
