"""A component's config built from a service's settings, field by field of the same name.

Components take a small frozen dataclass (`RouterConfig`, `ConnectionLimits`), not the whole
settings object; where every field of the config is a setting of the same name and meaning, it
is copied by name here rather than by a hand-written list that must follow each new field.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def config_from(config: type[C], settings: object) -> C:
    """`config` with each of its fields set from the attribute of the same name of `settings`
    (AttributeError: one is missing)."""
    return config(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(config)})
