"""Process plumbing every layer uses, none of it RAG: ``logs`` (the quiet default for third-party
output, here and in the engine's processes), ``progress`` (bars on a terminal, plain lines in a
log), ``lifeline`` (the engine's processes die with the process that started them) and
``urls`` (a service URL without its password).

Imports nothing from the rest of ragcache (``ragcache/__init__`` runs ``lifeline`` and ``logs``
first thing). Importing this package imports none of its modules.
"""
