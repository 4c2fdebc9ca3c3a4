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
file that does not exist is an error, not an empty file.

The file is strict, as what people type must be: a key that is no setting, or a value of the
wrong type for its setting (TOML's own types: ``"300"`` is no number, ``"yes"`` no boolean),
is a :class:`SettingsFileError` that names the file, the line, the key (a dotted path inside a
table) and, for an unknown key, the nearest setting (``bind_timeout: unknown key; did you
mean bind_timeout_s?``). The environment stays tolerant: variables of other programs may
share its prefix (``SWARM_GPU_AGENT_*`` begins with the allocator's ``SWARM_GPU_``).

:func:`settings_error_line` says what is wrong with bad settings in one line;
:func:`list_from_text` reads a list setting given as text (fields marked ``NoDecode``).
:func:`settings_help` and :func:`setting_help` are the ``--help`` of the settings: each
one's description, default and environment variable, from the fields themselves, so the help
cannot drift from the code.

Secrets from files: a setting that holds a password (or a URL with one) has a companion
``<name>_file`` (:func:`secret_file_field`), e.g. ``amqp_url_file`` /
``SWARM_GPU_AMQP_URL_FILE=/run/secrets/allocator-amqp-url``. :class:`SecretFiles` reads it:
the file's content with its trailing newline stripped becomes the setting, so the secret
never sits in an environment variable, a command line or ``docker inspect``. The pair is one
setting as far as precedence goes (:class:`SecretsNotShadowed`): ``SWARM_GPU_AMQP_URL`` in the
environment overrides ``amqp_url_file`` in the TOML file. Both from one source is an error, as
is a file that cannot be read (:func:`secret_from_file`). The GPU page's
settings and the spawner's ``allocator_url_file`` use the same functions.
"""

from __future__ import annotations

import difflib
import errno
import functools
import json
import os
import re
import textwrap
import tomllib
from collections.abc import Collection, Mapping
from datetime import date, datetime, time
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

__all__ = [
    "FileSettings",
    "NamedTomlFile",
    "SecretFiles",
    "SecretsNotShadowed",
    "SettingsFileError",
    "environ_secret",
    "in_file",
    "key_lines",
    "keys_at",
    "list_from_text",
    "model_problems",
    "secret_file_field",
    "secret_from_file",
    "setting_help",
    "setting_or_file",
    "settings_error_line",
    "settings_file_problems",
    "settings_help",
]

SECRET_FILE_OF = "secret_file_of"
"""Key in a ``*_file`` field's ``json_schema_extra``: the name of the setting it holds."""


def secret_from_file(path: str | Path, name: str) -> str:
    """The content of ``path`` with its trailing newline stripped: the value of ``name``.

    Raises :class:`ValueError` with one line naming the setting and the file when it cannot
    be read or is empty; the content is never part of a message.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"{name}: cannot read {path}: {why}") from None
    # Only the newline an editor or `echo` adds: other whitespace may be part of a password.
    value = text.removesuffix("\n").removesuffix("\r")
    if not value:
        raise ValueError(f"{name}: {path} is empty")
    return value


def setting_or_file(name: str, value: str | None, path: str | Path | None) -> str | None:
    """``value``, or the content of ``path`` (one of them, never both: that is an error)."""
    if path is None or path == "":
        return value
    if value is not None and value != "":
        raise ValueError(f"set {name} or {name}_file, not both")
    return secret_from_file(path, f"{name}_file")


def environ_secret(variable: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable ``variable``, or the content of the file that
    ``<variable>_FILE`` names (the command-line clients' ``SWARM_GPU_AMQP_URL_FILE``);
    None when neither is set. Both set, or a file that cannot be read: :class:`ValueError`."""
    env = os.environ if environ is None else environ
    value, path = env.get(variable) or None, env.get(f"{variable}_FILE") or None
    if path is None:
        return value
    if value is not None:
        raise ValueError(f"set {variable} or {variable}_FILE, not both")
    return secret_from_file(path, f"{variable}_FILE")


def secret_file_field(of: str) -> Any:
    """The field ``<of>_file``: a file holding the setting ``of`` (a password or a URL with
    one), read by :class:`SecretFiles`."""
    return Field(
        default=None,
        exclude=True,
        json_schema_extra={SECRET_FILE_OF: of},
        description=f"A file holding {of} (a Docker secret, e.g. /run/secrets/...), its "
        f"trailing newline stripped: keeps the secret out of the environment and the "
        f"command line. Not together with {of}.",
    )


class SecretFiles(BaseSettings):
    """Settings with ``*_file`` companions (:func:`secret_file_field`): each file is read
    in place of its setting, whichever source (argument, environment, TOML) named it."""

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for field_name, info in cls.model_fields.items():
            extra = info.json_schema_extra
            of = extra.get(SECRET_FILE_OF) if isinstance(extra, dict) else None
            if not isinstance(of, str) or data.get(field_name) in (None, ""):
                continue
            data = {**data, of: setting_or_file(of, data.get(of), data[field_name])}
        return data


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
        text = path.read_text(encoding="utf-8")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsFileError(f"{path}: not valid TOML: {exc}") from None
        problems = settings_file_problems(self.settings_cls, data, text)
        if problems:
            raise SettingsFileError(in_file(path, problems))
        return data


class SettingsFileError(ValueError):
    """A settings file that cannot be read as its settings: not TOML, a key that is no
    setting, a value of the wrong type. The message is one line naming the file, the line
    and the key of each problem."""


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_KEY_PART = re.compile(r"""\s*(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*""")


def _key_parts(text: str) -> tuple[str, ...] | None:
    """The parts of a TOML key (``a."b c".d``), or None where ``text`` is not a whole key."""
    parts: list[str] = []
    at = 0
    while True:
        match = _KEY_PART.match(text, at)
        if match is None:
            return None
        double, single, bare = match.groups()
        parts.append(double if double is not None else single if single is not None else bare)
        at = match.end()
        if at == len(text):
            return tuple(parts)
        if text[at] != ".":
            return None
        at += 1


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Line number (from 1) of each key and table header of a TOML text, by dotted path.

    Enough of TOML for an error message: keys and headers each on their own line, which is
    how settings files are written; a key it cannot place is reported without a line. The
    tables of an array (``[[nodes]]``) are numbered from 0 as pydantic places an error
    (``nodes.1.roles``)."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    arrays: dict[tuple[str, ...], int] = {}  # each array of tables' last index so far
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[(\[?)(.+?)\]\]?\s*(?:#.*)?", stripped)
        if header:
            named = _key_parts(header.group(2)) or ()
            table = ()
            for at, part in enumerate(named, start=1):
                table += (part,)
                if table in arrays and not (header.group(1) and at == len(named)):
                    table += (str(arrays[table]),)  # inside the array's latest table
            if header.group(1):
                array = table
                lines.setdefault(array, number)
                arrays[array] = arrays.get(array, -1) + 1
                table = (*array, str(arrays[array]))
            lines.setdefault(table, number)
            continue
        key, equals, _ = stripped.partition("=")
        parts = _key_parts(key.rstrip()) if equals and not stripped.startswith("#") else None
        if parts:
            lines.setdefault(table + parts, number)
    return lines


def _dotted(path: tuple[str | int, ...]) -> str:
    """A key path as TOML writes it: ``share_slots."NVIDIA A100"``."""
    return ".".join(str(part) if _BARE_KEY.fullmatch(str(part)) else json.dumps(str(part))
                    for part in path)


@functools.cache
def _file_value_adapter(settings_cls: type[BaseSettings], name: str) -> TypeAdapter[Any]:
    info = settings_cls.model_fields[name]
    annotation: Any = info.annotation
    return TypeAdapter(Annotated[annotation, *info.metadata] if info.metadata else annotation)


def _json_ready(value: Any) -> Any:
    """TOML's dates and times as ISO text, so a value can be checked as JSON input."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_ready(item) for item in value]
    return value


def _members(annotation: Any) -> list[Any]:
    """The types ``annotation`` may be: a union's members, an ``Annotated``'s type."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def _inside(annotation: Any, part: str | int) -> list[Any]:
    """The types of what ``part`` names inside a value of ``annotation``."""
    found = []
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            if part in member.model_fields:
                found.append(member.model_fields[str(part)].annotation)
        elif get_origin(member) in (dict, Mapping) and get_args(member):
            found.append(get_args(member)[-1])
        elif get_origin(member) in (list, tuple, set, frozenset) and get_args(member):
            found.append(get_args(member)[0])
    return found


def _walk(model: type[BaseModel], path: tuple[str | int, ...]
          ) -> tuple[tuple[str | int, ...], list[Any]]:
    """``path`` as the file spells it, and the types that may be found there. A part that
    names nothing inside (a tagged union's tag, which pydantic puts in an error's place) is
    no key of the file: it is stepped over and left out."""
    kinds: list[Any] = [model]
    spelled: list[str | int] = []
    for part in path:
        inside = [found for kind in kinds for found in _inside(kind, part)]
        if inside:
            kinds = inside
            spelled.append(part)
    return tuple(spelled), kinds


def keys_at(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    """The keys a file may hold at ``path`` inside ``model`` (a table's or an object's
    fields), for the nearest to an unknown one."""
    return sorted({name for kind in _walk(model, path)[1] for member in _members(kind)
                   if isinstance(member, type) and issubclass(member, BaseModel)
                   for name in member.model_fields})


def _where(path: tuple[str | int, ...], lines: Mapping[tuple[str, ...], int]) -> str:
    """``LINE: KEY`` for a key whose line is known, else ``KEY``."""
    # A key inside an inline table has no line of its own: its table's line is near.
    for end in range(len(path), 0, -1):
        number = lines.get(tuple(str(part) for part in path[:end]))
        if number is not None:
            return f"{number}: {_dotted(path)}"
    return _dotted(path)


def _nearest(key: str, known: list[str]) -> str | None:
    """The known key nearest to ``key``, if one is near enough to be what was meant."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return near[0] if near else None


def _unknown_key(where: str, key: str, known: list[str]) -> str:
    near = _nearest(key, known)
    return f"{where}: unknown key{f'; did you mean {near}?' if near else ''}"


def _wrong_value(where: str, err: Mapping[str, Any]) -> str:
    got = err.get("input")
    shown = f" (got {got!r})" if isinstance(got, str | int | float) else ""
    # No place: the whole file (not JSON at all, say), whose text is not worth repeating.
    return f"{where}: {err['msg']}{shown}" if where else str(err["msg"])


def in_file(path: str | Path, problems: list[str]) -> str:
    """``problems`` of the file ``path`` in one line: ``FILE:LINE: KEY: PROBLEM; ...``."""
    return "; ".join(f"{path}:{problem}" if problem[:1].isdigit() else f"{path}: {problem}"
                     for problem in problems)


def model_problems(model: type[BaseModel], exc: ValidationError,
                   lines: Mapping[tuple[str, ...], int] | None = None,
                   only: Collection[str] | None = None) -> list[str]:
    """Each error of ``exc`` (from validating a file's data as ``model``) as ``KEY: PROBLEM``,
    with ``LINE: `` before it where ``lines`` (:func:`key_lines`) knows the key's line; an
    unknown key with the nearest key its table may hold (``gpus.modle: unknown key; did you
    mean model?``). ``only``: just the errors of these pydantic types. A required key that is
    missing where an unknown key is its misspelling is said once, by the unknown key."""
    errors = [err for err in exc.errors(include_url=False)
              if only is None or err["type"] in only]
    meant = set()  # (table, key): the nearest key of an unknown one
    for err in errors:
        if err["type"] == "extra_forbidden":
            loc = tuple(err["loc"])
            near = _nearest(str(loc[-1]), keys_at(model, loc[:-1]))
            if near is not None:
                meant.add((loc[:-1], near))
    problems = []
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] == "missing" and (loc[:-1], str(loc[-1])) in meant:
            continue
        if err["type"] == "extra_forbidden":  # the key itself is unknown: its table's path
            path = (*_walk(model, loc[:-1])[0], loc[-1])
            where = _where(path, lines or {})
            problems.append(_unknown_key(where, str(loc[-1]), keys_at(model, loc[:-1])))
            continue
        problems.append(_wrong_value(_where(_walk(model, loc)[0], lines or {}), err))
    return problems


def settings_file_problems(settings_cls: type[BaseSettings], data: Mapping[str, Any],
                           text: str = "") -> list[str]:
    """What is wrong in a settings file's ``data`` (``text``: the file, for line numbers),
    each as ``LINE: KEY: PROBLEM`` (``3: bind_timeout: unknown key; did you mean
    bind_timeout_s?``); empty when every key is a setting and every value has its type.

    A value is checked against its setting in pydantic's strict mode on JSON input, which is
    what TOML's types are: a number must be a number, a boolean a boolean, a table's values
    of the table's type. Rules across settings are the settings class's, checked after.
    """
    lines = key_lines(text)
    # ``config`` names the file; a file naming another would be read by nobody.
    known = [name for name in settings_cls.model_fields if name != "config"]
    problems = []
    for key, value in data.items():
        if key not in known:
            problems.append(_unknown_key(_where((key,), lines), key, known))
            continue
        try:
            _file_value_adapter(settings_cls, key).validate_json(
                json.dumps(_json_ready(value)), strict=True)
        except ValidationError as exc:
            problems.extend(_wrong_value(_where((key, *err["loc"]), lines), err)
                            for err in exc.errors(include_url=False))
    return problems


class FileSettings(SecretFiles):
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
        return (init_settings, SecretsNotShadowed(settings_cls, env_settings, (init_settings,)),
                SecretsNotShadowed(settings_cls, file, (init_settings, env_settings)))


def _secret_pairs(settings_cls: type[BaseSettings]) -> list[tuple[str, str]]:
    """Each secret setting with its file: ``("amqp_url", "amqp_url_file")``."""
    pairs = []
    for field_name, info in settings_cls.model_fields.items():
        extra = info.json_schema_extra
        of = extra.get(SECRET_FILE_OF) if isinstance(extra, dict) else None
        if isinstance(of, str):
            pairs.append((of, field_name))
    return pairs


class SecretsNotShadowed(PydanticBaseSettingsSource):
    """A source less each secret setting, and its file, that a source above it gives.

    A secret and its file are one setting given two ways, so the precedence of the sources
    holds for the pair: ``SWARM_GPU_AMQP_URL`` in the environment overrides an
    ``amqp_url_file`` in the TOML file, as it would override ``amqp_url`` there. Both given by
    one source is still an error (:func:`setting_or_file`)."""

    def __init__(self, settings_cls: type[BaseSettings], source: PydanticBaseSettingsSource,
                 above: tuple[PydanticBaseSettingsSource, ...]) -> None:
        super().__init__(settings_cls)
        self._source = source
        self._above = above

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Not used: __call__ filters the whole source at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        data = self._source()
        given: dict[str, Any] = {}
        for source in self._above:
            given.update(source())
        for of, file in _secret_pairs(self.settings_cls):
            if given.get(of) not in (None, "") or given.get(file) not in (None, ""):
                data.pop(of, None)
                data.pop(file, None)
        return data


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
    if isinstance(exc, SettingsFileError):
        return str(exc)
    if isinstance(exc, tomllib.TOMLDecodeError):
        return f"the settings file is not valid TOML: {exc}"
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def setting_environment(settings_cls: type[BaseSettings], name: str) -> str:
    """The environment variable of the setting ``name`` (the class's prefix, upper case)."""
    return f"{settings_cls.model_config.get('env_prefix', '')}{name}".upper()


def _default_text(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list | dict | tuple):
        return json.dumps(value)
    text = str(value)
    return text if text else '""'


def setting_help(settings_cls: type[BaseSettings], name: str) -> str:
    """One setting's help: its description, default and environment variable."""
    info = settings_cls.model_fields[name]
    description = " ".join((info.description or "").split())
    return (f"{description} (default: {_default_text(info)}; environment: "
            f"{setting_environment(settings_cls, name)})")


def settings_help(settings_cls: type[BaseSettings], width: int = 79) -> str:
    """Every setting of ``settings_cls`` with its description, default and environment
    variable, wrapped to ``width`` columns: the ``--help`` of a process whose settings are
    not flags (``gpu-allocator serve``)."""
    lines = []
    for name in settings_cls.model_fields:
        lines.append(f"  {name}")
        lines.extend(textwrap.wrap(setting_help(settings_cls, name), width=width,
                                   initial_indent="      ", subsequent_indent="      ",
                                   break_on_hyphens=False))
    return "\n".join(lines)
