"""The base of the OpenAI API schemas: requests validate strictly and ignore unknown fields;
stream chunks leave out their unset fields."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class OpenAIModel(BaseModel):
    # strict: `true` is not a max_tokens and "0.5" is not a temperature (ints still pass as floats)
    model_config = ConfigDict(extra="ignore", strict=True)


class SparseModel(OpenAIModel):
    """Serialized without its unset (None) fields, as OpenAI's stream chunks are."""

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
