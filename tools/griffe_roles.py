"""A griffe extension for the API reference (``make docs``): Sphinx roles in docstrings become links.

The docstrings name other objects the way Sphinx does (``:class:`Plan```, ``:meth:`step```,
``:func:`gradroute.checkpoint```); mkdocstrings renders Markdown, where a role stays literal text. This rewrites
each role into a cross-reference to the object's entry in the API reference (``[`Plan`][gradroute.Plan]``)
where the object is public (a member of a name in ``gradroute.__all__``, without a leading underscore) and
into plain code otherwise, so that a link never points at a page the site does not have.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):`(~?)([\w.]+?)(\(\))?`")


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        exports = {str(name) for name in pkg.exports or ()}
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _ROLE.sub(lambda m, o=obj: _link(m, o, pkg, exports), obj.docstring.value)

    on_package_loaded = on_package  # the event's name before griffe 1.14


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined in it, aliases left out (their targets are walked where defined)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))  # type: ignore[arg-type]
    return found


def _link(match: re.Match[str], obj: griffe.Object, pkg: griffe.Module, exports: set[str]) -> str:
    short, name, call = match.group(1), match.group(2), match.group(3) or ""
    text = (name.rsplit(".", 1)[-1] if short else name) + call
    name = name.removeprefix(pkg.name + ".")
    owner = obj if obj.is_class else obj.parent
    scopes = [""]
    if owner is not None and owner.is_class and owner.name in exports:
        scopes.insert(0, owner.name + ".")  # a method named from its class: :meth:`step`
    if obj.module.name == "schedules" or (obj.parent is not None and obj.parent.name == "schedules"):
        scopes.append("schedules.")
    for scope in scopes:
        path = scope + name
        parts = path.split(".")
        if parts[0] in exports and not any(p.startswith("_") for p in parts) and _exists(pkg, path):
            return f"[`{text}`][{pkg.name}.{path}]"
    return f"`{text}`"


def _exists(pkg: griffe.Module, path: str) -> bool:
    try:
        pkg[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True
