"""Each choice's (context, continuation) tokens as lm-eval-harness 0.4.11 pairs them (trainer/evals/scorer.py).

lm-eval is not installed in CI (its datasets, evaluate and scikit-learn dependencies are a few hundred MB):
`_lm_eval_rule` is its rule written out from its source (lm_eval/api/model.py, `TemplateLM.loglikelihood` and
`_encode_pair`), and the last test compares with its own functions where it is installed.
"""

import types

import numpy as np
import pytest

from trainer.base.errors import UserError
from trainer.evals import scorer, tasks
from trainer.evals.codec import Codec

BOS, EOT = 300, 301
# Toy tokenizers over bytes: one that merges across the boundary ('\n\n' and ' A' are one token each), with the
# special tokens a Llama-style (BOS added), a GPT-2-style (end-of-text only) and a bytes run (none) would have.
MERGES = {'\n\n': 256, ' A': 257, '\t': 258}


def _merging(text: str) -> list[int]:
  ids, i = [], 0
  while i < len(text):
    piece = next((m for m in MERGES if text.startswith(m, i)), None)
    ids.append(MERGES[piece] if piece else ord(text[i]))
    i += len(piece) if piece else 1
  return ids


CODECS = {
    'bos': Codec(_merging, None, prefix=(BOS,), eos=(EOT,)),
    'end_of_text': Codec(_merging, None, eos=(EOT,)),
}
CONTEXTS = ['The sky is', 'Question: 2+2?\n', 'Q:\n\n', 'a\tb\t', 'x \n\t ', 'end\xa0', 'end\u2028', '  \n', '\t',
            ' ', '']
CONTINUATIONS = [' A', 'A', '\n\nA', ' blue', chr(EOT) + 'A']  # The last starts with the end-of-text token.


def _lm_eval_rule(codec: Codec, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """lm-eval 0.4.11 with a causal model whose tok_encode adds the tokenizer's special tokens (BOS) by default."""
  def tok_encode(text, add_special_tokens=True):
    return [*codec.prefix, *codec.encode(text)] if add_special_tokens else codec.encode(text)
  prefix_token_id = (codec.prefix or codec.eos)[0]  # HFLM: the BOS token, else the end-of-text token.
  if context:  # _encode_pair: every trailing whitespace character (str.rstrip()) moves to the continuation.
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
      continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole_enc, context_enc = tok_encode(context + continuation), tok_encode(context)
    if context_enc:  # Else lm-eval's HFLM stops (assert len(context_enc) > 0): scored as an empty context here.
      return context_enc, whole_enc[len(context_enc):]
  continuation_enc = tok_encode(continuation, add_special_tokens=False)  # The empty context: after the prefix token.
  if continuation_enc[0] == prefix_token_id:
    return continuation_enc[:1], continuation_enc[1:]
  return [prefix_token_id], continuation_enc


@pytest.mark.parametrize('codec', CODECS)
def test_pairs_are_lm_evals_for_every_context(codec):
  for context in CONTEXTS:
    for continuation in CONTINUATIONS:
      assert scorer.encode_pair(CODECS[codec], context, continuation) == \
          _lm_eval_rule(CODECS[codec], context, continuation), (context, continuation)
  # What moved: a newline ending the context is scored as the continuation's first token, and a boundary merge
  # comes out of the whole's encoding; a whitespace-only context is scored after the end-of-text token.
  gpt2 = CODECS['end_of_text']
  assert scorer.encode_pair(gpt2, 'Q?\n', ' A') == ([ord('Q'), ord('?')], [ord('\n'), 257])
  assert scorer.encode_pair(gpt2, 'Q\n', '\nA') == ([ord('Q')], [256, ord('A')])
  assert scorer.encode_pair(gpt2, ' \t', ' A') == ([EOT], [ord(' '), 258, 257])
  assert scorer.encode_pair(gpt2, '', ' A') == ([EOT], [257])
  assert scorer.encode_pair(gpt2, '', chr(EOT) + 'A') == ([EOT], [ord('A')])  # Not the token twice.


def test_whitespace_only_prompts_score_every_token_or_are_refused(tmp_path):
  path = tmp_path / 'blank.jsonl'
  path.write_text('{"context": "Sky:\\n", "choices": ["blue", "red"], "gold": 0}\n'
                  '{"context": "  ", "choices": ["blue", "red"], "gold": 0}\n'
                  '{"context": " \\n\\t", "choices": ["blue", "red"], "gold": 0}\n')
  task = tasks.load(str(path), 0)
  rows = scorer.build_rows(task, CODECS['end_of_text'], seq_len=16)
  # Every continuation token is scored, the moved whitespace too ('  ' scored nothing before, every choice 0.0).
  assert rows.mask.sum(axis=1).tolist() == [6, 5, 7, 6, 8, 7]
  assert rows.inputs[2:, 0].tolist() == [EOT] * 4  # After the end-of-text token, as lm-eval scores ''.
  assert rows.targets[4, :8].tolist() == [ord(' '), ord('\n'), 258, ord(' '), *b'blue']
  np.testing.assert_array_equal(rows.question, [0, 0, 1, 1, 2, 2])
  plain = Codec(lambda text: list(text.encode()), None)  # A bytes run: no BOS, no end-of-text token.
  with pytest.raises(UserError, match=r'blank.jsonl, line 2: the prompt is only whitespace'):
    scorer.build_rows(task, plain, seq_len=16)


def test_pairs_equal_lm_evals_own_functions():
  model = pytest.importorskip('lm_eval.api.model')

  class Pairs(model.TemplateLM):
    """lm-eval's own TemplateLM.loglikelihood and _encode_pair over a toy codec; returns the pairs it makes."""

    def __init__(self, codec):
      super().__init__()
      self.codec = codec

    @property
    def eot_token_id(self):
      return self.codec.eos[0]

    @property
    def prefix_token_id(self):
      return (self.codec.prefix or self.codec.eos)[0]

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
      return self.codec.encode(string) if add_special_tokens is False else [*self.codec.prefix,
                                                                             *self.codec.encode(string)]

    def _loglikelihood_tokens(self, requests, **kwargs):
      return [(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
      raise NotImplementedError

    def generate_until(self, requests, disable_tqdm=False):
      raise NotImplementedError

  for name, codec in CODECS.items():
    pairs = [(c, k) for c in CONTEXTS for k in CONTINUATIONS]
    theirs = Pairs(codec).loglikelihood([types.SimpleNamespace(args=pair) for pair in pairs])
    for pair, their in zip(pairs, theirs):
      ours = scorer.encode_pair(codec, *pair)
      if not their[0]:  # A whitespace-only context without BOS: lm-eval's HFLM asserts; scored after end-of-text.
        assert name == 'end_of_text' and not pair[0].strip() and ours == _lm_eval_rule(codec, *pair)
      else:
        assert ours == (list(their[0]), list(their[1])), (name, pair)
