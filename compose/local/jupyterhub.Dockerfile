# JupyterHub's base from Debian packages and PyPI, for a site that pulls no public image
# (scripts/cluster builds it and passes it to compose/Dockerfile as HUB_BASE; elsewhere
# HUB_BASE is quay.io/jupyterhub/jupyterhub). configurable-http-proxy is Debian's package;
# JupyterHub lives in a venv whose pip is first on PATH, where compose/Dockerfile's hub stage
# installs the spawner. jupyter-server makes the same image a minimal notebook image
# (jupyterhub-singleuser) for trying the stack without a CUDA notebook image.
ARG DEBIAN_BASE=debian:bookworm-slim
FROM ${DEBIAN_BASE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends node-configurable-http-proxy \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/jupyterhub/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/jupyterhub \
    && pip install "jupyterhub>=5,<7" "jupyter-server>=2" \
    && configurable-http-proxy --version
