"""The documentation cannot rot: the site builds with --strict (every link and reference resolves), every
public class and method has a docstring, every exported name is in the API reference, and the README's
links lead somewhere."""

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

import tieredkv
import tieredkv.serve

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _referenced() -> dict[str, object]:
    """Every object the API reference pages name (`::: dotted.path`), imported."""
    found = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            module, _, name = path.rpartition(".")
            try:
                found[path] = importlib.import_module(path)
            except ModuleNotFoundError:
                found[path] = getattr(importlib.import_module(module), name)
    return found


def _documented_members(obj) -> list[tuple[str, object]]:
    """A class's own public methods and properties (what the reference lists under it)."""
    out = []
    for name, member in vars(obj).items():
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, (property, classmethod,
                                                                                          staticmethod))):
            continue
        out.append((name, member.__func__ if isinstance(member, (classmethod, staticmethod)) else member))
    return out


def _missing_docs(path: str, obj) -> list[str]:
    if inspect.ismodule(obj):
        members = [(n, m) for n, m in vars(obj).items() if not n.startswith("_")
                   and (inspect.isclass(m) or inspect.isfunction(m)) and m.__module__ == obj.__name__]
        return [p for n, m in members for p in _missing_docs(f"{path}.{n}", m)]
    missing = [] if inspect.getdoc(obj) and obj.__doc__ else [path]
    if not inspect.isclass(obj):
        return missing
    missing += [f"{path}.{name}" for name, member in _documented_members(obj) if not inspect.getdoc(member)]
    if issubclass(obj, pydantic.BaseModel):
        missing += [f"{path}.{name} (description)" for name, f in obj.model_fields.items() if not f.description]
    elif dataclasses.is_dataclass(obj):
        doc = inspect.getdoc(obj)
        missing += [f"{path}.{f.name} (Attributes)" for f in dataclasses.fields(obj)
                    if not re.search(rf"^\s+{f.name}:", doc, flags=re.M)]
    return missing


def test_every_public_class_method_and_field_in_the_reference_has_a_docstring():
    referenced = _referenced()
    assert len(referenced) >= 20
    missing = [m for path, obj in referenced.items() for m in _missing_docs(path, obj)]
    assert missing == []


def test_every_exported_name_is_in_the_api_reference():
    referenced = _referenced()
    names = {getattr(obj, "__qualname__", None) for obj in referenced.values()}
    modules = [obj for obj in referenced.values() if inspect.ismodule(obj)]
    in_modules = {n for m in modules for n in vars(m) if not n.startswith("_")}
    exported = set(tieredkv.__all__) | set(tieredkv.serve.__all__)
    assert sorted(exported - names - in_modules) == []


def test_the_readme_links_lead_to_pages_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).exists()] == []


@pytest.mark.slow
def test_the_documentation_site_builds_with_strict(tmp_path):
    # --strict turns every warning into an error: a broken link or anchor, a page left out of the nav, an
    # API reference entry that no longer imports, a docstring section griffe cannot parse.
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    built = tmp_path / "site"
    assert (built / "reference" / "engine" / "index.html").is_file()
    page = (built / "reference" / "config" / "index.html").read_text()
    assert "max_num_batched_tokens" in page and "tokens one step computes" in page
