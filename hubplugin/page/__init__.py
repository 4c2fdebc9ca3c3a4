"""The GPU page: a JupyterHub service at ``/services/gpu/`` that shows users their GPUs.

- :mod:`hubplugin.page.usage`: a lease's use of its GPUs at one moment (pure).
- :mod:`hubplugin.page.chart`: usage over time as an inline SVG chart (pure).
- :mod:`hubplugin.page.view`: the page's data for one viewer (pure).
- :mod:`hubplugin.page.history`: the page's own SQLite file of usage samples.
- :mod:`hubplugin.page.settings`: ``SWARM_GPU_PAGE_*``.
- :mod:`hubplugin.page.app`: the Tornado app behind the hub's OAuth, the sampler.

Run by the hub as a managed service: ``python -m hubplugin.page``.
"""
