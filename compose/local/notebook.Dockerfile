# A minimal notebook image: jupyterhub-singleuser (jupyter-server) as an unprivileged user,
# on the JupyterHub base of compose/local/jupyterhub.Dockerfile. Enough to try the stack;
# a real site sets NOTEBOOK_IMAGE to a CUDA notebook image (e.g. quay.io/jupyter/pytorch-notebook).
ARG JUPYTERHUB_BASE=swarm-gpu/jupyterhub-base
FROM ${JUPYTERHUB_BASE}

RUN useradd --create-home --uid 1000 --shell /bin/bash jovyan
USER jovyan
# The user's volume is mounted here (hubplugin/volumes.py): a folder of jovyan's in the image,
# so Docker gives a new volume its owner and jovyan can write to it.
RUN mkdir /home/jovyan/work
WORKDIR /home/jovyan
CMD ["jupyterhub-singleuser"]
