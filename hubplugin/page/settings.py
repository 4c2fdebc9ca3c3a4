"""The GPU page's settings: environment variables ``SWARM_GPU_PAGE_*``.

The hub starts the page as a managed service and passes these in the service's
``environment`` (see ``compose/jupyterhub_config.py``). JupyterHub itself adds what the
service needs to talk to it: ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_API_URL``,
``JUPYTERHUB_SERVICE_URL`` (where to listen), ``JUPYTERHUB_SERVICE_PREFIX`` (``/services/gpu/``)
and the OAuth client settings, read by :class:`jupyterhub.services.auth.HubOAuth`.

List settings may be JSON or comma separated: ``SWARM_GPU_PAGE_ADMIN_GROUPS=gpu-admins,staff``.
The broker URL holds the hub's broker password: give it as a file,
``SWARM_GPU_PAGE_AMQP_URL_FILE`` (:class:`allocator.settings_files.SecretFiles`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from allocator.amqp.broker import BrokerTLSSettings
from allocator.logs import LogSettings
from allocator.settings_files import SecretFiles, list_from_text, secret_file_field

ENV_PREFIX = "SWARM_GPU_PAGE_"


class PageSettings(SecretFiles, BrokerTLSSettings, LogSettings):
    """Where the allocator is (the broker's TLS files:
    :class:`allocator.amqp.broker.BrokerTLSSettings`), what the page keeps, who counts as an admin,
    how it logs (``log_level``, ``log_format``:
    :class:`allocator.logs.LogSettings`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        description="Broker URL with a user that may send requests to the allocator (the "
        "hub's own broker user does).")
    amqp_url_file: Path | None = secret_file_field("amqp_url")
    hub_id: str | None = Field(
        default=None, description="Show only leases this hub asked for (its spawner's hub_id); "
        "unset: every lease of the user, whichever hub asked.")
    history_path: Path = Field(
        default=Path("gpu-page-history.sqlite"),
        description="The page's own SQLite file of usage samples (charts only).")
    history_hours: float = Field(
        default=3.0, gt=0, le=24 * 14, description="How far back the charts go (and how long "
        "samples are kept).")
    sample_interval_s: float = Field(
        default=30.0, ge=1.0, le=3600.0,
        description="Seconds between two samples of the allocator's inventory.")
    allocator_timeout_s: float = Field(
        default=5.0, gt=0, le=60, description="One inventory call, for a sample or a page view.")
    admin_groups: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Hub groups whose members see the whole cluster, "
        "besides the hub's admins.")
    template_paths: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Directories searched first for gpu_page.html.j2 "
        "(a file there replaces the packaged page, or extends \"swarm_gpu/gpu_page.html.j2\").")
    refresh_s: int = Field(default=60, ge=0, le=3600,
                           description="The page reloads itself after this (0: never).")

    @field_validator("admin_groups", "template_paths", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        return list_from_text(value)
