"""``swarm-gpu``: from a checked site file to a running stack on Docker Swarm.

:mod:`~allocator.deploy.site` is the site file's schema, :mod:`~allocator.deploy.pki` the
site's CA and server certificates, :mod:`~allocator.deploy.plan` what a site asks of the
Swarm (pure), :mod:`~allocator.deploy.swarm` the docker CLI, :mod:`~allocator.deploy.steps`
the idempotent steps that carry a plan out, and :mod:`~allocator.deploy.cli` the command.
"""
