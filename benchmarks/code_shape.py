"""Static figures of the package's shape, from its source alone (ast and an import walk; nothing is imported):

    .venv/bin/python benchmarks/code_shape.py            # a table
    .venv/bin/python benchmarks/code_shape.py --json

- file import cycles and imports that go to a higher layer (the layers of tests/test_layers.py);
- the largest module, and the module that imports the most: their lines and the tieredkv modules they import;
- the longest functions, and files over 300 lines;
- module globals that code rebinds at run time (`global` statements): state kept outside any object.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_layers import LAYERS, PACKAGE, cycles, imports, layer, modules  # noqa: E402


def figures() -> dict:
    mods = modules()
    graph = imports(mods)
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                    if LAYERS.index(layer(t)) > LAYERS.index(layer(m)))
    sizes = {name: len(path.read_text().splitlines()) for name, path in mods.items()}
    largest = max(sizes, key=sizes.get)
    functions, rebound = [], set()
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(PACKAGE.parent)}:{node.name}"))
            elif isinstance(node, ast.Global):
                rebound.update(f"{name}.{n}" for n in node.names)
    functions.sort(reverse=True)
    return {
        "modules": len(mods),
        "file_import_cycles": cycles(graph),
        "upward_imports": upward,
        "largest_module": {"name": largest, "lines": sizes[largest], "imports": len(graph[largest])},
        "most_imports": {"name": (hub := max(graph, key=lambda m: len(graph[m]))), "imports": len(graph[hub]),
                         "lines": sizes[hub]},
        "longest_functions": [f"{path} ({n} lines)" for n, path in functions[:5]],
        "functions_over_50_lines": sum(1 for n, _ in functions if n > 50),
        "files_over_300_lines": sorted(f"{n} ({sizes[n]})" for n in sizes if sizes[n] > 300),
        "module_globals_rebound": sorted(rebound),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    out = figures()
    if ap.parse_args().json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
