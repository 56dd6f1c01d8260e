"""Which model a request is for: its `model` (a model or an alias) resolved against the region
summaries document this gateway holds, into the models to try in order.

Worked out once per adopted document (`ModelRoutes.of`, from the router's `update`), so that a
request costs a dictionary lookup whatever the size of the catalog:

- a version 1 document (a control plane that predates models): model-blind. The name goes
  upstream as it came and every region is planned for, as before.
- version 2 with a catalog that lists models: the catalog's models and aliases
  (wire/model_catalog.py); an alias resolves to its model, whose name is what its nodes serve it
  under. A request for a listed model that no region serves has no capacity (its fallbacks are
  tried), not an unknown name.
- version 2 with an empty catalog: every model some region lists is routable under its served
  name, with no aliases and no fallbacks.

An unknown name is a 404 (`model_not_found`) naming up to `MAX_NAMED` names the key may use; a
name the key may not use a 403 (`model_not_allowed`). A key limited to a list of names may send
a name that the list holds, or whose model it holds; it may be answered by a fallback whose
model or one of whose aliases the list holds (the others are skipped). Both are decided before
admission: a refused request spends no rate limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from gateway.errors import ModelNotAllowedError, ModelNotFoundError
from gateway.keys import ApiKey
from wire.model_catalog import CatalogIndex, ModelCatalog
from wire.region_summary import RegionSummaryIndex

MAX_NAMED: Final = 10  # names a 404 lists
MAX_NAME_SHOWN: Final = 128  # characters of a client's name an error repeats (a name's limit)
# Upstream answers that say a region has no room for the request now: the node's waiting queue
# is full (429, also when deflected) or it is not ready, draining or dead (503).
CAPACITY_STATUSES: Final = frozenset((429, 503))
P = TypeVar("P")  # a plan: the gateway's RoutePlan, the simulator's picks


def is_out_of_capacity(status: int) -> bool:
    """Whether an answer, the last of every region tried for a model, means the model has no
    capacity reachable now (its next fallback is tried) rather than an answer to pass on."""
    return status in CAPACITY_STATUSES


def in_turn(
    models: Sequence[str],
    plan_of: Callable[[str], P],
    has_capacity: Callable[[str, P], bool],
) -> Iterator[tuple[str, P]]:
    """`models` (a request's model, then its fallbacks) with their plans, in the order to try
    them: each model whose plan has capacity, when its turn comes (planned then, after the
    attempts before it); then the models whose plans had none, in order, with those plans (the
    regions left to the request once every model with capacity has refused it). The gateway
    (gateway/dispatch.py) and the simulator (simulator/flow.py) both take their turns here."""
    put_off: list[tuple[str, P]] = []
    for model in models:
        plan = plan_of(model)
        if has_capacity(model, plan):
            yield model, plan
        else:
            put_off.append((model, plan))
    yield from put_off


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a request is routed as."""

    # The models to try in order: the one asked for, then the fallbacks the key may use. A
    # model-blind choice holds the request's name alone.
    models: tuple[str, ...]
    is_model_aware: bool  # False: plan over every region, send the name as it came
    # The key's limits on the model (`ApiKey.model_limits`), keyed by its name or, failing
    # that, by an alias that names it in this document; None: it has none there.
    limits: ApiKey | None = None

    @property
    def model(self) -> str:
        return self.models[0]


@dataclass(frozen=True, slots=True)
class ModelRoutes:
    """The names a client may send in one document, and what each resolves to."""

    is_model_aware: bool
    # Every routable name (a model or an alias) -> its model.
    model_of: dict[str, str]
    # Model -> itself, then its fallbacks, in order (for a key that may use every model).
    tries_of: dict[str, tuple[str, ...]]
    aliases_of: dict[str, tuple[str, ...]]  # model -> the aliases that lead to it
    names: tuple[str, ...]  # `model_of`'s keys, sorted (what a 404 lists from)
    catalog: ModelCatalog | None = None  # the non-empty catalog these came from

    @classmethod
    def blind(cls) -> ModelRoutes:
        return cls(False, {}, {}, {}, ())

    @classmethod
    def of(cls, document: RegionSummaryIndex, previous: ModelRoutes | None = None) -> ModelRoutes:
        """The routes of `document`; `previous` (the last document's) is kept when the names
        it routes are the same, as from one summary to the next they nearly always are."""
        if not document.is_model_aware:
            return cls.blind()
        catalog = document.catalog
        if catalog is not None and not catalog.is_empty:
            if previous is not None and previous.catalog == catalog:
                return previous
            return cls._of_catalog(catalog)
        served = {model.name for region in document.regions for model in region.models}
        if (
            previous is not None
            and previous.is_model_aware
            and previous.catalog is None
            and served == previous.model_of.keys()
        ):
            return previous
        return cls(
            True,
            {name: name for name in served},
            {name: (name,) for name in served},
            {},
            tuple(sorted(served)),
        )

    @classmethod
    def _of_catalog(cls, catalog: ModelCatalog) -> ModelRoutes:
        index = CatalogIndex.of(catalog)
        tries_of = {model: (model, *index.fallbacks_of[model]) for model in index.models}
        names = tuple(sorted(index.model_of))
        return cls(True, index.model_of, tries_of, index.aliases_of, names, catalog)

    def resolve(self, name: str, key: ApiKey) -> ModelChoice:
        """The models to try for a request naming `name` with `key`; ModelNotFoundError (404)
        or ModelNotAllowedError (403) when there are none."""
        if not self.is_model_aware:
            if not key.may_use(name):
                raise _not_allowed(name)
            return ModelChoice((name,), False, key.model_limits.get(name))
        model = self.model_of.get(name)
        if model is None:
            raise self.not_found(name, key)
        limits = self._limits_on(key, model) if key.model_limits else None
        if key.models is None:
            return ModelChoice(self.tries_of[model], True, limits)
        if not (key.may_use(name) or key.may_use(model)):
            raise _not_allowed(name)
        model, *fallbacks = self.tries_of[model]
        usable = [fallback for fallback in fallbacks if self._may_use_model(key, fallback)]
        return ModelChoice((model, *usable), True, limits)

    def _limits_on(self, key: ApiKey, model: str) -> ApiKey | None:
        """The key's limits keyed by `model`, else by the first of its aliases (sorted) that
        has some: an alias's limits follow it to whatever model it names now."""
        limits = key.model_limits.get(model)
        if limits is None:
            for alias in self.aliases_of.get(model, ()):
                limits = key.model_limits.get(alias)
                if limits is not None:
                    break
        return limits

    def _may_use_model(self, key: ApiKey, model: str) -> bool:
        """Whether the key's list holds `model` or one of its aliases."""
        return key.may_use(model) or any(map(key.may_use, self.aliases_of.get(model, ())))

    def usable_names(self, key: ApiKey, limit: int = MAX_NAMED) -> list[str]:
        """Up to `limit` names `key` may send, sorted."""
        usable: list[str] = []
        for name in self.names:
            if key.may_use(name) or key.may_use(self.model_of[name]):
                usable.append(name)
                if len(usable) == limit:
                    break
        return usable

    def not_found(self, name: str, key: ApiKey) -> ModelNotFoundError:
        """The 404 for `name`, naming up to `MAX_NAMED` names `key` may use."""
        usable = self.usable_names(key, MAX_NAMED + 1)
        if usable:
            end = ", ..." if len(usable) > MAX_NAMED else "."
            known = f" Models you may use: {', '.join(usable[:MAX_NAMED])}{end}"
        else:
            known = " This key may use no model here."
        return ModelNotFoundError(
            f"The model {_shown(name)} does not exist.{known}", "model_not_found", param="model"
        )


def _not_allowed(name: str) -> ModelNotAllowedError:
    return ModelNotAllowedError(
        f"This API key may not use the model {_shown(name)}.", "model_not_allowed", param="model"
    )


def _shown(name: str) -> str:
    """A client's name as an error repeats it: no longer than a model name may be."""
    if len(name) > MAX_NAME_SHOWN:
        return repr(name[:MAX_NAME_SHOWN]) + "..."
    return repr(name)
