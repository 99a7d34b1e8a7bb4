"""MkDocs hooks (mkdocs.yml): the guide's pages generated from the code, so that nothing is
written twice. A page asks for them with a marker line:

- ``<!-- configuration reference -->``: every field of ``ProTrainConfig`` and its parts, with its
  type, default and docstring (protrain_core/config.py, update.py, runtime/options.py);
- ``<!-- refusals -->``: every error the library raises with a message, by module, as the user
  reads it (placeholders where the message names a value);
- ``<!-- api reference -->``: every name of ``protrain_core.__all__`` and
  ``lightning_protrain.__all__``, for mkdocstrings to render from its docstring.

The functions read the source with ``ast`` (nothing is imported: the build needs no torch).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("protrain_core", "lightning_protrain", "ops")
CONFIG_CLASSES = (("protrain_core/config.py", "ProTrainConfig"), ("protrain_core/config.py", "PlanningConfig"),
                  ("protrain_core/update.py", "ClippingConfig"), ("protrain_core/runtime/options.py", "RuntimeConfig"),
                  ("protrain_core/config.py", "CheckpointConfig"))


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' signature
    if "<!-- configuration reference -->" in markdown:
        markdown = markdown.replace("<!-- configuration reference -->", configuration_reference())
    if "<!-- refusals -->" in markdown:
        markdown = markdown.replace("<!-- refusals -->", refusals_page())
    if "<!-- api reference -->" in markdown:
        markdown = markdown.replace("<!-- api reference -->", api_page())
    return markdown


def public_names(package: str) -> list[str]:
    """``package.__all__``, read from its ``__init__.py``."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__")
    return ast.literal_eval(node.value)


def api_page() -> str:
    out = []
    for package, title in (("protrain_core", "protrain_core: the engine"), ("lightning_protrain", "lightning_protrain: "
                                                                           "the Lightning strategies")):
        out += [f"## {title}", ""]
        out += [f"::: {package}.{name}\n" for name in sorted(public_names(package), key=str.lower)]
    return "\n".join(out)


# ----- the configuration reference ------------------------------------------------------------
def config_fields(path: str, name: str) -> tuple[str, list[tuple[str, str, str, str]]]:
    """A configuration class's docstring and its fields: (name, type, default, docstring)."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fields = []
    for node, after in zip(cls.body, cls.body[1:] + [None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if not isinstance(doc, str):
            raise ValueError(f"{path}: {name}.{node.target.id} has no docstring (the configuration reference is "
                             "generated from the fields' docstrings)")
        fields.append((node.target.id, ast.unparse(node.annotation), _default(node.value), doc))
    return ast.get_docstring(cls) or "", fields


def _default(value) -> str:
    if value is None:
        return "required"
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
        kw = {k.arg: k.value for k in value.keywords}
        if "default" in kw:
            return ast.unparse(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name):
            return f"{factory.id}()"
        env = re.search(r'env_flag\("(\w+)", (\w+)\)', ast.unparse(factory))
        if env:  # a default read from the environment: "not env_flag(...)" inverts it
            negated = ast.unparse(factory).startswith("lambda: not ")
            default = (env.group(2) == "True") != negated
            return f"{default} (environment: {env.group(1)})"
        return ast.unparse(factory)
    return ast.unparse(value)


def _markdown(doc: str) -> str:
    """A docstring as Markdown: reStructuredText's double backticks as code, paragraphs joined."""
    text = re.sub(r"``(.+?)``", r"`\1`", doc, flags=re.S)
    return "\n\n".join(" ".join(line.strip() for line in para.splitlines()) for para in text.split("\n\n"))


def configuration_reference() -> str:
    out = []
    for path, name in CONFIG_CLASSES:
        doc, fields = config_fields(path, name)
        out += [f"### {name}", "", _markdown(doc).split("\n\n")[0], ""]
        for field, kind, default, fdoc in fields:
            out += [f"**`{field}`**: `{kind}` = `{default}`", "", _markdown(fdoc), ""]
    return "\n".join(out)


# ----- every refusal --------------------------------------------------------------------------
def refusals() -> list[tuple[str, int, str, str]]:
    """Every ``raise`` of the library with a message: (file, line, exception, message template),
    in file order. A message built elsewhere is followed: a helper of the same module that
    returns it (or the error), a module constant ``.format``ted, a local variable assigned the
    text. A re-raise (``raise``, ``raise e``, ``raise error``) is not a refusal of its own."""
    trees = {path: ast.parse(path.read_text()) for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))}
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"):  # module-level functions
               {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)} for path, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        scope = _Scope(tree, modules)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                kind, message = scope.error(node.exc, _enclosing(tree, node))
                if kind is not None:
                    found.append((str(path.relative_to(ROOT)), node.lineno, kind, message))
    return sorted(found)


class _Scope:
    def __init__(self, tree: ast.Module, modules: dict[str, dict]) -> None:
        """The functions a message may come from: this module's own (methods included), and those
        it imports from other library modules (``from protrain_core.x import helper``)."""
        imported = {alias.asname or alias.name: modules[n.module][alias.name] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module in modules for alias in n.names
                    if alias.name in modules[n.module]}
        here = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.functions = {**imported, **here}
        self._resolving: set[str] = set()  # the variables being read (a message built from itself)
        self.constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Name)}

    def error(self, call: ast.Call, function) -> tuple[str | None, str]:
        """(exception name, message) of an exception built by ``call`` (None: not an error with a
        message of its own, e.g. a helper that returns another error)."""
        name = ast.unparse(call.func).split(".")[-1]
        if name in self.functions and not name[:1].isupper():  # a helper that builds the error
            returned = [r.value for r in ast.walk(self.functions[name]) if isinstance(r, ast.Return) and r.value]
            calls = [r for r in returned if isinstance(r, ast.Call)]
            if calls and ast.unparse(calls[0].func)[:1].isupper():
                return self.error(calls[0], self.functions[name])
            return None, ""
        if not call.args:
            return None, ""
        return name, self.text(call.args[0], function)

    def text(self, node, function) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else self.formatted(v.value, function) for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.text(node.left, function) + self.text(node.right, function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            return self.text(node.func.value, function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" \
                and isinstance(node.func.value, ast.Constant) and node.args:  # " ".join(parts)
            return node.func.value.value.join(filter(None, self.parts(node.args[0], function)))
        if isinstance(node, ast.List):
            return " ".join(filter(None, self.parts(node, function)))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in self.functions:  # a helper that returns the text
            helper = self.functions[ast.unparse(node.func)]
            texts = [self.text(r.value, helper) for r in ast.walk(helper) if isinstance(r, ast.Return) and r.value]
            return max(texts, key=len, default="")
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.text(self.constants[node.id], function)
        if isinstance(node, ast.Name) and function is not None:  # a local variable: its longest text
            return max(self.parts(node, function), key=len, default="")
        if isinstance(node, ast.IfExp):
            return max(self.text(node.body, function), self.text(node.orelse, function), key=len)
        return ""

    def formatted(self, value, function) -> str:
        """A value formatted into a message: a local variable holding a sentence of its own (a
        reason made by a helper) is that sentence; anything else, a placeholder naming it."""
        if isinstance(value, ast.Name) and function is not None:
            text = max(self.parts(value, function), key=len, default="")
            if len(text.split()) >= 4:
                return text
        return f"{{{_placeholder(value)}}}"

    def parts(self, node, function) -> list[str]:
        """The texts a list holds, or a local variable is given: its assignments' values (a list's
        items) and what is appended to it."""
        if isinstance(node, ast.List):
            return [self.text(e, function) for e in node.elts]
        if not (isinstance(node, ast.Name) and function is not None):
            return [self.text(node, function)]
        if node.id in self._resolving:  # msg = f"{msg} ...": its earlier text is read once
            return []
        self._resolving.add(node.id)
        out = []
        for n in ast.walk(function):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets):
                out += self.parts(n.value, function) if isinstance(n.value, ast.List) else [self.text(n.value, function)]
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append" \
                    and ast.unparse(n.func.value) == node.id and n.args:
                out.append(self.text(n.args[0], function))
        self._resolving.discard(node.id)
        return out


def _placeholder(node) -> str:
    """What a formatted value names, for a reader: ``format_bytes(self.budget)`` -> budget."""
    while True:
        if isinstance(node, ast.Call) and node.args:
            node = node.args[0]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            return node.attr
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return "..."


def _enclosing(tree: ast.Module, target: ast.AST):
    best = None
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= target.lineno <= n.end_lineno:
            if best is None or n.lineno > best.lineno:
                best = n
    return best


_ESCAPE = re.compile(r"([\\`*_\[\]<>|#])")


def refusals_page() -> str:
    """The list, by file; a message raised at several places of a file, once."""
    out, current, seen = [], None, set()
    for path, line, kind, message in refusals():
        if (path, kind, message) in seen:
            continue
        seen.add((path, kind, message))
        if path != current:
            out += ["", f"### {path}", ""]
            current = path
        text = " ".join(_ESCAPE.sub(r"\\\1", message).split())
        out += [f"- **{kind}** (line {line}): {text}"]
    return "\n".join(out).strip() + "\n"
