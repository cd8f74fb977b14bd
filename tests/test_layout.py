"""The house's layout: no import cycle among the launcher's modules, benchmarks apart from the user's tools."""

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
