"""The one exception type the launcher shows to users as a single line.

Anything the user can fix (a config value, a path, a workdir) raises UserError
with a message that names the setting or file and says what to do. launch.py
prints it on one line and exits non-zero; every other exception is a bug and
keeps its traceback.
"""


class UserError(Exception):
  """A problem with the user's config, data or workdir, with the fix in its message."""
