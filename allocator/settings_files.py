"""How a process reads its settings: pydantic-settings' own sources, and the TOML file.

The allocator (:class:`allocator.config.AllocatorSettings`) and the node agent
(:class:`nodeagent.config.AgentSettings`) read their settings alike. Precedence, highest
first, is the order of the sources :class:`FileSettings` gives pydantic-settings:

1. keyword arguments (the node agent's command line arrives this way),
2. the environment (each class's ``env_prefix``),
3. the TOML file named by the ``config`` setting,
4. the field defaults.

``config`` is a setting like the others, found by the sources above the file: an argument
(``--config``) or the environment (``SWARM_GPU_CONFIG``, ``SWARM_GPU_AGENT_CONFIG``). A named
file that does not exist is an error, not an empty file. :func:`settings_error_line` says
what is wrong with bad settings in one line; :func:`list_from_text` reads a list setting
given as text (fields marked ``NoDecode``).
"""

from __future__ import annotations

import errno
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

__all__ = ["FileSettings", "NamedTomlFile", "list_from_text", "settings_error_line"]


class NamedTomlFile(PydanticBaseSettingsSource):
    """The TOML file that the ``config`` setting of the sources above it names."""

    def __init__(
        self, settings_cls: type[BaseSettings], namers: tuple[PydanticBaseSettingsSource, ...]
    ) -> None:
        super().__init__(settings_cls)
        self._namers = namers

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Not used: __call__ reads the whole file at once.
        return None, field_name, False

    def file(self) -> Path | None:
        """The file named by the highest source that names one (None: no file)."""
        for source in self._namers:
            named = source().get("config")
            if named:
                return Path(named)
        return None

    def __call__(self) -> dict[str, Any]:
        path = self.file()
        if path is None:
            return {}
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "settings file not found", str(path))
        return TomlConfigSettingsSource(self.settings_cls, toml_file=path)()


class FileSettings(BaseSettings):
    """Settings read from arguments, then the environment, then a TOML file, then defaults."""

    config: Path | None = Field(
        default=None,
        exclude=True,
        description="TOML settings file; the environment and the command line override it.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env file and no secrets directory: a deployment passes the environment or a file.
        file = NamedTomlFile(settings_cls, (init_settings, env_settings))
        return init_settings, env_settings, file


def list_from_text(value: Any) -> Any:
    """A list setting given as text (an environment variable, a flag): comma separated,
    ``48,79``, or JSON, ``[48, 79]``. Anything else is left for the field to validate."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def settings_error_line(exc: Exception) -> str:
    """One line saying what is wrong with the settings (a bad value, a bad or missing file)."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False)
        parts = []
        for err in errors[:5]:
            where = ".".join(str(part) for part in err["loc"])
            message = str(err["msg"]).removeprefix("Value error, ")
            value = err.get("input")
            got = f" (got {value!r})" if where and isinstance(value, str | int | float) else ""
            parts.append(f"{where + ': ' if where else ''}{message}{got}")
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        return "; ".join(parts) + more
    if isinstance(exc, tomllib.TOMLDecodeError):
        return f"the settings file is not valid TOML: {exc}"
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
