"""The LoRA adapters served from start-up (vLLM's --lora-modules), and the ranks an adapter may have."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from tessera.errors import ConfigError

LORA_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


@dataclass(frozen=True)
class LoRAModule:
    """One adapter served from start-up (vLLM's --lora-modules): `name=path`, or the JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}` (the base name is informational)."""

    name: str
    path: str
    base_model_name: Optional[str] = None

    @classmethod
    def parse(cls, value: Any) -> "LoRAModule":
        if isinstance(value, LoRAModule):
            return value
        if isinstance(value, dict):
            fields_ = value
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                fields_ = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--lora-modules: {value!r} is not JSON: {exc}") from None
        elif isinstance(value, str) and "=" in value:
            name, path = value.split("=", 1)
            fields_ = {"name": name, "path": path}
        else:
            raise ConfigError(f"--lora-modules takes name=path or JSON with name and path, not {value!r}")
        unknown = set(fields_) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(fields_, dict):
            raise ConfigError(f"--lora-modules: unknown field(s) {', '.join(sorted(unknown))}")
        name, path = fields_.get("name"), fields_.get("path")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ConfigError(f"--lora-modules: {value!r} needs a non-empty name and path")
        return cls(name.strip(), path.strip(), fields_.get("base_model_name"))

