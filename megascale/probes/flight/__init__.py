"""The flight recorder: every collective and p2p op a rank issues, in a file another process can
read while the rank hangs, and the stall analysis that reads them.

The parts: ``recorder`` (the worker's side: ``FlightRecorder`` and its file), ``hooks`` (the
wrappers in front of torch.distributed's calls), ``watcher`` (follows ops to completion on the
device), ``format`` (the file's byte layout and its reader) and ``culprits`` (which ranks hold up
a stall, and why).
"""
