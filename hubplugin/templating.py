"""The Jinja2 environment of every page the hub side renders (the spawn form, the GPU page).

One rule for all of them: an admin's directories (``template_paths``) are searched first, so a
file of the same name replaces a packaged template; the packaged templates are also reachable
under the prefix ``swarm_gpu/``, so an admin's file may ``{% extends "swarm_gpu/NAME" %}`` and
replace one block. Autoescape is on and every ``{{ value }}`` is escaped as :func:`html.escape`
does; undefined names are errors, not empty strings.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from html import escape

import jinja2
from markupsafe import Markup


@functools.lru_cache(maxsize=16)
def _environment(template_paths: tuple[str, ...]) -> jinja2.Environment:
    packaged = jinja2.PackageLoader("hubplugin", "templates")
    return jinja2.Environment(
        loader=jinja2.ChoiceLoader([
            jinja2.FileSystemLoader(list(template_paths)),
            packaged,
            # the packaged template under a name of its own, for an admin's {% extends %}
            jinja2.PrefixLoader({"swarm_gpu": packaged}),
        ]),
        autoescape=True,
        finalize=_escape,
        undefined=jinja2.StrictUndefined,
    )


def template(name: str, template_paths: Sequence[str] = ()) -> jinja2.Template:
    """The template ``name``: an admin's file in ``template_paths`` first, else the packaged."""
    return _environment(tuple(template_paths)).get_template(name)


def _escape(value: object) -> Markup:
    """Every ``{{ value }}`` escaped as :func:`html.escape` does (``&quot;`` for ``"``)."""
    if isinstance(value, Markup):
        return value
    return Markup(escape(str(value), quote=True))


def format_mib(mib: int | None) -> str:
    """8192 -> '8 GiB', 1536 -> '1.5 GiB', 900 -> '900 MiB'."""
    if mib is None:
        return "?"
    if mib >= 1024:
        gib = mib / 1024
        return f"{gib:.0f} GiB" if gib == int(gib) or gib >= 100 else f"{gib:.1f} GiB"
    return f"{mib} MiB"
