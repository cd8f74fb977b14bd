"""The house's layout: trainer/'s folders as layers that import only downward, no import cycle, benchmarks apart.

Every import is counted wherever it is written (module level, inside a function, under `if TYPE_CHECKING`): a
function-level import runs as surely as a top-level one, only later, so it ties the two modules together the same.
"""

import ast
import collections

from conftest import REPO


def _import_graph() -> dict[str, set[str]]:
  """Module -> the launcher modules it imports (anywhere in it, function bodies too), from the source's AST."""
  files = {}
  for path in [*REPO.glob('trainer/**/*.py'), *REPO.glob('parallel/**/*.py')]:
    name = '.'.join(path.relative_to(REPO).with_suffix('').parts)
    files[name.removesuffix('.__init__')] = path

  def owner(dotted: str) -> str | None:  # 'trainer.models.moe.MoeMlp' -> 'trainer.models.moe'
    while dotted and dotted not in files:
      dotted = dotted.rpartition('.')[0]
    return dotted or None

  graph = collections.defaultdict(set)
  for name, path in files.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [node.module, *(f'{node.module}.{alias.name}' for alias in node.names)]
      else:
        continue
      for target in map(owner, targets):
        # A package importing its own submodules is how it gathers them, not a cycle.
        if target and target != name and not target.startswith(name + '.') and not name.startswith(target + '.'):
          graph[name].add(target)
  return {name: graph[name] for name in files}


# The layers, lowest first; each imports only from itself and the layers before it (docs/architecture.md draws them).
LAYERS = (
    'trainer.base',  # the user-error type, the workdir's storage, the declared config keys, dtype names
    'parallel',  # the mesh, shardings, the sequence split, joining processes
    'trainer.supervision',  # the supervisor and what it watches: attempts, hangs, stragglers, notices
    'trainer.safety',  # the workdir lock and checks, damaged checkpoints, full disks, guardrails, signals
    'trainer.data',  # the input side
    'trainer.attention',  # the one attention call of every model
    'trainer.pipeline',  # the pipeline schedule a model runs its stacked layers through
    'trainer.models',  # the built-in models and the contract of a brought one
    'trainer.hf',  # Hugging Face checkpoints in and out
    'trainer.training',  # the job built once: task, optimizer, state, the pure step, strategy, checks, checkpoints
    'trainer.evals',  # downstream evals of a state
    'trainer.observe',  # metrics, trackers, progress, goodput, profiles, FLOPs
    'trainer.memory',  # what a step needs per device: plan mode, the pre-flight check, remat 'auto'
    'trainer.run',  # the loop
)


def _layer(module: str) -> str | None:
  return next((layer for layer in LAYERS if module == layer or module.startswith(layer + '.')), None)


def _climbs(graph: dict[str, set[str]]) -> list[str]:
  """Every import of a module from a higher layer than its own, as 'importer -> imported'."""
  rank = {layer: i for i, layer in enumerate(LAYERS)}
  return sorted(f'{name} -> {target}' for name, targets in graph.items() for target in targets
                if _layer(name) and _layer(target) and rank[_layer(target)] > rank[_layer(name)])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles: every strongly connected set of more than one module (Tarjan's algorithm)."""
  order, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    order[v] = low[v] = len(order)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in order:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], order[w])
    if low[v] == order[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for v in graph:
    if v not in order:
      visit(v)
  return found


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
  assert _cycles({'a': {'b'}, 'b': set()}) == []


def test_no_module_of_the_launcher_imports_one_that_imports_it_back():
  graph = _import_graph()
  assert {'trainer.run.loop', 'trainer.models.moe', 'parallel.mesh'} <= graph.keys()
  assert 'trainer.models.expert_math' in graph['trainer.models.expert_parallel']  # The graph sees imports.
  assert _cycles(graph) == []


def test_the_layer_check_finds_a_climb():
  graph = {'trainer.base.storage': {'trainer.base.errors'}, 'trainer.data.text': {'trainer.base.errors'},
           'trainer.base.errors': {'trainer.run.loop'}, 'trainer.run.loop': {'trainer.data.text', 'parallel.mesh'}}
  assert _climbs(graph) == ['trainer.base.errors -> trainer.run.loop']


def test_every_module_sits_in_a_layer_and_imports_only_from_its_own_or_a_lower_one():
  graph = _import_graph()
  assert {'trainer.run.loop', 'trainer.base.errors', 'trainer.training.step', 'parallel.mesh'} <= graph.keys()
  assert 'trainer.training.step' in graph['trainer.observe.flops']  # The graph sees imports across folders,
  assert 'trainer.data.hf_tokenizer' in graph['trainer.data.tokenize_job']  # and function-level ones.
  loose = sorted(name for name in graph if name != 'trainer' and _layer(name) is None)
  assert loose == [], f'modules outside every layer (put each in a folder of LAYERS): {loose}'
  assert _climbs(graph) == []


def test_scripts_hold_the_users_tools_and_the_launcher_never_imports_a_benchmark():
  assert not list(REPO.glob('scripts/bench_*')) and len(list(REPO.glob('benchmarks/bench_*.py'))) >= 20
  sources = [*REPO.glob('trainer/**/*.py'), *REPO.glob('parallel/**/*.py'), REPO / 'launch.py', *REPO.glob('scripts/*.py')]
  imported = set()
  for path in sources:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        imported.update(alias.name.split('.')[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        imported.add(node.module.split('.')[0])
  assert {'trainer', 'parallel', 'jax'} <= imported
  assert 'benchmarks' not in imported


def test_architecture_md_gives_every_trainer_folder_its_line_and_names_only_paths_that_exist():
  import re
  text = (REPO / 'docs/architecture.md').read_text()
  folders = {p.parent.relative_to(REPO).as_posix() + '/' for p in REPO.glob('trainer/*/__init__.py')}
  listed = set(re.findall(r'^\| `(trainer/\w+/)` \| [^|]+ \|$', text, flags=re.M))
  assert listed == folders  # One row each, no row for a folder that is gone.
  layer_folders = {layer.replace('.', '/') + '/' for layer in LAYERS if layer.startswith('trainer.')}
  assert layer_folders == folders  # And every folder is a layer of the test above.
  named = set(re.findall(r'\b((?:trainer|parallel)/[\w/]+(?:\.py)?)', text))
  assert 'trainer/run/loop.py' in named and 'trainer/base/' in {n + '/' for n in named} | named
  assert [n for n in sorted(named) if not (REPO / n).exists()] == []
  assert '```text' in text  # The picture: drawn, not run by tests/test_docs.py.
