"""Request and response bodies of the key routes (`/v1/keys`): a key's limits, the models it
may use, its token budget, and its spend.

A budget is `max_budget_tokens` over `budget_period`, written `<N><unit>` with unit `s`, `m`, `h`
or `d` (`"1d"`, `"30d"`, `"12h"`, `"3600s"`). Periods start at whole multiples of the period
since 1970-01-01 UTC: `"1d"` resets at 00:00 UTC, `"1h"` on the hour.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)

from control_plane.schemas import Label
from wire.key_snapshot import (
    MAX_BUDGET_PERIOD_S,
    MAX_MODEL_LIMITS,
    MAX_RPM,
    MAX_TPM,
    PERIOD_UNITS_S,
    ModelLimit,
    period_text,
)
from wire.model_catalog import ModelName

MAX_KEY_MODELS: Final = 1000
MAX_BUDGET_TOKENS: Final = 10**15
_PERIOD = re.compile(r"^([1-9][0-9]{0,8})([dhms])$")


def period_seconds(text: object) -> object:
    """`"30d"` -> 2,592,000; anything else is left for the field's checks to refuse."""
    if isinstance(text, str):
        match = _PERIOD.match(text)
        if match is None:
            raise ValueError(
                "a period is a whole number and a unit: s, m, h or d (e.g. '1d', '30d', '12h')"
            )
        return int(match[1]) * PERIOD_UNITS_S[match[2]]
    if isinstance(text, int) and not isinstance(text, bool):
        raise ValueError("a period is a string such as '1d', '30d', '12h' or '3600s'")
    return text


# A period as shown: held as seconds, written as operators write it.
PeriodText = Annotated[
    int,
    PlainSerializer(period_text, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["1d", "30d", "12h"]}),
]
# A period as operators write it.
BudgetPeriod = Annotated[
    PeriodText, BeforeValidator(period_seconds), Field(ge=1, le=MAX_BUDGET_PERIOD_S)
]
ModelList = Annotated[list[ModelName], Field(max_length=MAX_KEY_MODELS)]
ModelLimits = Annotated[dict[ModelName, ModelLimit], Field(max_length=MAX_MODEL_LIMITS)]
BudgetTokens = Annotated[int, Field(ge=1, le=MAX_BUDGET_TOKENS)]


class KeyAccess(BaseModel):
    """What a key may use beyond its overall limits (create and patch share these fields)."""

    model_config = ConfigDict(extra="forbid")

    models: ModelList | None = Field(
        default=None, description="model and alias names the key may use (null: every one)"
    )
    model_limits: ModelLimits | None = Field(
        default=None,
        description="model -> {rpm, tpm}, on top of the key's overall limits (an alias's "
        "apply to the model it names now)",
    )
    max_budget_tokens: BudgetTokens | None = Field(
        default=None, description="tokens (prompt + completion) per budget_period"
    )
    budget_period: BudgetPeriod | None = Field(
        default=None, description="'<N><unit>', unit s, m, h or d; periods start at the epoch"
    )

    @model_validator(mode="after")
    def _budget_whole(self) -> KeyAccess:
        given = {"max_budget_tokens", "budget_period"} & self.model_fields_set
        if given and (
            len(given) == 1 or (self.max_budget_tokens is None) != (self.budget_period is None)
        ):
            raise ValueError(
                "give max_budget_tokens and budget_period together (both null to clear the budget)"
            )
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> KeyAccess:
        if self.models is not None and len(set(self.models)) != len(self.models):
            raise ValueError("models lists a name twice")
        return self


class KeyCreate(KeyAccess):
    name: Label
    tenant: Label | None = None
    rpm: int = Field(ge=1, le=MAX_RPM, description="requests per minute")
    tpm: int = Field(ge=1, le=MAX_TPM, description="tokens per minute")


class KeyPatch(KeyAccess):
    """Fields to change; null clears `models` (every model), `model_limits` and the budget (both
    of its fields together). At least one field."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    @model_validator(mode="after")
    def _not_empty(self) -> KeyPatch:
        if not self.model_fields_set:
            raise ValueError(
                "give at least one of models, model_limits, max_budget_tokens with budget_period"
            )
        return self


class KeyView(BaseModel):
    id: str
    name: str
    tenant: str | None
    rpm: int
    tpm: int
    models: list[str] | None = None
    model_limits: dict[str, ModelLimit] = Field(default_factory=dict)
    max_budget_tokens: int | None = None
    budget_period: PeriodText | None = None
    created_at: float
    revoked_at: float | None


class KeyCreated(KeyView):
    secret: str = Field(description="the API key itself; shown only in this response")


class KeyList(BaseModel):
    keys: list[KeyView]


class KeySpend(BaseModel):
    """A key's spend in its current period (a key without a budget: the current UTC day)."""

    key: str
    period_start: float  # unix seconds
    period_end: float
    budget_period: PeriodText
    max_budget_tokens: int | None  # None: no budget
    spent_tokens: int
    remaining_tokens: int | None  # None: no budget; 0 once spent (the key is refused)
    models: dict[str, int]  # model -> tokens spent in the period
