"""lm-eval-harness's tasks through our model on our mesh: an `lm_eval.api.model.LM` over trainer/evals/.

An optional extra: lm-eval is not in any requirements file (its task datasets come from the Hugging Face hub, and
its `hf` extra pulls torch). Where it is installed (`pip install lm-eval`), scripts/eval.py --lm_eval_tasks runs its
registered tasks, or YAML tasks of --lm_eval_include, against a checkpoint:

- `loglikelihood` (multiple-choice tasks) scores every request's (context, continuation) as one row of the same
  jitted, sharded function eval.tasks uses (scorer.py), tokenized by lm-eval 0.4.11's own rule
  (encode_pair: trailing whitespace moves to the continuation, an empty context is scored after the BOS or
  end-of-text token);
- `generate_until` decodes greedily with scripts/sample.py's decoder, passed in as `generate`;
- `loglikelihood_rolling` (perplexity tasks) is not offered: the launcher's eval loss is that figure.

`is_greedy` is reported False for every request (lm-eval's `acc` and `acc_norm` do not read it).
"""

import numpy as np
from lm_eval.api.model import LM

from trainer.base.errors import UserError
from trainer.evals import scorer as scorer_lib
from trainer.evals.codec import Codec


class LaunchLM(LM):

  def __init__(self, scorer: scorer_lib.Scorer, params, codec: Codec, seq_len: int, generate=None):
    super().__init__()
    self._scorer, self._params, self._codec, self._seq_len, self._generate = scorer, params, codec, seq_len, generate

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    rows = []
    for request in requests:
      context, continuation = request.args
      context_ids, continuation_ids = scorer_lib.encode_pair(self._codec, context, continuation)
      if not context_ids:
        raise UserError(f"lm-eval request {context!r} + {continuation!r}: the context is empty or only whitespace and "
                        f"the run's tokenizer has no BOS or end-of-text token to score the continuation after.")
      rows.append(scorer_lib.row(context_ids, continuation_ids, self._seq_len))
    stacked = scorer_lib.Rows(*(np.stack(parts) for parts in zip(*rows)), question=np.arange(len(rows), dtype=np.int32))
    return [(float(ll), False) for ll in self._scorer.log_likelihoods(self._params, stacked)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    raise NotImplementedError('loglikelihood_rolling (perplexity tasks) is not offered through the launcher: its '
                              'eval_loss and eval_perplexity are that figure.')

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    if self._generate is None:
      raise NotImplementedError('generate_until needs a decoder (scripts/eval.py passes sample.py\'s).')
    out = []
    for request in requests:
      context, kwargs = request.args
      until = kwargs.get('until', ['\n\n'])
      out.append(self._generate(context, [until] if isinstance(until, str) else list(until),
                                int(kwargs.get('max_gen_toks', 256))))
    return out
