"""Writing a resolved spec back as YAML that our own (YAML 1.2) loader reads to the same values."""

from __future__ import annotations

from typing import Any

import yaml

from tessera.spec.source import _Loader


class _Dumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings our loader would read as non-strings (e.g. "1e-3")."""


for _first, _resolvers in _Loader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        _Dumper.add_implicit_resolver(_tag, _regexp, [_first])


def _list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flat = all(not isinstance(x, (list, dict)) for x in data)  # lists of scalars on one line
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _list)


def dump_yaml(data: dict[str, Any]) -> str:
    """Block-style YAML in the dict's own key order; scalar lists in flow style."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False,
                     width=100)
