"""swarm-gpu hub plugin: ``GPUSwarmSpawner``, its spawn form and the GPU page for JupyterHub.

- :mod:`hubplugin.options`: what a user picks (form or REST ``user_options``) and the admin's
  policy; builds the allocator's ``AllocateRequest``.
- :mod:`hubplugin.form`: the spawn form's HTML from the allocator's inventory.
- :mod:`hubplugin.borrowing`: which of the form's choices the allocator says would be borrowed.
- :mod:`hubplugin.booked`: the form's marks for bookings (booked for you, reclaimable soon).
- :mod:`hubplugin.links`: how GPUs are joined, in words: a multi-GPU choice's best connection
  now, the form's topology choice, a lease's connection on the page.
- :mod:`hubplugin.templating`: the Jinja2 templates of the form and the page (admins override).
- :mod:`hubplugin.page`: the GPU page, a hub service at ``/services/gpu/``.
- :mod:`hubplugin.builders`: a lease turned into env, placement constraints and labels.
- :mod:`hubplugin.leasing`: the allocate-and-wait conversation with the allocator, releases.
- :mod:`hubplugin.overrides`: a profile's spawner settings, set for one start and undone.
- :mod:`hubplugin.progress`: the spawn page's progress events (the request, its queue place).
- :mod:`hubplugin.errors`: allocator errors as HTTP errors with a message for people.
- :mod:`hubplugin.spawner`: the spawner (entry point ``gpu-swarm``).
- :mod:`hubplugin.login`: who may log in: NativeAuthenticator accounts an admin authorized.

It imports only the allocator's public surface, these modules exactly:
:mod:`allocator.amqp.broker`, :mod:`allocator.amqp.client`, :mod:`allocator.bookings.outlook`,
:mod:`allocator.logs`, :mod:`allocator.placement.gpu_sets`, :mod:`allocator.settings_files`,
:mod:`allocator.tasks`, :mod:`allocator.wire.capacity`, :mod:`allocator.wire.interconnect`,
:mod:`allocator.wire.lease_container`, :mod:`allocator.wire.model_names` and
:mod:`allocator.wire.protocol`
(``tests/static/test_design_map.py`` holds this list to the code).
"""
