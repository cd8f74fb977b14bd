"""The supervisor's settings, checked in launch.py before jax loads or a child starts: one line, exit 2, no retry.

`--max_restarts=-1` ran training unsupervised without a word (LAUNCH_MAX_RESTARTS=-1
was refused), and a negative train.hang_timeout_s ended every attempt as a "hang"
that the supervisor then retried (issue 39). Each bad value is named with its fix.
"""

import signal

from trainer.base.errors import UserError


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(train, max_restarts: int, restart_backoff_s: float) -> None:
  """Raises UserError for a restart count, back-off, hang limit or straggler threshold that cannot mean anything."""
  if max_restarts < 0:
    raise UserError(f'--max_restarts={max_restarts} is not a count of restarts; set it to 0 (train in this process, '
                    f'unsupervised) or more, or leave it out for $LAUNCH_MAX_RESTARTS, else 3.')
  if not restart_backoff_s >= 0:
    raise UserError(f'--restart_backoff_s={restart_backoff_s:g} must be 0 or more seconds.')
  hang = train.hang_timeout_s
  if hang is not None and not (_number(hang) and hang >= 0):
    raise UserError(f'train.hang_timeout_s={hang!r} must be a number of seconds > 0, 0 to turn the hang watch off, '
                    f'or None to derive it from the run.')
  check_preemption_signals(train.preemption_signals)  # Before the supervisor installs a handler for each.
  fraction = train.straggler_warn_fraction
  if not (_number(fraction) and fraction > 0):
    raise UserError(f'train.straggler_warn_fraction={fraction!r} must be > 0 (a fraction of the step time, e.g. '
                    f'0.2).')


def check_preemption_signals(names) -> None:
  """One line for a signal name that is not one, or that the launcher uses for something else."""
  for name in names:
    if name not in signal.Signals.__members__:
      raise UserError(f'train.preemption_signals: {name!r} is not a signal name; use names such as \'SIGUSR2\'.')
    if name in ('SIGUSR1', 'SIGINT', 'SIGKILL', 'SIGSTOP'):
      raise UserError(f'train.preemption_signals: {name} cannot be a preemption notice (SIGUSR1 starts a profile, '
                      f'SIGINT is Ctrl-C, SIGKILL and SIGSTOP cannot be caught); use SIGUSR2 or another signal.')
