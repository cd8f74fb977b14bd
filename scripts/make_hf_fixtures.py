"""Build tiny random Hugging Face models with transformers, and their golden logits, as test fixtures.

  python scripts/make_hf_fixtures.py [--output=tests/fixtures/hf]
  python scripts/make_hf_fixtures.py --compare=EXPORTED_DIR --name=llama   # transformers' logits vs the golden ones

Needs torch and transformers, which the launcher itself never imports: run it from a separate virtual environment
(`python3 -m venv /tmp/venv-hf && /tmp/venv-hf/bin/pip install torch transformers safetensors numpy`). Its outputs
are committed, so the tests (and CI) need neither.

Each model is a folder as `save_pretrained` writes it (config.json, model.safetensors; `llama3_rope` sharded, with
model.safetensors.index.json), plus `<name>.logits.npy`: float32 logits (2, 24, vocab) of the model on the fixed
token ids in `input_ids.npy`. The models are tiny (d_model 64, 2 layers, 4 query heads sharing 2 key/value heads,
vocabulary 256) and their weights are redrawn at scales that make every part visible in the logits: norm scales
around 1 (not exactly 1), non-zero q/k/v biases, logits of a few units.

`llama3_rope` keeps its config.json in the form published checkpoints have it (`rope_theta` and `rope_scaling`, as
Llama 3.2's), rewritten after saving and checked by loading it back; the others are as this transformers writes them.
`tokenizer/` is a tiny BPE (120 tokens: fits every fixture's vocabulary of 256) trained here with the tokenizers
library on sentences of a few dozen words, with its tokenizer_config.json (BOS `<s>` and EOS `</s>` per document,
and a chat template).

`chat.json` records what transformers does with a chat: `prompt_ids`, the `apply_chat_template` ids of its
`messages` (assistant's turn opened) with the tokenizer, and `greedy_ids`, what `generate()` writes greedily after
them with the `llama` model in a folder that also holds the tokenizer and a generation_config.json whose
`eos_token_id` is `eos_token_id` (the tokenizer's </s> and an end-of-turn id, as Llama 3 chat models list two):
the end-of-turn id is the first token of the unstopped greedy text, from its fourth on, not written before it,
so the recorded generation stops there. `--chat_only` writes chat.json alone from the committed fixtures.

--compare loads a folder (an export of an imported fixture) with transformers and prints the largest absolute
difference of its logits from the golden ones.
"""

import argparse
import json
import pathlib
import random
import shutil
import tempfile

import numpy as np
import tokenizers
import torch
import transformers

SEQ = 24
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5)
# Llama 3's frequency bands, with an original context of 64 so that positions 0..23 of a head of 16 channels cross
# all three (unchanged, smoothed, divided by the factor).
LLAMA3_ROPE = dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
MODELS = {
    'llama': (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type='default', rope_theta=10000.0))),
    'llama_tied': (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type='default', rope_theta=500000.0))),
    'llama3_rope': (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_theta=10000.0, **LLAMA3_ROPE))),
    'qwen2': (transformers.Qwen2Config, dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type='default', rope_theta=1000000.0))),
    'mistral': (transformers.MistralConfig, dict(tie_word_embeddings=False, sliding_window=4096, rope_parameters=dict(
        rope_type='default', rope_theta=10000.0))),
    # Heads wider than hidden_size / num_attention_heads (16 here), as Mistral Nemo's 128 at 5120 / 32.
    'mistral_head_dim': (transformers.MistralConfig, dict(tie_word_embeddings=False, head_dim=32, sliding_window=None,
                                                          rope_parameters=dict(rope_type='default',
                                                                               rope_theta=1000000.0))),
    # Qwen3: RMSNorm of each query and key head, and heads of its own width (head_dim 128 at hidden 1024 in
    # Qwen3-0.6B; 24 at 64 here).
    'qwen3': (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=24, rope_parameters=dict(
        rope_type='default', rope_theta=1000000.0))),
    # New fixtures go last: each model's weights are drawn with its index as the seed.
}
SHARDED = 'llama3_rope'


def redraw(model: torch.nn.Module, seed: int) -> None:
  """Weights at visible scales: norm scales 1 +- 0.1, biases 0.1, matrices 1/sqrt(fan-in), embeddings 0.5."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if 'norm' in name:
        p.copy_(1 + 0.1 * noise)
      elif name.endswith('bias'):
        p.copy_(0.1 * noise)
      elif 'embed_tokens' in name:
        p.copy_(0.5 * noise)
      else:
        p.copy_(noise / p.shape[1] ** 0.5)


def logits(model, input_ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(input_ids)).logits.float().numpy()


def published_form(folder: pathlib.Path) -> None:
  """config.json as published checkpoints (transformers 4.x) write it: rope_theta and rope_scaling at the top."""
  path = folder / 'config.json'
  cfg = json.loads(path.read_text())
  rope = dict(cfg.pop('rope_parameters'))
  cfg['rope_theta'] = rope.pop('rope_theta')
  cfg['rope_scaling'] = rope
  path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + '\n')


def load(folder) -> torch.nn.Module:
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation='eager').eval()


def build(output: pathlib.Path) -> None:
  output.mkdir(parents=True, exist_ok=True)
  input_ids = np.random.default_rng(0).integers(0, COMMON['vocab_size'], size=(2, SEQ)).astype(np.int64)
  np.save(output / 'input_ids.npy', input_ids)
  for seed, (name, (config_class, extra)) in enumerate(MODELS.items()):
    torch.manual_seed(seed)
    config = config_class(**COMMON, **extra, attn_implementation='eager')
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw(model, seed)
    golden = logits(model, input_ids)
    folder = output / name
    model.save_pretrained(folder, max_shard_size='200KB' if name == SHARDED else '50GB')
    if name == SHARDED:
      published_form(folder)
    reloaded = np.abs(logits(load(folder), input_ids) - golden).max()
    assert reloaded == 0.0, (name, reloaded)  # The folder, read back by transformers, is the model.
    np.save(output / f'{name}.logits.npy', golden.astype(np.float32))
    print(f'{name}: {sorted(p.name for p in folder.iterdir())}, logits std {golden.std():.2f}')
  build_tokenizer(output / 'tokenizer')
  build_chat(output)


WORDS = ('the quick brown fox jumps over lazy dog . what is two plus three ? it four five six seven . name a colour : '
         'red green blue yellow and or not , Question Answer : yes no').split()


# A chat template in the Jinja form transformers renders: user turns as questions, assistant turns as answers.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %} Question : {{ m['content'] }}"
                 "{% elif m['role'] == 'assistant' %} Answer : {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %} Answer :{% endif %}")


def build_tokenizer(folder: pathlib.Path) -> None:
  """A BPE over a small alphabet, Metaspace-split like SentencePiece models, with <s>/</s> added per document."""
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  rng = random.Random(0)
  corpus = [' '.join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
  alphabet = list('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;?!\'"-()')
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=['<unk>', '<s>', '</s>'],
                                                      initial_alphabet=alphabet))
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / 'tokenizer.json'))
  config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': '<s>', 'eos_token': '</s>',
            'unk_token': '<unk>', 'add_bos_token': True, 'add_eos_token': True, 'chat_template': CHAT_TEMPLATE}
  (folder / 'tokenizer_config.json').write_text(json.dumps(config, indent=2) + '\n')
  print(f'tokenizer: {tok.get_vocab_size()} tokens')


CHAT = [{'role': 'user', 'content': 'what is two plus three ?'}, {'role': 'assistant', 'content': 'five'},
        {'role': 'user', 'content': 'name a colour'}]


def build_chat(output: pathlib.Path, name: str = 'llama') -> None:
  """chat.json: apply_chat_template's ids of CHAT, and generate()'s greedy ids after them, stopping at an end id."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(output / 'tokenizer')
  prompt_ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
  with tempfile.TemporaryDirectory() as tmp:
    folder = pathlib.Path(tmp) / name
    shutil.copytree(output / name, folder)
    for f in (output / 'tokenizer').iterdir():
      shutil.copy(f, folder)
    inputs = torch.tensor([prompt_ids])
    free = load(folder).generate(inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(prompt_ids):]
    free = free.tolist()
    end = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t != tokenizer.eos_token_id)
    eos = [tokenizer.eos_token_id, end]
    generation = json.loads((folder / 'generation_config.json').read_text())
    (folder / 'generation_config.json').write_text(json.dumps({**generation, 'eos_token_id': eos}))
    stopped = load(folder).generate(inputs, max_new_tokens=16, do_sample=False)[0, len(prompt_ids):].tolist()
  assert stopped == free[:free.index(end) + 1], (stopped, free)  # It stopped at the end id, and only there.
  record = {'model': name, 'messages': CHAT, 'prompt_ids': prompt_ids, 'eos_token_id': eos, 'greedy_ids': stopped,
            'transformers': transformers.__version__}
  (output / 'chat.json').write_text(json.dumps(record, indent=1) + '\n')
  print(f'chat: {len(prompt_ids)} prompt ids, {len(stopped)} greedy ids ending at {end}')


def compare(folder: str, name: str, fixtures: pathlib.Path) -> None:
  input_ids = np.load(fixtures / 'input_ids.npy')
  golden = np.load(fixtures / f'{name}.logits.npy')
  diff = np.abs(logits(load(folder), input_ids) - golden).max()
  print(f'transformers {transformers.__version__} on {folder}: max |logits - {name}.logits.npy| = {diff:.3g}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--output', default=str(pathlib.Path(__file__).resolve().parent.parent / 'tests/fixtures/hf'))
  parser.add_argument('--compare', default=None, help='a model folder to load and compare with the golden logits')
  parser.add_argument('--name', default='llama', help='with --compare: whose golden logits')
  parser.add_argument('--chat_only', action='store_true', help='write chat.json alone, from the committed fixtures')
  args = parser.parse_args()
  if args.chat_only:
    build_chat(pathlib.Path(args.output))
  elif args.compare:
    compare(args.compare, args.name, pathlib.Path(args.output))
  else:
    build(pathlib.Path(args.output))


if __name__ == '__main__':
  main()
