"""`_core.pyi` describes the compiled `phalanx._core` as it is: the same public names,
the same parameters with the same defaults, and examples that run."""

from __future__ import annotations

import ast
import doctest
import inspect
from pathlib import Path

import pytest

from phalanx import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
TREE = ast.parse(STUB.read_text())
NO_DEFAULT = inspect.Parameter.empty


def public(name: str) -> bool:
    return not name.startswith("_")


def stub_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


MODULE = stub_names(TREE.body)
CLASSES = {name: node for name, node in MODULE.items() if isinstance(node, ast.ClassDef)}
FUNCTIONS = {name: node for name, node in MODULE.items() if isinstance(node, ast.FunctionDef)}


def value(node: ast.expr) -> object:
    """A default as the stub writes it: a literal or a constant expression (4 << 20)."""
    return eval(compile(ast.Expression(node), str(STUB), "eval"), {"__builtins__": {}})


def stub_parameters(node: ast.FunctionDef, method: bool) -> list[tuple[str, object]]:
    """(name, default) of each parameter the stub gives, `self` left out."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [NO_DEFAULT] * (len(positional) - len(args.defaults)) + [
        value(d) for d in args.defaults
    ]
    params = list(zip([a.arg for a in positional], defaults, strict=True))
    params += [
        (a.arg, NO_DEFAULT if d is None else value(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return params[1:] if method else params


def runtime_parameters(obj: object) -> list[tuple[str, object]] | None:
    """(name, default) of each parameter, where the compiled object tells. A default
    the bindings compute (pyo3 shows it as `...`) matches whatever the stub says."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [
        (p.name, p.default)
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
    ]


def same(compiled: list[tuple[str, object]], described: list[tuple[str, object]]) -> bool:
    return len(compiled) == len(described) and all(
        c[0] == d[0] and (c[1] is Ellipsis or c[1] == d[1])
        for c, d in zip(compiled, described, strict=True)
    )


def test_the_stub_and_the_module_name_the_same_things():
    compiled = {name for name in dir(_core) if public(name)}
    described = {name for name in MODULE if public(name)}
    assert compiled - described == set(), "compiled but missing from _core.pyi"
    assert described - compiled == set(), "in _core.pyi but not compiled"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_function_takes_what_the_stub_says(name):
    compiled = runtime_parameters(getattr(_core, name))
    assert compiled is not None, f"{name} has no signature to compare"
    described = stub_parameters(FUNCTIONS[name], method=False)
    assert same(compiled, described), f"compiled {compiled}, _core.pyi {described}"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_class_has_what_the_stub_says(name):
    cls = getattr(_core, name)
    members = stub_names(CLASSES[name].body)
    compiled = {m for m in vars(cls) if public(m)}
    described = {m for m in members if public(m)}
    assert compiled - described == set(), f"{name}: compiled but missing from _core.pyi"
    for member, node in members.items():
        assert hasattr(cls, member), f"{name}.{member} is in _core.pyi but not compiled"
        if not isinstance(node, ast.FunctionDef) or any(
            isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
        ):
            continue
        target = cls if member == "__init__" else getattr(cls, member)
        compiled_params = runtime_parameters(target)
        if compiled_params is not None and member not in ("__enter__", "__exit__"):
            described = stub_parameters(node, method=True)
            assert same(compiled_params, described), (
                f"{name}.{member}: compiled {compiled_params}, _core.pyi {described}"
            )


def docstrings() -> list[tuple[str, str, int]]:
    """(name, docstring, line) of every docstring in the stub."""
    found = []
    for node in ast.walk(TREE):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, child in enumerate(body):
            if not (
                isinstance(child, ast.Expr)
                and isinstance(child.value, ast.Constant)
                and isinstance(child.value.value, str)
            ):
                continue
            owner = getattr(node, "name", None)
            if owner is None and i > 0:  # a module constant's docstring follows it
                target = getattr(body[i - 1], "target", None)
                owner = getattr(target, "id", "_core")
            found.append((owner or "_core", child.value.value, child.lineno))
    return found


EXAMPLES = [(name, text, line) for name, text, line in docstrings() if ">>>" in text]


def test_the_stub_has_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize(("name", "text", "line"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_the_stub_examples_run(name, text, line):
    globs = {n: getattr(_core, n) for n in dir(_core)}
    test = doctest.DocTestParser().get_doctest(text, globs, name, str(STUB), line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: an example in _core.pyi failed (see the output)"


def test_keywords_read_into_structs_are_checked_by_name():
    """A binding that reads its keywords into structs (rust/src/python/keywords.rs)
    refuses a name none of them takes, and names the keyword whose value is wrong."""
    unexpected = r"LighthouseServer\(\) got an unexpected keyword argument 'join_timout'"
    with pytest.raises(TypeError, match=unexpected):
        _core.LighthouseServer(join_timout=0.1)
    with pytest.raises(TypeError, match="argument 'join_timeout'"):
        _core.LighthouseServer(join_timeout="soon")
