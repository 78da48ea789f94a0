"""extproc's own APIs: messages and services generated from ``protos/`` by ``make protos``.

``extproc.api.admin.v1`` is the admin API (the state snapshot, reload, drain, pause).
:mod:`extproc.api.document` turns its messages into the JSON documents the HTTP admin port
serves, and back.
"""
