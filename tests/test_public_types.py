"""Every public signature is annotated: the functions, classes and methods exported by
``metaq``, ``metaq.aio``, ``metaq.spark`` and ``zk_layout`` (the packages' faces) declare a
type for each parameter and their return (``__init__`` excepted, which returns None).

This is what makes the strict type check in CI (``[tool.mypy]`` in pyproject.toml,
tests/typecheck/public_api.py) mean something for every export, not only those the typed use
calls: an unannotated export is ``Any`` to an application's ``mypy --strict``."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator

import pytest

FACES = [("metaq", None), ("metaq.aio", None), ("metaq.spark", "pyspark"), ("zk_layout", None)]


def _callables(face: str) -> Iterator[tuple[str, Callable[..., object]]]:
    mod = importlib.import_module(face)
    for name in mod.__all__:
        obj = getattr(mod, name)
        if inspect.isfunction(obj):
            yield f"{face}.{name}", obj
        elif inspect.isclass(obj) and obj.__module__.split(".")[0] in ("metaq", "zk_layout"):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__call__"):
                    continue
                fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) \
                    else member.fget if isinstance(member, property) else member
                if inspect.isfunction(fn) and fn.__module__.split(".")[0] in ("metaq",
                                                                             "zk_layout"):
                    yield f"{face}.{name}.{attr}", fn


def _missing(fn: Callable[..., object]) -> list[str]:
    notes = fn.__annotations__
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    out = [p.name for p in params if p.name not in notes]
    if "return" not in notes and fn.__name__ != "__init__":
        out.append("return")
    return out


@pytest.mark.parametrize("face,needs", FACES, ids=[f for f, _ in FACES])
def test_every_exported_signature_is_annotated(face: str, needs: str | None) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    bad = {name: missing for name, fn in _callables(face) if (missing := _missing(fn))}
    assert not bad, f"exported without annotations (parameter or 'return'): {bad}"
