"""Turns a folder of text files or .npy token arrays into ArrayRecord token shards for `data.source='array_record'`.

  python scripts/prepare_data.py --input=DIR --output=OUT [--glob='**/*.txt'] [--tokenizer=FILE]
      [--num_shards=8] [--eval_percent=5]

--input=FILE.jsonl reads fine-tuning pairs instead: one {"prompt": ...,
"completion": ...} object a line, or a chat {"messages": [...]} rendered with the
tokenizer's chat template, each a document whose tokens carry a loss mask (1 on
the completion and its EOS or on the assistant turns, 0 on the rest;
trainer/data/finetune_jsonl.py),
for runs with --config.data.loss_mask=True (configs/finetune_llama.py).

Each input file is one document. Text is tokenized as raw bytes (vocabulary
256) unless --tokenizer names a LOCAL tokenizer: a Hugging Face model folder
holding tokenizer.json, or a tokenizer.json file (the tokenizers package; BOS and
EOS around each document as the tokenizer_config.json beside it says; the files
are kept in OUT/tokenizer/ for scripts/export_hf.py and scripts/sample.py), a
SentencePiece model (`*.model`, needs the sentencepiece package) or a tiktoken BPE
file (`*.tiktoken`, needs tiktoken; the cl100k split pattern is used). Nothing is
downloaded. `.npy` files (1-D integer arrays) are taken as tokens already.
A hash of each file's path holds --eval_percent of the files out as the eval
split. Documents of fewer than 2 tokens (no next-token target) are skipped and
counted. Then train with:

  python launch.py --config=configs/default.py --workdir=W --config.data.source=array_record --config.data.path=OUT
"""

import argparse
import functools
import pathlib
import shutil
import sys
import zlib

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from trainer.data import finetune_jsonl, token_shards  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.data import file_tokenizers  # noqa: E402
from trainer.hf import tokenizer as hf_tokenizer  # noqa: E402

def load_tokenizer(path: str | None):
  """(encode: str -> list[int], vocab_size, description) from a local file; bytes when `path` is None."""
  if not path:
    return (lambda text: np.frombuffer(text.encode(), np.uint8)), 256, 'bytes'
  if hf_tokenizer.is_hf_tokenizer(path):
    tok = hf_tokenizer.load(path)
    return tok.encode, tok.vocab_size, f'hf:{pathlib.Path(path).resolve()}'
  tok = file_tokenizers.load(path)
  return tok.encode, tok.vocab_size, tok.name


def read_documents(root: pathlib.Path, glob: str, encode) -> list[tuple[str, np.ndarray]]:
  if not root.is_dir():
    raise UserError(f'--input={str(root)!r} is not a folder; give a folder of text files or .npy token arrays.')
  paths = sorted(p for p in root.glob(glob) if p.is_file())
  if not paths:
    raise UserError(f'--input={str(root)!r} has no files matching --glob={glob!r}; change --glob (e.g. "**/*.npy").')
  docs = []
  for path in paths:
    if path.suffix == '.npy':
      try:
        tokens = np.load(path, allow_pickle=False)
      except (OSError, ValueError) as e:
        raise UserError(f'{str(path)!r} is not a readable .npy file ({e}); remove it or fix --glob.') from e
      if tokens.ndim != 1 or tokens.dtype.kind not in 'iu':
        raise UserError(f'{str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; each .npy must be '
                        f'one document: a 1-D integer array of token ids.')
    else:
      tokens = np.asarray(encode(path.read_text(errors='replace')), np.int64)
    docs.append((str(path.relative_to(root)), tokens))
  return docs


def read_finetune_jsonl(path: pathlib.Path, tokenizer_path: str | None, encode, tokenizer: str):
  """(name, tokens, loss mask) per prompt/completion line; a Hugging Face tokenizer adds its document prefix (BOS)
  before the prompt and its EOS after the completion."""
  if not path.is_file():
    raise UserError(f'--input={str(path)!r} is not a file; give a .jsonl file of {{"prompt", "completion"}} lines.')
  prefix, end, render = (), (), None
  if tokenizer.startswith('hf:'):
    tok = hf_tokenizer.load(tokenizer_path)
    encode = functools.partial(tok.encode, document=False)
    prefix, end = tok.prefix, ((tok.eos_id,) if tok.eos_id is not None else tok.suffix)
    render = tok.render_chat if tok.chat_template else None
  return finetune_jsonl.read(path, lambda text: np.asarray(encode(text)).tolist(), prefix, end, render)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--input', required=True)
  parser.add_argument('--output', required=True)
  parser.add_argument('--glob', default='**/*')
  parser.add_argument('--tokenizer', default=None)
  parser.add_argument('--vocab_size', type=int, default=None, help='for .npy input: the vocabulary (default: max+1)')
  parser.add_argument('--num_shards', type=int, default=8)
  parser.add_argument('--eval_percent', type=int, default=5)
  args = parser.parse_args(argv)
  try:
    out = pathlib.Path(args.output)
    if out.exists() and any(out.iterdir()):
      raise UserError(f'--output={args.output!r} is not empty; choose a new folder (nothing was overwritten).')
    encode, vocab_size, tokenizer = load_tokenizer(args.tokenizer)
    source = pathlib.Path(args.input)
    if source.suffix == '.jsonl':  # Fine-tuning pairs: tokens with a loss mask (completions only).
      docs = read_finetune_jsonl(source, args.tokenizer, encode, tokenizer)
    else:
      docs = [(name, tokens, None) for name, tokens in read_documents(source, args.glob, encode)]
    kept = [(name, tokens, mask) for name, tokens, mask in docs if len(tokens) >= 2]
    if not kept:
      raise UserError(f'every file under --input={args.input!r} has fewer than 2 tokens; nothing to train on.')
    largest = max(int(tokens.max()) for _, tokens, _ in kept)
    vocab_size = args.vocab_size or (vocab_size if tokenizer != 'bytes' or largest < 256 else largest + 1)
    if largest >= vocab_size or min(int(tokens.min()) for _, tokens, _ in kept) < 0:
      raise UserError(f'token ids must lie in [0, {vocab_size}) but reach {largest}; set --vocab_size.')
    splits, masks = {'train': [], 'eval': []}, {'train': [], 'eval': []}
    for name, tokens, mask in kept:
      split = 'eval' if zlib.crc32(name.encode()) % 100 < args.eval_percent else 'train'
      splits[split].append(tokens)
      masks[split].append(mask)
    if not splits['eval']:
      del splits['eval']
    if not splits.get('train'):
      raise UserError(f'all {len(kept)} documents fell in the eval split; lower --eval_percent or add files.')
    out.mkdir(parents=True, exist_ok=True)
    token_shards.write_shards(out, splits, vocab_size, tokenizer, args.num_shards,
                              masks if source.suffix == '.jsonl' else None)
    # Kept with the data: export_hf.py ships them, sample.py encodes and decodes with them.
    if tokenizer.startswith('hf:'):
      (out / 'tokenizer').mkdir()
      for file in hf_tokenizer.load(args.tokenizer).files:
        shutil.copy2(file, out / 'tokenizer' / file.name)
    elif tokenizer != 'bytes':
      (out / 'tokenizer').mkdir()
      shutil.copy2(args.tokenizer, out / 'tokenizer' / pathlib.Path(args.tokenizer).name)
  except UserError as e:
    sys.exit(f'prepare_data.py: error: {e}')
  counts = {split: f'{len(d)} documents, {sum(map(len, d))} tokens' for split, d in splits.items()}
  if source.suffix == '.jsonl':
    counts['trained'] = f'{sum(int(m.sum()) for split in splits for m in masks[split])} completion tokens'

  print(f'wrote {out}: {counts}; skipped {len(docs) - len(kept)} document(s) of fewer than 2 tokens; '
        f'vocab {vocab_size} ({tokenizer})')


if __name__ == '__main__':
  main()
