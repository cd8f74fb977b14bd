"""The local checkpoint tier: each process's shards every `ckpt.local_every_steps` on its own RAM disk or SSD,
with a copy of its peer's, so a lost host costs a few steps, not every step since the last persistent save.

Layout: LOCAL_DIR/jax-launch-<hash of the workdir>/process-<i>-of-<n>/<step>/{own.npz, peer.npz, meta.json}.
`own.npz` holds the distinct shards this process's devices hold of every leaf of the train state; `peer.npz` those
of process (i+1) % n, moved here by one device_put onto the mesh with each process's devices swapped for the
previous process's (the interconnect carries it, as the step's collectives do: no file system is shared);
`meta.json` the data position and a fingerprint of the layout. A step folder is written under a temporary name and
renamed once whole, so a process killed mid-write leaves no step behind.

On a restart every process says which steps it holds (its own and its peer's); the newest step for which every
process's shards are somewhere (its own folder, or the previous process's peer copy) is restored, a lost host's
shards sent back from its peer, if it is newer than the persistent tier's newest (trainer/training/checkpoint.py).

Never fatal: a local folder that cannot be written (full, not a folder, a planted link) is one line and the run goes
on with the persistent tier alone; a local tier that cannot give a complete step is one line and the persistent tier
is restored. docs/checkpoints.md has the costs and why this is not Orbax's emergency manager.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import stat
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from trainer.base import confined
from trainer.training import peer_copy

_KEEP = 2  # Newest complete steps kept per process: the one being written may fail, the one before stays.
_SLOTS = 8  # Steps each process reports on a restart (more than _KEEP: a tmp folder never counts).


@dataclasses.dataclass(frozen=True)
class Found:
  """The newest step the local tier can restore, and where each process's shards come from."""
  step: int
  from_peer: tuple[int, ...]  # Processes whose own folder lacks the step: their shards come from their peer's copy.


class LocalTier:
  """Saves each process's shards and its peer's every `every_steps` in a background thread; restores them."""

  def __init__(self, local_dir: str, every_steps: int, workdir: str, process_index: int, process_count: int):
    self.every_steps = every_steps if local_dir else 0
    self.configured = bool(local_dir)  # The same on every process: whether restarts ask the others what they hold.
    self._index, self._count = process_index, process_count
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._sender = None  # The compiled send of every shard to the previous process, built at the first save.
    self._layouts = None  # (own, peer) fingerprints: the mesh is fixed for the run.
    self._copier = None  # The compiled copy of the state, built at the first save.
    self.folder = None
    if not self.every_steps:
      return
    run = hashlib.sha256(os.path.abspath(str(workdir)).encode()).hexdigest()[:12]
    self.folder = pathlib.Path(local_dir) / f'jax-launch-{run}' / f'process-{process_index}-of-{process_count}'
    try:
      _make_folder(pathlib.Path(local_dir), self.folder)
    except (OSError, confined.Planted) as e:
      self._give_up(f'ckpt.local_dir={local_dir!r} cannot be written ({_why(e)})')

  @property
  def enabled(self) -> bool:
    return bool(self.every_steps)

  def due(self, step: int) -> bool:
    return self.enabled and step % self.every_steps == 0

  def save(self, step: int, state, data_state: dict[str, Any]) -> None:
    """Copies `state` off the step's buffers (the next step donates them), sends the peer's shards here, and writes
    both in a background thread. Waits for the previous write first: at most one is in flight."""
    self.wait_until_finished()
    if self.enabled and not peer_copy.named(state, self._count):
      self._give_up('the local tier sends a peer its shards over a named mesh; parallel.strategy=\'pmap\' has none')
    if not self.enabled:
      return
    if self._layouts is None:
      self._layouts = layout(state), _peer_layout(state) if self._count > 1 else None
    # Where this process holds the same shards as the next (data parallelism across hosts), its own are the copy.
    peer_in_own = self._layouts[0] == self._layouts[1]
    cpu = jax.default_backend() == 'cpu'
    own = self._copy(state) if cpu else state  # Elsewhere the copy to host below is the copy (no device memory).
    peer = None
    if self._count > 1 and not peer_in_own:
      if self._sender is None:
        self._sender = peer_copy.passer(state, towards_previous=True)
      rows = self._sender(own)
      peer = functools.partial(peer_copy.peer_shards, [(leaf.shape, leaf.sharding) for leaf in jax.tree.leaves(state)],
                               jax.tree.leaves(rows))
      # Done before the next step is dispatched: XLA:CPU runs programs that share no buffer at once, and two
      # programs' collectives started in different orders on two hosts would wait for each other (gloo).
      jax.block_until_ready(rows)
    # On GPU/TPU a copy to host now: the next step donates these buffers. On CPU `own` is a copy already.
    own = functools.partial(_shards, own) if cpu else _shards(own)
    meta = {'step': step, 'data': data_state, 'layout': self._layouts[0], 'peer_layout': self._layouts[1],
            'peer_in_own': peer_in_own}
    self._thread = threading.Thread(target=self._write, args=(step, own, peer, meta), daemon=True,
                                    name='local-tier-save')
    self._thread.start()

  def wait_until_finished(self) -> None:
    """Waits for the write in flight; a failed one is one line, and the tier is off from then on."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      error, self._error = self._error, None
      self._give_up(f'the local tier in {self.folder} could not be written ({_why(error)})')

  def _copy(self, state):
    """A copy of `state` the next (donating) step cannot touch: one compiled copy of every leaf, dispatched without
    waiting (checkpoint.detach's device_put of each shard took twice as long: ~30 ms for the tiny model's 344)."""
    if self._copier is None:
      shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
      self._copier = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)
    return self._copier(state)

  def _write(self, step: int, own, peer, meta: dict[str, Any]) -> None:
    temporary = self.folder / f'.{step}.tmp-{os.getpid()}'
    try:
      shutil.rmtree(temporary, ignore_errors=True)  # Ours: a write this process started and never finished.
      os.mkdir(temporary, 0o700)
      _write_npz(temporary / 'own.npz', own() if callable(own) else own)
      if peer is not None:
        _write_npz(temporary / 'peer.npz', peer())
      _write_file(temporary / 'meta.json', json.dumps(meta).encode())
      confined.check_folder(self.folder / str(step))
      shutil.rmtree(self.folder / str(step), ignore_errors=True)  # This run's own older copy of the step.
      os.rename(temporary, self.folder / str(step))
      for old in self.steps()[:-_KEEP]:
        shutil.rmtree(self.folder / str(old), ignore_errors=True)
    except BaseException as e:  # pylint: disable=broad-except  (reported by the loop's thread, once)
      shutil.rmtree(temporary, ignore_errors=True)  # Frees the RAM disk; never a finished step.
      self._error = e

  def _give_up(self, what: str) -> None:
    logging.warning('%s: going on with the persistent tier alone (ckpt.every_steps). Fix: point ckpt.local_dir at a '
                    'folder with room for two steps of this process\'s shards and its peer\'s (or set it to \'\').',
                    what)
    self.every_steps = 0

  def steps(self) -> list[int]:
    """Complete steps in this process's folder, oldest first."""
    if self.folder is None or not self.folder.is_dir():
      return []
    return sorted(int(p.name) for p in self.folder.iterdir() if p.name.isdigit() and (p / 'meta.json').is_file())

  def discard_after(self, step: int) -> None:
    """Drops this process's local steps after `step`, the one the run goes on from: they belong to a timeline that
    is trained again, and a restart must never join one process's old step with another's new one."""
    for newer in self.steps():
      if newer > step:
        shutil.rmtree(self.folder / str(newer), ignore_errors=True)

  def set_aside(self) -> None:
    """--start_over: this run's local steps go to a `previous_run_<UTC time>` folder beside it (never deleted)."""
    if self.folder is not None and self.steps():
      os.rename(self.folder, self.folder.with_name(f'{self.folder.name}.previous_run_'
                                                   f'{time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())}'))
      _make_folder(self.folder.parent, self.folder)

  def newest(self, abstract_with_shardings, newer_than: int) -> tuple[Found | None, str]:
    """The newest step complete across processes if newer than `newer_than`, and why, in words. Every process must
    call it (one small all-gather), with the tier on or off."""
    if not self.configured:
      return None, ''
    if not peer_copy.named(abstract_with_shardings, self._count):
      return None, 'the local tier is not read under parallel.strategy=\'pmap\' across processes'
    expected = layout(abstract_with_shardings), _peer_layout(abstract_with_shardings) if self._count > 1 else None
    own, peer = [], []
    for step in self.steps()[::-1]:
      meta = _read_meta(self.folder / str(step))
      if meta and meta['layout'] == expected[0]:
        own.append(step)
        if self._count > 1 and meta['peer_layout'] == expected[1]:
          peer.append(step)
    held = np.full((2, _SLOTS), -1, np.int64)
    held[0, :len(own[:_SLOTS])], held[1, :len(peer[:_SLOTS])] = own[:_SLOTS], peer[:_SLOTS]
    every = np.asarray(multihost_utils.process_allgather(held)).reshape(self._count, 2, _SLOTS)
    own_of = [set(every[p, 0]) - {-1} for p in range(self._count)]
    copy_of = [set(every[(p - 1) % self._count, 1]) - {-1} for p in range(self._count)]  # Held by the previous one.
    candidates = sorted(set().union(*own_of, *copy_of), reverse=True)
    complete = [s for s in candidates if all(s in own_of[p] or s in copy_of[p] for p in range(self._count))]
    if not complete:
      if not candidates:
        return None, 'the local tier holds no step'
      missing = [p for p in range(self._count) if candidates[0] not in own_of[p] | copy_of[p]]
      return None, (f'the local tier holds no complete step (its newest, {candidates[0]}, lacks the shards of '
                    f'process(es) {missing}: neither their own folder nor their peer\'s copy on process(es) '
                    f'{[(p - 1) % self._count for p in missing]} has them; both hosts lost)')
    step = int(complete[0])
    if step <= newer_than:
      return None, f'the local tier\'s newest complete step, {step}, is not newer'
    return Found(step, tuple(p for p in range(self._count) if step not in own_of[p])), ''

  def restore(self, found: Found, abstract_with_shardings) -> tuple[Any, dict[str, Any]]:
    """(state, data position) of `found.step`, straight into the given shardings. Every process must call it."""
    folder = self.folder / str(found.step)
    mine = self._index not in found.from_peer
    own = _read_npz(folder / 'own.npz') if mine else {}
    if found.from_peer:  # Every process takes part in the one transfer back, holding the copy or not.
      needed = (self._index + 1) % self._count in found.from_peer
      copy = _read_npz(folder / ('own.npz' if _read_meta(folder)['peer_in_own'] else 'peer.npz')) if needed else {}
      returned = peer_copy.sent_back(abstract_with_shardings, copy)
      data_state = self._data_state_from_peer(found)  # Every process takes part in this one too.
      if not mine:
        return returned, data_state
    return _arrays(abstract_with_shardings, own, complete=True), _read_meta(folder)['data']

  def _data_state_from_peer(self, found: Found) -> dict[str, Any]:
    """The data position, the same on every process: process 0's (or the next with its own folder) is sent."""
    holder = min(p for p in range(self._count) if p not in found.from_peer)
    text = json.dumps(_read_meta(self.folder / str(found.step))['data']) if self._index == holder else ''
    return json.loads(_broadcast_text(text, holder))


def _broadcast_text(text: str, source: int) -> str:
  data = np.frombuffer(text.encode(), np.uint8)
  length = int(np.max(multihost_utils.process_allgather(np.array([data.size], np.int64))))
  padded = np.zeros(length, np.uint8)
  padded[:data.size] = data
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, length)
  return bytes(every[source]).rstrip(b'\0').decode()


def _make_folder(root: pathlib.Path, folder: pathlib.Path) -> None:
  """Makes `folder` (and its run folder) under `root`, 0700, refusing a link or a file planted at either."""
  if root.exists() and not root.is_dir():
    raise NotADirectoryError(f'{root} is not a folder')
  root.mkdir(parents=True, exist_ok=True)  # A local SSD's folder may be new; a RAM disk's mount point is there.
  for path in (folder.parent, folder):
    confined.check_folder(path)
    try:
      os.mkdir(path, 0o700)
    except FileExistsError:
      confined.check_folder(path)  # Made between the check and here: still never a link.
  probe = folder / f'.probe-{os.getpid()}'
  _write_file(probe, b'0')
  probe.unlink()


def _write_file(path: pathlib.Path, data: bytes) -> None:
  fd = confined.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # A new file, never through a link.
  with os.fdopen(fd, 'wb') as f:
    f.write(data)


def _write_npz(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
  fd = confined.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, 'wb') as f:
    np.savez(f, **arrays)


def _read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
  """A step's shards: a link or a non-regular file in its place is refused (O_NOFOLLOW), never unpickled."""
  with os.fdopen(confined.open_fd(path, os.O_RDONLY), 'rb') as f, np.load(f, allow_pickle=False) as files:
    return dict(files)


def _read_meta(folder: pathlib.Path) -> dict[str, Any] | None:
  try:
    if stat.S_ISREG(os.lstat(folder / 'meta.json').st_mode):
      return json.loads((folder / 'meta.json').read_text())
  except (OSError, ValueError):
    pass
  return None


def _shards(state) -> dict[str, np.ndarray]:
  """The distinct shards this process holds of every leaf, as host arrays (the copy's; waits for it)."""
  leaves = jax.tree.leaves(state)
  return {key: np.asarray(leaves[i].addressable_data(position)) for i, key, position in _distinct(leaves)}


def _distinct(leaves) -> list[tuple[int, str, int]]:
  """(leaf, key, position among its addressable shards) of each distinct shard: replicas written once. Cached
  per layout (a save's cost is per shard: 344 for the tiny model on 8 devices, 43 distinct)."""
  return _distinct_of(tuple((leaf.shape, leaf.sharding) for leaf in leaves))


@functools.lru_cache(maxsize=4)
def _distinct_of(layouts) -> list[tuple[int, str, int]]:
  out, seen = [], set()
  for i, (shape, sharding) in enumerate(layouts):
    indices = sharding.addressable_devices_indices_map(shape)
    for position, device in enumerate(sharding._addressable_device_assignment):  # pylint: disable=protected-access
      key = peer_copy.key(i, indices[device], shape)
      if key not in seen:
        seen.add(key)
        out.append((i, key, position))
  return out


def layout(state) -> str:
  """A fingerprint of what this process holds of `state`: every leaf's shape, dtype and its shards' indices here."""
  parts = []
  for leaf in jax.tree.leaves(state):
    indices = sorted({peer_copy.key(0, index, leaf.shape) for index in
                      leaf.sharding.addressable_devices_indices_map(leaf.shape).values()})
    parts.append(f'{leaf.shape}{np.dtype(leaf.dtype).str}{indices}')
  return hashlib.sha256(repr((jax.tree.structure(state), parts)).encode()).hexdigest()


def _peer_layout(state) -> str:
  """The fingerprint of what this process holds of the next process's shards (`layout` on the shifted mesh)."""
  return layout(jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=peer_copy.shifted(leaf.sharding)), state))


def _arrays(abstract_with_shardings, shards: dict[str, np.ndarray], complete: bool = False):
  """Global arrays on the given shardings from this process's `shards` (zeros where it has none, unless
  `complete`)."""
  leaves, tree = jax.tree.flatten(abstract_with_shardings)
  out = []
  for i, leaf in enumerate(leaves):
    target = leaf.sharding

    def piece(index, i=i, leaf=leaf):
      found = shards.get(peer_copy.key(i, index, leaf.shape))
      if found is not None:
        return found.view(leaf.dtype)  # np.savez keeps bfloat16 as raw 2-byte values.
      if complete:
        raise KeyError(f'shard {peer_copy.key(i, index, leaf.shape)} missing from the local tier\'s step')
      return np.zeros([len(range(*s.indices(d))) for s, d in zip(index, leaf.shape)], leaf.dtype)
    out.append(jax.make_array_from_callback(leaf.shape, target, piece))
  return jax.tree.unflatten(tree, out)


def _why(error: BaseException) -> str:
  if isinstance(error, OSError) and error.strerror:
    return f'{error.strerror}: {error.filename}' if error.filename else error.strerror
  return ' '.join(str(error).split())[:200] or type(error).__name__


def restore_into(tier: LocalTier, found: Found, abstract_with_shardings, data_iterator,
                 persistent_step: int | None) -> Any:
  """Restores `found` (state returned, data position set) and says in one line which tier and why."""
  start = time.perf_counter()
  state, data_state = tier.restore(found, abstract_with_shardings)
  data_iterator.set_state(data_state)
  source = (f'process(es) {list(found.from_peer)} from their peer\'s copy (their own folder lacks it), the others '
            f'from their own' if found.from_peer else 'every process from its own folder')
  logging.info('Resuming from the local tier at step %d (%s; newer than the persistent tier\'s %s) in %.1fs: %s.',
               found.step, tier.folder.parent, 'none' if persistent_step is None else f'step {persistent_step}',
               time.perf_counter() - start, source)
  return state
