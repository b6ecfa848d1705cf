"""Each public face exports exactly what it defines (in the spirit of httpx's test).

For ``metaq`` and every public package face: every name in ``__all__`` exists, has
no duplicate, and every public attribute defined in the package (its ``__module__``
is the package or below it) that is not a submodule is in ``__all__``: a name a
user can import from the face without it being promised there is either an export
to list or a helper to rename with a leading underscore.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types

import pytest

import metaq

# (face, module that must be importable for it, or None)
FACES = [
    ("metaq", None),
    ("metaq.consumer", None),
    ("metaq.producer", None),
    ("metaq.broker", None),
    ("metaq.aio", None),
    ("metaq.spark", "pyspark"),
    ("metaq.testing", None),
    ("metaq.prometheus", "prometheus_client"),
    ("metaq.dashboard", "aiohttp"),
    ("zk_layout", None),
]

# Faces that break the rule today; the library fix removes the entry (strict xfail).
KNOWN_UNLISTED = {
}


def _face(name: str, needs: str | None) -> types.ModuleType:
    if needs is not None:
        pytest.importorskip(needs)
    return importlib.import_module(name)


def _defined_in(value: object, package: str) -> bool:
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and (module == package or module.startswith(package + "."))


@pytest.mark.parametrize(("name", "needs"), FACES, ids=[f for f, _ in FACES])
def test_all_names_exist_once(name: str, needs: str | None) -> None:
    face = _face(name, needs)
    exported = face.__all__
    assert [n for n in exported if not hasattr(face, n)] == []
    assert sorted({n for n in exported if exported.count(n) > 1}) == []


@pytest.mark.parametrize(
    ("name", "needs"),
    [pytest.param(f, n, id=f, marks=pytest.mark.xfail(reason=KNOWN_UNLISTED[f], strict=True))
     if f in KNOWN_UNLISTED else pytest.param(f, n, id=f) for f, n in FACES])
def test_public_members_defined_here_are_exported(name: str, needs: str | None) -> None:
    face = _face(name, needs)
    unlisted = sorted(
        member for member, value in vars(face).items()
        if not member.startswith("_")
        and not isinstance(value, types.ModuleType)
        and _defined_in(value, name)
        and member not in face.__all__)
    assert unlisted == []


def _own_doc(value: object) -> str | None:
    """The object's own docstring: not a base class's, not a dataclass's generated one."""
    doc = value.__doc__  # a class's __doc__ is never inherited (None when it has none)
    if doc and inspect.isclass(value) and dataclasses.is_dataclass(value):
        generated = value.__name__ + str(inspect.signature(value)).replace(" -> None", "")
        if doc == generated:
            return None
    return doc.strip() if doc else None


def test_exported_classes_and_functions_have_docstrings() -> None:
    undocumented = sorted(
        name for name in metaq.__all__
        if (inspect.isclass(value := getattr(metaq, name)) or inspect.isroutine(value))
        and not _own_doc(value))
    assert undocumented == []
