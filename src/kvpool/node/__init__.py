"""The kvpool storage node: ``segment_host.SegmentHost`` (a POSIX shared-memory segment
mounted with the master, heartbeats) and ``data_server.DataServer`` (its TCP data port);
``admin`` its admin HTTP app; ``cli`` is ``kvpool node``, which assembles the process
(host + admin), and ``serve`` is ``kvpool serve`` (master + one node). A client hosting a
segment in its own process (``Client(global_segment_size=...)``) uses the same
``SegmentHost``; nothing here imports the client."""
