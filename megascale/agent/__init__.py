"""The node agent (one per node): heartbeats, the zygote that forks the ranks, the node
self-check, neighbour checks, log scanning and the Prometheus exporter.
"""
