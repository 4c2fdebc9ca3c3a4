"""swarm-gpu hub plugin: ``GPUSwarmSpawner``, its spawn form and the GPU page for JupyterHub.

- :mod:`hubplugin.options`: what a user picks (form or REST ``user_options``) and the admin's
  policy; builds the allocator's ``AllocateRequest``.
- :mod:`hubplugin.form`: the spawn form's HTML from the allocator's inventory.
- :mod:`hubplugin.borrowing`: which of the form's choices the allocator says would be borrowed.
- :mod:`hubplugin.templating`: the Jinja2 templates of the form and the page (admins override).
- :mod:`hubplugin.page`: the GPU page, a hub service at ``/services/gpu/``.
- :mod:`hubplugin.builders`: a lease turned into env, placement constraints and labels.
- :mod:`hubplugin.spawner`: the spawner (entry point ``gpu-swarm``).

It imports only the allocator's public surface: ``allocator.protocol``, ``allocator.topology``
and ``allocator.client``.
"""
