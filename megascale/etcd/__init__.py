"""Everything that talks to etcd: the client (``store``), the key layout (``keys``)
and the embedded server (``server``).
"""
