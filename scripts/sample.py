"""Print a prompt and the continuation a trained LM writes for it.

  .venv/bin/python scripts/sample.py --workdir=DIR [--prompt='def '] [--num_tokens=200] [--temperature=0.8]
      [--seed=0] [--top_k=0] [--top_p=1.0] [--step=latest] [--params=raw|ema] [--chat] [--ignore_eos]

Reads the run's config from WORKDIR/config.json (written by launch.py),
restores the parameters of the newest intact checkpoint (or --step) onto one
CPU device, and generates one token at a time, each from the model's logits
over the last data.seq_len tokens. The launcher's own Llama (model.name='llama')
runs with a KV cache: the prompt's window runs once (the prefill), then each new
token runs alone against the cached keys and values; once the text outgrows
data.seq_len the cache is rebuilt from the last data.seq_len tokens for every
token (see CachedLogits), as costly as no cache. Brought models (an import path
in model.name), whose internals the launcher does not know, and Llama MoE runs in
capacity mode (model.expert_capacity_factor > 0: a token's routing depends on the
other tokens of the call) run the model over the whole window for every token.
Both give the same tokens. --temperature=0 is greedy; --top_k keeps the k
likeliest tokens, --top_p the smallest set whose probabilities reach p (nucleus
sampling), both before the temperature's softmax draw.

Generation stops at the model's end tokens (trainer/hf/serving.py `end_token_ids`: the
imported folder's generation_config.json or config.json, and the run's tokenizer's
eos_token), as transformers' generate() does, unless --ignore_eos. --chat takes
--prompt as the user's message (or a JSON list of {"role", "content"} messages),
renders it with the tokenizer's chat template and the assistant's turn opened, as
transformers' apply_chat_template(add_generation_prompt=True) does, and prints the
assistant's answer alone.

Runs on byte-level text (data.source='text', or prepare_data.py shards
tokenized as bytes) take the prompt as text and print text; so do runs whose
shards prepare_data.py made with a Hugging Face tokenizer (kept in DATA/tokenizer/)
or that started from a Hugging Face folder holding tokenizer.json
(model.init_from): the prompt is encoded after the tokenizer's document prefix
(BOS), the output decoded; and runs whose shards it made with a SentencePiece
model or a tiktoken file (kept there too; the package must be installed). Runs
whose tokens came with no tokenizer (arrays, synthetic): the prompt is token ids
('15 27 3') and the output is ids; so are runs on .npy tokens whose ids pass 255.
"""

import functools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from trainer.safety import startup_signals  # noqa: E402  (first: a signal in any phase is one line, 128 + it)
if __name__ == '__main__':  # Imported by eval.py and export_hf.py, which name themselves.
  startup_signals.install_for_tool('sample.py')
from trainer.base import interpreter  # noqa: E402
interpreter.require_packages(pathlib.Path(sys.argv[0]).name)
from absl import app, flags, logging  # noqa: E402
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # One CPU device is all this needs; don't claim an accelerator.

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run folder (or gs:// URL): config.json and checkpoints/ from '
                                'launch.py.')
_PROMPT = flags.DEFINE_string('prompt', 'def ', 'Text to continue (token ids, space-separated, for non-byte runs).')
_NUM_TOKENS = flags.DEFINE_integer('num_tokens', 200, 'Tokens to generate after the prompt.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature of the sampling; 0 = greedy.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seeds the sampling.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k likeliest tokens only; 0 = all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample among the smallest set of likeliest tokens whose probabilities add '
                            'up to at least p; 1.0 = all.')
_STEP = flags.DEFINE_string('step', 'latest', "Checkpoint step to load, or 'latest' (the newest intact one).")
_PARAMS = flags.DEFINE_enum('params', 'raw', ['raw', 'ema'], "'raw': the parameters as trained; 'ema': their "
                            'average (runs trained with train.ema_decay > 0).')
_CHAT = flags.DEFINE_bool('chat', False, "--prompt is the user's message (or a JSON list of messages): apply the "
                          "tokenizer's chat template and print the assistant's answer.")
_IGNORE_EOS = flags.DEFINE_bool('ignore_eos', False, "Write --num_tokens tokens, past the model's end tokens.")
flags.mark_flags_as_required(['workdir'])


def _tuples(value):
  """JSON lists back to the tuples the configs use (logical_axis_rules, image_shape)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load_run_config(workdir):
  """The ConfigDict the run in `workdir` was launched with."""
  from ml_collections import config_dict

  from trainer.base.errors import UserError
  if not workdir.is_dir():
    raise UserError(f'--workdir={str(workdir)!r} does not exist; give the --workdir of a launch.py run.')
  path = workdir / 'config.json'
  if not path.is_file():
    raise UserError(f'{str(path)!r} not found: --workdir={str(workdir)!r} is not a launch.py run folder (or its run '
                    f'never started training); give the --workdir of a launch.py run.')
  config = config_dict.ConfigDict(_tuples(json.loads(path.read_text())))
  task = config.model.get('task', 'lm')  # Runs from before model.task were all LMs.
  if task != 'lm':
    raise UserError(f"--workdir={str(workdir)!r} trained model.task={task!r}; sample.py continues text with "
                    f"language models (model.task='lm') only.")
  return config


def restore_model(config, workdir, step: str, which: str = 'raw'):
  """(step, bind, params) of checkpoint `step` ('latest': the newest intact one), on one CPU device.

  `which`: 'raw' parameters or their 'ema' average (trainer/training/state.py `params_of`).

  `bind(params)` is the model: `bind(params)(tokens)` -> logits.

  The run's Job is rebuilt on a one-device mesh and restored as scripts/export_params.py does, so the checkpoint's
  manifest is checked against the config first; the optimizer state is restored too and dropped.
  """
  from trainer.base.errors import UserError
  if not (workdir / 'checkpoints').is_dir():  # Checked first: Checkpointer would create the folder.
    raise UserError(f'--workdir={str(workdir)!r} holds no checkpoint (no checkpoints/ folder); train it with '
                    f'launch.py until a checkpoint is saved (ckpt.every_steps, or the last step).')
  if step != 'latest' and not step.isdigit():
    raise UserError(f"--step={step}: give a checkpoint step or 'latest'.")
  import jax

  from trainer.training import checkpoint
  from trainer.run import job as job_lib
  from trainer.training import state as state_lib
  for key in config.mesh:  # Every axis, per slice and across slices: one device.
    config.mesh[key] = 1
  config.parallel.strategy = 'jit'
  config.train.grad_accum_steps = 1
  job = job_lib.build_job(config, devices=jax.devices('cpu')[:1])
  restored, state = checkpoint.restore_for_tool(job, str(workdir), None if step == 'latest' else int(step))
  task = job.task
  # The model as the step runs it: in the compute dtype, inside the mesh context its own sharding constraints read.
  # `targets` as training has them (the window shifted left one): what a model.unshifted_inputs model is fed.
  def outputs(params, tokens_BL):
    return task.outputs(params, {'inputs': tokens_BL, 'targets': jax.numpy.roll(tokens_BL, -1, axis=1)})

  def bind(params):
    return functools.partial(outputs, params)
  bind.task = task  # For a brought model's own cache (DecodingCallLogits).
  return restored, bind, state_lib.params_of(state, which)


def byte_level(config) -> bool:
  """Whether the run's tokens are bytes: text read raw, or shards prepare_data.py tokenized as bytes."""
  if config.data.source == 'text':
    return True
  from trainer.data import prepared
  prepared_folder = prepared.folder(config.data)
  if prepared_folder is not None:
    meta = prepared_folder / 'meta.json'
    if not meta.is_file():
      return False
    meta = json.loads(meta.read_text())  # .npy tokens are marked 'bytes' too: bytes only while every id is one.
    return meta.get('tokenizer') == 'bytes' and meta.get('vocab_size', 256) <= 256
  return False


def encode_prompt(prompt: str, as_bytes: bool, vocab_size: int) -> list[int]:
  from trainer.base.errors import UserError
  if as_bytes:
    tokens = list(prompt.encode())
  else:
    try:
      tokens = [int(t) for t in prompt.replace(',', ' ').split()]
    except ValueError:
      raise UserError(f'--prompt={prompt!r}: this run\'s tokens are not bytes and sample.py has no tokenizer for '
                      f'them; give the prompt as token ids, e.g. --prompt="15 27 3".') from None
    if any(not 0 <= t < vocab_size for t in tokens):
      raise UserError(f'--prompt={prompt!r}: token ids must be in [0, model.vocab_size={vocab_size}).')
  if not tokens:
    raise UserError('--prompt is empty; give at least one token to continue.')
  return tokens


def filter_logits(logits_V, top_k: int, top_p: float):
  """`logits_V` with every token outside the top-k and outside the top-p nucleus set to -inf."""
  import jax.numpy as jnp
  if top_k > 0:
    kth = jnp.sort(logits_V)[-min(top_k, logits_V.shape[-1])]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  if top_p < 1.0:
    order = jnp.argsort(-logits_V)
    probs = jnp.exp(logits_V[order] - jnp.max(logits_V))
    probs = probs / jnp.sum(probs)
    before = jnp.cumsum(probs) - probs  # Probability of the likelier tokens: a token is kept while that is < p.
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    logits_V = jnp.where(keep, logits_V, -jnp.inf)
  return logits_V


def _window(tokens: list[int], seq_len: int):
  """(the last `seq_len` tokens as a (1, seq_len) array, right-padded while the text is shorter, index of the last).

  Always `seq_len` long, so the forward compiles once; causal attention keeps the padding from reaching the
  position read.
  """
  import numpy as np
  context = tokens[-seq_len:]
  window = np.zeros((1, seq_len), np.int32)
  window[0, :len(context)] = context
  return window, len(context) - 1


class WindowLogits:
  """tokens -> the next token's logits (V,) float32: `bind(params)` run over the whole window, every call."""

  def __init__(self, bind, params, seq_len: int):
    import jax
    import jax.numpy as jnp
    # params as an argument: closed over, they would be constants.
    self._logits = jax.jit(lambda params, window_1L, last: bind(params)(window_1L)[0, last].astype(jnp.float32))
    self._params, self._seq_len = params, seq_len

  def __call__(self, tokens: list[int]):
    return self._logits(self._params, *_window(tokens, self._seq_len))


class CachedLogits:
  """tokens -> the next token's logits (V,) float32, from `decoder` (llama.for_decoding) and its KV cache.

  A call whose text is the last call's grown by one token runs the new token alone at its position, against the
  cache; any other (the first, a new text) runs the window (the prefill, compiled once at `seq_len`). Past
  `seq_len` tokens every call runs
  the prefill again on the last `seq_len`, i.e. slides by recomputing rather than by rolling the cache: the window
  the model reads (in training and in WindowLogits) starts at position 0 with its first token, and dropping the
  oldest token changes every later token's keys and values in every layer above the first (they attended to
  it), not only their RoPE phase, so no cached entry stays valid. Rolling the cache would give other logits than
  the last `seq_len` tokens do.
  """

  def __init__(self, decoder, params, seq_len: int):
    import jax

    def prefill(params, window_1L, last):
      logits_1LV, variables = decoder.apply({'params': params}, window_1L, mutable=['cache'])
      return logits_1LV[0, last], variables['cache']

    def step(params, cache, token_11, position_11):
      logits_11V, variables = decoder.apply({'params': params, 'cache': cache}, token_11, positions=position_11,
                                            mutable=['cache'])
      return logits_11V[0, 0], variables['cache']

    self._prefill, self._step = jax.jit(prefill), jax.jit(step, donate_argnums=1)  # The cache is updated in place.
    self._params, self._seq_len = params, seq_len
    self._cache, self._text = None, []  # The cache holds the keys and values of `_text`.

  def __call__(self, tokens: list[int]):
    import numpy as np
    grown = self._cache is not None and len(tokens) == len(self._text) + 1 and tokens[:-1] == self._text
    if grown and len(tokens) <= self._seq_len:
      logits_V, self._cache = self._step(self._params, self._cache, np.array([[tokens[-1]]], np.int32),
                                         np.array([[len(tokens) - 1]], np.int32))
    else:
      logits_V, self._cache = self._prefill(self._params, *self._prefill_args(tokens))
    self._text = list(tokens)
    return logits_V

  def _prefill_args(self, tokens: list[int]) -> tuple:
    return _window(tokens, self._seq_len)


class DecodingCallLogits(CachedLogits):
  """tokens -> the next token's logits (V,) float32, from a brought model of the decoding call convention
  (`model(tokens, positions, cache, attention_mask) -> (logits, cache)`: flax's Gemma example, tunix) and the cache
  its `init_cache(cache_size, batch_size, dtype)` makes, of data.seq_len entries.

  As CachedLogits (whose call it shares): a text grown by one token runs that token alone at its position against the
  cache; any other runs the text (its last `seq_len` tokens) from position 0 into a fresh cache, compiled once per
  length.
  """

  @staticmethod
  def fits(task) -> bool:
    return task.convention.decoding and callable(getattr(task.model.module_class, 'init_cache', None))

  def __init__(self, task, params, seq_len: int, dtype: str):
    import jax
    import jax.numpy as jnp

    from trainer.base import precision
    dtype = precision.compute_dtype(dtype)  # train.compute_dtype, 'auto' too: the model's own init_cache takes a dtype.
    slots = jnp.arange(seq_len)

    def prefill(params, tokens_1L):
      length = tokens_1L.shape[1]
      with task.context():
        model = task.bind(params)
        mask_1LS = slots[None, None, :] <= jnp.arange(length)[None, :, None]
        logits, cache = model.with_cache(tokens_1L, jnp.arange(length)[None], model.init_cache(seq_len, 1, dtype),
                                         mask_1LS)
      return logits[0, -1].astype(jnp.float32), cache

    def step(params, cache, token_11, position_11):
      with task.context():
        logits, cache = task.bind(params).with_cache(token_11, position_11, cache,
                                                     slots[None, None, :] <= position_11[:, :, None])
      return logits[0, 0].astype(jnp.float32), cache

    self._prefill, self._step = jax.jit(prefill), jax.jit(step, donate_argnums=1)
    self._params, self._seq_len = params, seq_len
    self._cache, self._text = None, []

  def _prefill_args(self, tokens: list[int]) -> tuple:
    import numpy as np
    return (np.array([tokens[-self._seq_len:]], np.int32),)


def cached_decoder(config):
  """The run's Llama for decoding with a KV cache (llama.for_decoding); None where sample.py runs the whole window
  per token: brought models (the launcher does not know their internals) and MoE in capacity mode, where a token
  dropped or kept depends on the other tokens of the call, so one token alone routes unlike the window."""
  from trainer.models import llama
  m = config.model
  if m.name != 'llama' or (m.get('num_experts', 0) and m.get('expert_capacity_factor')):
    return None
  return llama.for_decoding(llama.build(config))  # No mesh: one device, no sharding constraints.


@functools.cache  # One compile per (top_k, top_p) in a process, however many generations.
def _picker(top_k: int, top_p: float):
  """A jitted (logits (V,), key, temperature) -> token: greedy at temperature 0, else sampled."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def pick(logits_V, key, temperature):
    logits_V = filter_logits(logits_V, top_k, top_p)
    greedy = jnp.argmax(logits_V)
    sampled = jax.random.categorical(key, logits_V / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, sampled, greedy)
  return pick


def generate(next_logits, prompt: list[int], num_tokens: int, temperature: float, seed: int, top_k: int = 0,
             top_p: float = 1.0, end_ids: tuple[int, ...] = ()) -> list[int]:
  """Up to `num_tokens` tokens after `prompt`, ending with the first of `end_ids` written (kept, as transformers'
  generate() keeps it); `next_logits(tokens)` (a WindowLogits or CachedLogits) scores each."""
  import jax
  pick = _picker(top_k, top_p)
  tokens, key = list(prompt), jax.random.key(seed)
  for _ in range(num_tokens):
    key, sub = jax.random.split(key)
    tokens.append(int(pick(next_logits(tokens), sub, temperature)))
    if tokens[-1] in end_ids:
      break
  return tokens[len(prompt):]


def sample(workdir: str, prompt: str, num_tokens: int, temperature: float, seed: int, step: str, top_k: int = 0,
           top_p: float = 1.0, params: str = 'raw', chat: bool = False, ignore_eos: bool = False) -> bytes:
  """The prompt and its continuation (with `chat`: the assistant's answer alone), as the bytes to print."""
  tokens, new, as_bytes, decode = sample_ids(workdir, prompt, num_tokens, temperature, seed, step, top_k, top_p, params,
                                             chat, ignore_eos)
  if as_bytes:
    if any(t > 255 for t in tokens + new):
      from trainer.base.errors import UserError
      raise UserError(f'the model wrote token id {max(tokens + new)}, which is no byte (this run\'s text is bytes but '
                      f'its model.vocab_size exceeds 256); retrain with --config.model.vocab_size=256 to sample text.')
    return bytes(tokens + new)
  if decode is not None:
    return decode(tokens, new).encode()
  return ' '.join(map(str, tokens + new)).encode()


def sample_ids(workdir: str, prompt: str, num_tokens: int, temperature: float, seed: int, step: str, top_k: int = 0,
               top_p: float = 1.0, params: str = 'raw', chat: bool = False, ignore_eos: bool = False):
  """(prompt ids, new ids, whether they are bytes, decode(prompt ids, new ids) -> text or None)."""
  import jax

  from trainer.base import storage
  from trainer.base.errors import UserError
  from trainer.hf import serving
  if num_tokens < 0 or temperature < 0:
    raise UserError(f'--num_tokens={num_tokens} and --temperature={temperature} must be >= 0.')
  if top_k < 0 or not 0 < top_p <= 1:
    raise UserError(f'--top_k={top_k} must be >= 0 and --top_p={top_p} in (0, 1].')
  workdir = storage.path(workdir)  # A local folder or gs://bucket/run.
  config = load_run_config(workdir)
  as_bytes = byte_level(config)
  encode, decode = chat_codec(config) if chat else text_codec(config, as_bytes)
  if encode is not None:
    if not prompt:
      raise UserError('--prompt is empty; give at least one token to continue.')
    tokens = encode(prompt)
  else:
    tokens = encode_prompt(prompt, as_bytes, config.model.vocab_size)
  end_ids = () if ignore_eos else serving.end_token_ids(config)
  restored, bind, weights = restore_model(config, workdir, step, params)
  print(f'sample.py: {params} parameters of checkpoint step {restored} in {workdir}', file=sys.stderr)  # stdout: text.
  decoder = cached_decoder(config)
  with jax.default_device(jax.devices('cpu')[0]):
    next_logits = (WindowLogits(bind, weights, config.data.seq_len) if decoder is None else
                   CachedLogits(decoder, weights, config.data.seq_len))
    if decoder is None and DecodingCallLogits.fits(bind.task):
      next_logits = DecodingCallLogits(bind.task, weights, config.data.seq_len, config.train.compute_dtype)
    new = generate(next_logits, tokens, num_tokens, temperature, seed, top_k, top_p, end_ids)
  return tokens, new, as_bytes, decode


def chat_messages(prompt: str) -> list[dict]:
  """--prompt as messages: a JSON list of {"role", "content"} objects, else one user message."""
  from trainer.base.errors import UserError
  if not prompt.lstrip().startswith('['):
    return [{'role': 'user', 'content': prompt}]
  try:
    messages = json.loads(prompt)
  except ValueError as e:
    raise UserError(f'--prompt starts with "[" but is not a JSON list of messages ({e}); give '
                    f'\'[{{"role": "user", "content": "..."}}]\' or plain text.') from None
  if not all(isinstance(m, dict) and {'role', 'content'} <= m.keys() for m in messages):
    raise UserError('--prompt: each message of the JSON list needs a "role" and a "content".')
  return messages


def chat_codec(config):
  """(encode(prompt) -> the chat template's ids with the assistant's turn opened, decode(prompt ids, new ids) ->
  the answer without its end token) for --chat; UserError for a run with no Hugging Face chat template."""
  from trainer.base.errors import UserError
  from trainer.hf import serving
  from trainer.data import hf_tokenizer
  folder = hf_tokenizer.run_folder(config)
  tok = None if folder is None else hf_tokenizer.load(str(folder), flag='the run\'s tokenizer')
  if tok is None or not tok.chat_template:
    raise UserError(f'--chat: this run has no chat template (its Hugging Face tokenizer: '
                    f'{str(folder) if folder else "none"}); drop --chat, or prepare the data with a tokenizer whose '
                    f'tokenizer_config.json has a chat_template.')
  ends = set(serving.end_token_ids(config))

  def encode(prompt):
    return tok.encode(tok.render_chat(chat_messages(prompt), add_generation_prompt=True), document=False)

  def decode(prompt_ids, new):
    return tok.decode(new[:-1] if new and new[-1] in ends else new)
  return encode, decode


def text_codec(config, as_bytes: bool):
  """(encode(prompt) -> ids, decode(prompt ids, new ids) -> text) for runs tokenized with a Hugging Face tokenizer
  (trainer/data/hf_tokenizer.py) or a SentencePiece/tiktoken file kept with the shards
  (trainer/data/file_tokenizers.py); (None, None) for byte-level runs and runs whose tokens came with no tokenizer
  (ids in, ids out)."""
  from trainer.data import file_tokenizers
  from trainer.data import hf_tokenizer
  if as_bytes:
    return None, None
  folder = hf_tokenizer.run_folder(config)
  if folder is not None:
    tok = hf_tokenizer.load(str(folder), flag='the run\'s tokenizer')
    return ((lambda text: [*tok.prefix, *tok.encode(text, document=False)]),
            (lambda prompt, new: tok.decode(prompt[len(tok.prefix):] + new)))
  from trainer.data import prepared
  prepared_folder = prepared.folder(config.data)
  meta = (prepared_folder or pathlib.Path('')) / 'meta.json'
  if prepared_folder is not None and meta.is_file():
    tok = file_tokenizers.of_run(str(prepared_folder), json.loads(meta.read_text()).get('tokenizer', ''))
    if tok is not None:
      return (lambda text: list(tok.encode(text))), (lambda prompt, new: tok.decode(prompt + new))
  return None, None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from trainer.base.errors import UserError
  from parallel import platforms
  platforms.skip_absent_tpu()  # No libtpu start-up lines where no TPU chip is (parallel/platforms.py).
  if not flags.FLAGS['verbosity'].present:  # The restore's log lines (a "resume" onto one device) are noise here.
    logging.set_verbosity(logging.ERROR)
  try:
    out = sample(_WORKDIR.value, _PROMPT.value, _NUM_TOKENS.value, _TEMPERATURE.value, _SEED.value, _STEP.value,
                 _TOP_K.value, _TOP_P.value, _PARAMS.value, _CHAT.value, _IGNORE_EOS.value)
  except UserError as e:
    print(f'sample.py: error: {" ".join(str(e).split())}', file=sys.stderr)
    sys.exit(2)
  sys.stdout.buffer.write(out + b'\n')
  sys.stdout.flush()


if __name__ == '__main__':
  from trainer.run import collector
  collector.tune()  # Fewer collections while the model traces (trainer/run/collector.py).
  from trainer.observe import console
  app.run(main, flags_parser=console.one_line_flag_errors('sample.py'))  # Flag errors: one line, exit 2.
