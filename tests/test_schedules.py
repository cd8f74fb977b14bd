"""Each train.schedule equals its formula, written out here, at chosen steps."""

import math

import pytest

from configs import base
from trainer.base.errors import UserError
from trainer.training import optimizer

PEAK, END_RATIO, WARMUP, STEPS = 1e-3, 0.1, 10, 100
END = PEAK * END_RATIO


def _schedule(name, steps=STEPS, **keys):
  train = base.get_config().train
  train.learning_rate, train.end_learning_rate_ratio, train.warmup_steps, train.steps = PEAK, END_RATIO, WARMUP, steps
  train.schedule = name
  for key, value in keys.items():
    train[key] = value
  return optimizer.learning_rate_schedule(train)


def _warmup(step):
  return PEAK * step / WARMUP


FORMULAS = {
    'cosine': lambda s: END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP))),
    'linear': lambda s: PEAK + (END - PEAK) * (s - WARMUP) / (STEPS - WARMUP),
    'constant': lambda s: PEAK,
    'rsqrt': lambda s: PEAK * math.sqrt(WARMUP / s),
    # decay_fraction 0.2: stable until step 80, then down to END at step 100.
    'wsd': lambda s: PEAK if s <= 80 else PEAK - (PEAK - END) * (s - 80) / 20,
}


@pytest.mark.parametrize('name', sorted(FORMULAS))
def test_schedule_matches_formula(name):
  schedule = _schedule(name)
  for step in (0, 3, WARMUP):
    assert float(schedule(step)) == pytest.approx(_warmup(step), rel=1e-6, abs=1e-12)
  for step in (11, 37, 80, 90, 99, 100):
    assert float(schedule(step)) == pytest.approx(FORMULAS[name](step), rel=1e-5), step


def test_wsd_one_minus_sqrt():
  schedule = _schedule('wsd', decay_shape='1-sqrt', decay_fraction=0.5)  # Stable to step 50, decay over 50.
  for step in (20, 50, 62, 75, 100):
    expected = PEAK if step <= 50 else END + (PEAK - END) * (1 - math.sqrt((step - 50) / 50))
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5), step


def test_wsd_extended_run_stays_stable():
  """Raising train.steps on resume moves the decay later: a step that was stable stays at the peak,
  and one that had started decaying returns to it (the run goes on in its stable phase)."""
  short, longer = _schedule('wsd'), _schedule('wsd', steps=200)
  assert float(short(60)) == float(longer(60)) == pytest.approx(PEAK)
  assert float(short(90)) < PEAK and float(longer(90)) == pytest.approx(PEAK)
  assert float(longer(160)) == pytest.approx(PEAK) and float(longer(200)) == pytest.approx(END)  # Decays over 160-200.


def test_unknown_schedule_is_refused():
  train = base.get_config().train
  train.schedule = 'step'
  with pytest.raises(UserError, match=r"train.schedule='step' is not one of cosine, linear, constant, wsd, rsqrt"):
    optimizer.validate(train, base.get_config().train)
