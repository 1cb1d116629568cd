"""The robust-training controller: the pure state machine, its I/O service, leader
election, the event log, straggler scoring and the job summary.
"""
