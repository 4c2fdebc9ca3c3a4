"""``python -m hubplugin.page``: the GPU page, started by JupyterHub as a managed service.

It listens where the hub says (``JUPYTERHUB_SERVICE_URL``) under the service's prefix
(``JUPYTERHUB_SERVICE_PREFIX``, ``/services/gpu/``); its own settings are
``SWARM_GPU_PAGE_*`` (:mod:`hubplugin.page.settings`), its logs as ``SWARM_GPU_PAGE_LOG_LEVEL``
and ``SWARM_GPU_PAGE_LOG_FORMAT`` say (:mod:`allocator.logs`). Bad settings: exit status 2 and
one line that says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from pydantic import ValidationError

from allocator.logs import configure_logging
from allocator.settings_files import settings_error_line

from .app import serve
from .settings import PageSettings


def main() -> int:
    """Run the page until the hub stops it (SIGTERM)."""
    try:
        settings = PageSettings()
    except ValidationError as exc:
        print(f"gpu page: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        print("gpu page: JUPYTERHUB_SERVICE_URL is not set; run it as a JupyterHub service "
              "(see docs/operations.md)", file=sys.stderr)
        return 2
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpu/")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, url=url, prefix=prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
