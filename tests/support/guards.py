"""Fingerprints of a library's private code, for the guard tests of what we borrow.

A guard table maps a dotted name (``package.module.Class.method``) to the first 16 hex
digits of the sha256 of its source. A name is resolved by importing its longest importable
prefix and reading attributes statically (a property is its getter, a static or class method
its function), so the table names exactly the code that is read.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Mapping


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            obj = inspect.getattr_static(obj, attr)
            if isinstance(obj, property):
                obj = obj.fget
            elif isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
        return obj
    raise ImportError(dotted)


def fingerprint(dotted: str) -> str:
    return fingerprint_of(resolve(dotted))


def fingerprint_of(obj: object) -> str:
    source = inspect.getsource(obj)  # type: ignore[arg-type]
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def changed(
    table: Mapping[str, str], originals: Mapping[str, object] | None = None
) -> dict[str, str]:
    """The entries of `table` whose source is not the one fingerprinted: name -> new hash.
    `originals` holds what a name was before we replaced it in place (those are hashed)."""
    originals = originals or {}
    now = {
        name: fingerprint_of(originals[name]) if name in originals else fingerprint(name)
        for name in table
    }
    return {name: digest for name, digest in now.items() if digest != table[name]}
