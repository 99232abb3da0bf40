"""qvlctl: the query and admin client for qvld, and nothing else.

It talks to the daemon over its socket and takes only ``qvld.protocol`` and
``qvld.errors`` from qvld: never the engine or a runtime. `qvlctl model ...` is a thin
front for qvld's model tooling (``qvld.modeltools``), imported only when such a command
runs.
"""
