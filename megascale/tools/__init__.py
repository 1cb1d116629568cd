"""Offline tools that read a run directory or simulate a cluster: the merged timeline,
the HTML report, straggler analysis, dashboards, export, and the simulators (``sim``).
"""
