"""swarm-gpu hub plugin: ``GPUSwarmSpawner`` and its spawn form for JupyterHub.

- :mod:`hubplugin.options`: what a user picks (form or REST ``user_options``) and the admin's
  policy; builds the allocator's ``AllocateRequest``.
- :mod:`hubplugin.form`: the spawn form's HTML from the allocator's inventory.
- :mod:`hubplugin.builders`: a lease turned into env, placement constraints and labels.
- :mod:`hubplugin.spawner`: the spawner (entry point ``gpu-swarm``).

It imports only the allocator's public surface: ``allocator.protocol``, ``allocator.topology``
and ``allocator.client``.
"""
