"""The node agent (nodeagent): inventory, containers, processes, MIG, its metrics."""
