"""The package's layers, from its real imports: every `import` and `from ... import` of a tieredkv module in
the source (at module level, inside functions and under TYPE_CHECKING alike) goes to a module of the same
layer or a lower one, and no module imports one that imports it back, directly or through others.

    leaves    config, errors, cache_dir, hashing, platform/ (CPU features, malloc tuning)
    kernels   kernels/
    models    models/ (the batch type, tensor-parallel groups and shards)
    tiers     tiers/ (the block pool, the hot/warm/cold/remote tiers, their manager, block moves)
    core      core/ (KV manager, scheduler, sequences, beam search, cache index, pins)
    runner    runner/ (model runner, compiled and native decode, far-block staging, the step plan)
    engine    engine/ (AsyncEngine, worker, streams, engine core and assembly, request lifecycle, sampling,
              grammar, ranks, explain, snapshots)
    top       tools/, serve/, cli, __main__, the package itself
"""

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tieredkv"
LAYERS = ["leaves", "kernels", "models", "tiers", "core", "runner", "engine", "top"]
LEAVES = {"tieredkv.config", "tieredkv.errors", "tieredkv.cache_dir", "tieredkv.hashing"}
FOLDERS = {"platform": "leaves", "kernels": "kernels", "models": "models", "tiers": "tiers", "core": "core",
           "runner": "runner", "engine": "engine", "tools": "top", "serve": "top"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once for all the tests here."""
    return ast.parse(path.read_text(), str(path))


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the tieredkv modules it imports (a package's module where `from pkg import module`)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("tieredkv"))
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import"
                if node.module and node.module.startswith("tieredkv"):
                    for a in node.names:
                        sub = f"{node.module}.{a.name}"
                        targets.add(sub if sub in mods else node.module)
        graph[name] = {t for t in targets if t != name}
    unknown = {t for ts in graph.values() for t in ts} - set(mods)
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"
    return graph


def layer(module: str) -> str:
    if module in LEAVES:
        return "leaves"
    parts = module.split(".")
    return FOLDERS.get(parts[1], "top") if len(parts) > 1 else "top"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name) in LAYERS, name
        assert not name.startswith("tieredkv.parallel"), f"{name}: parallel/ was split into models/, runner/, engine/"


def test_imports_go_to_the_same_layer_or_below():
    graph = imports(modules())
    upward = sorted(f"{m} ({layer(m)}) -> {t} ({layer(t)})" for m, ts in graph.items() for t in ts
                    if LAYERS.index(layer(t)) > LAYERS.index(layer(m)))
    assert upward == []


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(imports(modules())) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_only_kernels_ops_registers_torch_operators():
    """The tieredkv library of torch operators is declared in one module: no other calls torch.library."""
    users = sorted(name for name, path in modules().items() if "torch.library" in path.read_text())
    assert users == ["tieredkv.kernels.ops"]


FAR_OWNERS = {"tiers/block_pool.py", "tiers/hot.py", "tiers/manager.py", "core/far_blocks.py",
              "runner/model_runner.py", "runner/far_stage.py"}  # and the kernels (the attention ops)
FAR_WORDS = re.compile(r"far|offload|stag|in_place", re.IGNORECASE)
FAR_SHOWN = {"tools/plan.py": "format_plan"}  # a report: its staging line is shown where a plan stages


def test_conditions_on_far_blocks_live_only_where_far_blocks_are_acted_on():
    """Outside the block pool, the tiers, the far-block policy (core/far_blocks.py, which the scheduler, the request
    factory and the assembly ask), the runner's staging and the kernels, no `if`, `while`, conditional expression
    or comprehension filter names far blocks, offloading or staging (docs/architecture.md: The scheduler)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in FAR_OWNERS or rel.startswith("kernels/"):
            continue
        tree = parsed(path)
        shown = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == FAR_SHOWN.get(rel)]
        for node in ast.walk(tree):
            if any(f.lineno <= getattr(node, "lineno", 0) <= f.end_lineno for f in shown):
                continue
            tests = [node.test] if isinstance(node, (ast.If, ast.While, ast.IfExp)) else \
                list(node.ifs) if isinstance(node, ast.comprehension) else []
            found += [f"{rel}:{t.lineno}" for t in tests if FAR_WORDS.search(ast.unparse(t))]
    assert not found


def test_no_function_is_longer_than_50_lines():
    """A function that outgrows a screen is split where its parts have jobs of their own (engine/build.py's pieces,
    the plan command's parser); counted from `def` to its last line, docstring included."""
    long = [f"{path.relative_to(PACKAGE).as_posix()}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(parsed(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50]
    assert not long
