"""What runs inside every training rank besides the step and reports on it: the flight
recorder, progress, compute and step timers, fault injection, fatal-error records, MFU.
"""
