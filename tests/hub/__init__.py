"""The hub plugin (hubplugin): the spawner, its form, the GPU page, with a real JupyterHub."""
