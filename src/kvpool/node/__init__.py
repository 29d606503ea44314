"""The kvpool storage node command: ``cli`` is ``kvpool node`` (a
:class:`kvpool.transfer.segment_host.SegmentHost` in its own process) and ``serve`` is
``kvpool serve`` (master + one node)."""
