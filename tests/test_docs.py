"""The user documentation: a short README, and links between the pages that resolve."""

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_is_at_most_200_lines():
    """Issue 60: what it is, results, the two commands, three examples, links into the guide."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_python_block_of_the_docs_is_python():
    """A user copies them: a shell line inside one (``pip install ...``) is a SyntaxError."""
    blocks = [(page, block) for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    wrong = []
    for page, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as e:
            wrong.append(f"{page.relative_to(ROOT)}: {e}")
    assert wrong == [] and len(blocks) > 10


def test_every_relative_link_of_the_docs_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target, _ in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert broken == []
    assert len(PAGES) > 5 and any(LINK.search(page.read_text()) for page in PAGES)


# The user guide (mkdocs.yml, docs/hooks.py) ------------------------------------------------------
def _hooks():
    import importlib.util
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_user_guide_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (what the `docs` extra installs; the `test` extra too): a broken
    link, a page missing from the navigation's files, or a generated page that fails ends the
    build with an error."""
    import subprocess
    import sys

    pytest.importorskip("mkdocs", reason="the test extra installs MkDocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    troubleshooting = (tmp_path / "site" / "guide" / "troubleshooting" / "index.html").read_text()
    assert "No ProTrain plan fits a device memory budget of" in troubleshooting
    assert "worker_cores" in (tmp_path / "site" / "guide" / "configuration" / "index.html").read_text()
    api = (tmp_path / "site" / "guide" / "api" / "index.html").read_text()
    hooks = _hooks()
    for package in ("protrain_core", "lightning_protrain"):
        assert all(f"{package}.{name}" in api for name in hooks.public_names(package)), package
    assert "zero_grad" in api and "save_pretrained" in api  # the engine's methods, inherited ones included


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if f": {p}" not in nav} == set()


# The errors whose message is made elsewhere: the text the page cannot show at the raise.
PASSED_ON = {
    ("protrain_core/autoplan.py", "InfeasibleBudget"),  # the search's refusal, with what would fit added
    ("protrain_core/cli.py", "SystemExit"),  # `protrain plan`: the library's error, prefixed
    ("protrain_core/phase.py", "RuntimeError"),  # StepState.entered: its caller's message
    ("protrain_core/runtime/sharding.py", "RuntimeError"),  # the usage check's verdict (UsageCheck)
    ("protrain_core/structure/layout.py", "KeyError"),  # a member's name, as a dict's KeyError
}


def test_the_troubleshooting_page_lists_every_refusal():
    """Every ``raise`` of the library that builds an error gets its message on the page (in
    docs/guide/troubleshooting.md's generated list), read through the helpers that make it;
    only the errors that pass on a message made elsewhere (``PASSED_ON``) show none of their own.
    Counted against an independent walk of the source, so no raise is skipped."""
    import ast

    hooks = _hooks()
    listed = hooks.refusals()
    sites = set()
    for package in ("protrain_core", "lightning_protrain", "ops"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    sites.add((str(path.relative_to(ROOT)), node.lineno))
    # The OSErrors of checkpoint.py keep the type of the error they name (``_naming``): not listed.
    assert {path for path, _ in sites - {(path, line) for path, line, _, _ in listed}} == {"protrain_core/checkpoint.py"}
    assert len(sites) - len(listed) == 2
    wordless = {(path, kind) for path, _, kind, message in listed
                if len(re.sub(r"\{[^}]*\}", "", message).split()) < 4}
    assert wordless == PASSED_ON
    assert "{" not in hooks.refusals_page().split("\n")[0]


def test_the_configuration_reference_has_every_field():
    """Generated from the fields' docstrings (docs/hooks.py): every field of ``ProTrainConfig``
    and its parts, with its default as the dataclass has it."""
    import dataclasses

    import protrain_core as pt

    text = _hooks().configuration_reference()
    for cls in (pt.ProTrainConfig, pt.PlanningConfig, pt.ClippingConfig, pt.RuntimeConfig, pt.CheckpointConfig):
        assert f"### {cls.__name__}" in text
        for f in dataclasses.fields(cls):
            assert f"**`{f.name}`**" in text, (cls.__name__, f.name)
            if f.default is not dataclasses.MISSING:
                assert f"**`{f.name}`**: `{f.type}` = `{f.default!r}`" in text, (cls.__name__, f.name)


def _field_docstrings(cls) -> set[str]:
    """The fields of a dataclass that have a docstring (a string right after the field)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    return {node.target.id for node, after in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)}


def _undocumented(obj) -> list[str]:
    """The arguments of a public function or class that its docstring does not name."""
    import dataclasses
    import enum
    import inspect

    doc = obj.__doc__ if not inspect.isclass(obj) else vars(obj).get("__doc__")
    if not doc or not doc.strip():
        return ["(no docstring)"]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return []
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    documented = _field_docstrings(obj) if inspect.isclass(obj) and dataclasses.is_dataclass(obj) else set()
    init_doc = (getattr(obj, "__init__", None).__doc__ or "") if inspect.isclass(obj) else ""
    return [name for name, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and name not in documented and not re.search(rf"\b{name}\b", doc + init_doc)]


def test_every_public_name_has_a_docstring_with_its_arguments():
    """The API reference is generated from the docstrings (docs/guide/api.md), so every
    name of ``__all__`` has one, naming each of its arguments (a dataclass's fields may carry
    their own docstrings, an enum's members are its arguments)."""
    import lightning_protrain
    import protrain_core

    lacking = {f"{module.__name__}.{name}": missing for module in (protrain_core, lightning_protrain)
               for name in module.__all__ if (missing := _undocumented(getattr(module, name)))}
    assert lacking == {}
