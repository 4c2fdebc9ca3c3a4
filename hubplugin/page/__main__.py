"""``python -m hubplugin.page``: the GPU page, started by JupyterHub as a managed service.

It listens where the hub says (``JUPYTERHUB_SERVICE_URL``) under the service's prefix
(``JUPYTERHUB_SERVICE_PREFIX``, ``/services/gpu/``); its own settings are
``SWARM_GPU_PAGE_*`` (:mod:`hubplugin.page.settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

from .app import serve
from .settings import PageSettings


def main() -> int:
    """Run the page until the hub stops it (SIGTERM)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        print("gpu page: JUPYTERHUB_SERVICE_URL is not set; run it as a JupyterHub service "
              "(see docs/operations.md)", file=sys.stderr)
        return 2
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpu/")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(PageSettings(), url=url, prefix=prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
