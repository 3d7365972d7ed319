"""Calling a graph inductor compiled without torch.compile's frame around it.

Why: a call through torch.compile evaluates the graph's guards over every input (each weight of each layer),
runs the bytecode that gathers those inputs from the modules' attributes, and enters the compiled frame's
context: 80-190 us a call, measured on an AMD EPYC (Zen 5, 2 cores), 0.4-0.9 ms a token for the default
model's 5 runs of layers: 8-15% of an int4 decode step. The weights and caches a run of layers reads do not
change after load, so they are looked up once, and a step passes only what is its own.

How: the backend hands over the compiled function and the traced graph; each of the graph's inputs names
where dynamo took it from (a source: `L['layers'][0]._modules['mlp']...` or `L['x']`). `DirectGraph.bind`
evaluates the sources of everything but the step's own arguments once, for one run of layers; a bound call
fills in the step's arguments (a tensor, or a size of one) and calls the compiled function. A step whose
tensors differ from the traced ones in dtype, device or a static size or stride, or a change of grad mode, is not
called directly (`BoundGraph.__call__` answers None) and goes through torch.compile, which recompiles or
refuses it as before. A graph is used this way only after a call of it gave, bit for bit, what the
torch.compile call gave on the same inputs (`CompiledDecode._adopt`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class Unsupported(Exception):
    """The graph has an input whose origin this module cannot follow; torch.compile keeps serving it."""


def _source_name(node: torch.fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name  # a method in older torch, a property in newer
    if not isinstance(name, str) or not name.startswith("L["):
        raise Unsupported(f"graph input {node.name} has no local source ({name!r})")
    return name


def _expected(node: torch.fx.Node) -> tuple | None:
    """A tensor input's dtype, device, sizes and strides as traced (None for one that is dynamic); None for
    a non-tensor input."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    return value.dtype, value.device, _static(value.shape), _static(value.stride())


def _static(values) -> tuple:
    return tuple(v if isinstance(v, int) else None for v in values)


def _matches(want: tuple[int | None, ...], got: tuple[int, ...]) -> bool:
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


class DirectGraph:
    """One compiled graph, with where each of its inputs comes from."""

    def __init__(self, gm: torch.fx.GraphModule):
        """From the graph dynamo traced, before inductor compiles it (which rewrites the graph's nodes)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.compiled: Callable | None = None  # set once compiled
        self.sources = [_source_name(n) for n in placeholders]
        self.expected = [_expected(n) for n in placeholders]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
            raise Unsupported(f"graph has {outputs!r} as outputs, not one tensor")

    def bind(self, values: dict[str, Any], step_args: frozenset[str]) -> BoundGraph:
        """The graph for one run of layers: `values` holds the arguments other than the step's own
        (`step_args`): the layers, their caches, whose inputs are looked up now. Calls are direct in the
        grad mode of this one only (that of the call torch.compile traced)."""
        template: list[Any] = [None] * len(self.sources)
        step: list[tuple[int, str]] = []
        for i, name in enumerate(self.sources):
            base = name[3:name.index("'", 3)]  # L['base']...
            if base in step_args:
                step.append((i, name))
            else:
                template[i] = _conform(name, _evaluate(name, values), self.expected[i])
        return BoundGraph(self, template, step)


def _conform(name: str, value: Any, want: tuple | None) -> Any:
    """A looked-up input as the graph takes it: a tensor as traced; a number that dynamo made a 0-dim tensor
    (a float attribute that differed between models traced in one process, say) as one; else Unsupported (a
    wrong input in a compiled graph reads or writes memory it should not)."""
    if want is None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise Unsupported(f"graph input {name} is a {type(value).__name__}, traced as a number")
    dtype, device, sizes, strides = want
    if isinstance(value, (int, float)) and not isinstance(value, bool) and sizes == ():
        value = torch.tensor(value, dtype=dtype, device=device)
    if not _same_kind(value, want):
        raise Unsupported(f"graph input {name} is not the tensor traced")
    return value


def _same_kind(value: Any, want: tuple) -> bool:
    dtype, device, sizes, strides = want
    return isinstance(value, torch.Tensor) and value.dtype == dtype and value.device == device and \
        _matches(sizes, value.shape) and _matches(strides, value.stride())


def _evaluate(name: str, values: dict[str, Any]) -> Any:
    try:
        return eval(name, {"__builtins__": {}}, {"L": values})  # a source's name is an expression over L
    except Exception as e:  # noqa: BLE001 - any failure means: not this way
        raise Unsupported(f"cannot evaluate graph input {name}: {e}") from e


class BoundGraph:
    """A graph with one run of layers' inputs filled in; called with a step's arguments."""

    def __init__(self, graph: DirectGraph, template: list[Any], step: list[tuple[int, str]]):
        self.graph = graph
        self.grad_mode = _grad_mode()
        self.template = template
        # the step's inputs: a tensor argument itself, or one of its sizes
        self.fill = [(i, *_step_input(name)) for i, name in step]

    def __call__(self, args: dict[str, Any]) -> torch.Tensor | None:
        """The graph's output for one step, or None when the step's inputs are not what it was traced for."""
        graph = self.graph
        if _grad_mode() != self.grad_mode:
            return None
        inputs = self.template.copy()
        for i, arg, dim in self.fill:
            value = args[arg]
            if dim is not None:
                inputs[i] = value.shape[dim]
                continue
            want = graph.expected[i]
            if want is None or not _same_kind(value, want):
                return None
            inputs[i] = value
        return graph.compiled(*inputs)[0]


def _grad_mode() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _step_input(name: str) -> tuple[str, int | None]:
    """L['arg'] -> (arg, None); L['arg'].size()[d] -> (arg, d); anything else is not followed."""
    end = name.index("'", 3)
    arg, rest = name[3:end], name[end + 2:]
    if rest == "":
        return arg, None
    if rest.startswith(".size()[") and rest.endswith("]") and rest[8:-1].isdigit():
        return arg, int(rest[8:-1])
    raise Unsupported(f"graph input {name} is derived from a step argument")
