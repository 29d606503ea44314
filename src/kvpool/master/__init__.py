"""The kvpool master: metadata only (segments, objects, replicas, leases, pins,
allocation, eviction). ``service.MasterService`` is the state machine,
``server.MasterServer`` its asyncio front end, ``admin`` its admin HTTP app, and ``cli``
the ``kvpool master`` command, which assembles the process (server, tick, admin)."""
