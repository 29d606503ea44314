"""The kvpool master: metadata only (segments, objects, replicas, leases, pins,
allocation, eviction). ``service.MasterService`` is the state machine,
``server.MasterServer`` its asyncio front end, ``cli`` the ``kvpool master`` command."""
