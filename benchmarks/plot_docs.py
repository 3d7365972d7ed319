"""Plots for the documentation's benchmark page, drawn from the JSON results the benchmarks wrote into
docs/bench/ (burst.json, decode_quant.json, longdoc.json): nothing is measured here.

    python benchmarks/plot_docs.py [--dir docs/bench]

Needs matplotlib (the `plots` extra). The engine benchmark's own plot comes from `tieredkv bench`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ENGINE, BASELINE, OTHER = "tab:blue", "tab:gray", "tab:orange"


def _colour(name: str) -> str:
    return ENGINE if name.startswith("tieredkv") else OTHER if name.startswith("llama.cpp") else BASELINE


def _bars(ax, names: list[str], values: list[float], label: str, title: str) -> None:
    ax.barh(names[::-1], values[::-1], color=[_colour(n) for n in names[::-1]])
    ax.set_xlabel(label)
    ax.set_title(title, fontsize=10)
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)


def plot_burst(data: dict, plt) -> object:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["name"] for r in data["results"]]
    _bars(a, names, [r["tok_s"] for r in data["results"]], "output tokens / s (higher is better)",
          "32 conversations on 4 new system prompts, at once")
    _bars(b, names, [r["ttft_p50"] for r in data["results"]], "median time to first token, s (lower is better)",
          "counted from the burst's start")
    b.set_yticklabels([])
    fig.suptitle(data.get("cpu", ""), fontsize=8)
    return fig


def plot_decode(data: dict, plt) -> object:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    rows = [(k if k.startswith("llama.cpp") or k == "transformers" else f"tieredkv {k}", v)
            for k, v in data["decode_ms"].items() if "eager" not in k]
    _bars(ax, [n for n, _ in rows], [v for _, v in rows], "ms per token, batch 1 (lower is better)",
          "batch-1 decode of the default model, by weight format")
    fig.suptitle(data.get("machine", ""), fontsize=8)
    fig.tight_layout()
    return fig


def plot_longdoc(data: dict, plt) -> object:
    engines = [k for k, v in data.items() if isinstance(v, dict) and "first_ttft_s" in v]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label in zip(axes, ("first_ttft_s", "later_ttft_s", "decode_ms_per_token"),
                              ("first question TTFT, s", "later questions TTFT, s", "decode ms / token")):
        _bars(ax, [f"tieredkv {e}" for e in engines], [data[e][key] for e in engines], label, "")
        if ax is not axes[0]:
            ax.set_yticklabels([])
    fig.suptitle(f"a {data['prompt_tokens']:,}-token document, then {data['questions']} questions "
                 "(offloaded: a hot pool of a sixth of it)", fontsize=9)
    fig.tight_layout()
    return fig


PLOTS = {"burst.json": ("burst.png", plot_burst), "decode_quant.json": ("decode_quant.png", plot_decode),
         "longdoc.json": ("longdoc.png", plot_longdoc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "bench")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for source, (target, draw) in PLOTS.items():
        fig = draw(json.loads((args.dir / source).read_text()), plt)
        fig.tight_layout()
        fig.savefig(args.dir / target, dpi=110)
        plt.close(fig)
        print(args.dir / target)


if __name__ == "__main__":
    main()
