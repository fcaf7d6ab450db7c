"""Watching a running evaluator from another process: ``shmeval stats
ADDRESS --watch`` (a live terminal view), ``shmeval metrics ADDRESS
--port PORT`` (a Prometheus endpoint), ``shmeval plot RUN.json`` (a
self-play run as a picture).  Extra ``[monitor]``: rich, prometheus_client
and matplotlib, each imported only by the module that draws with it.

Everything here only reads the segment: attaching maps it without
claiming a client entry, and a snapshot is a handful of relaxed loads, so
watching never slows the evaluator.

==============  ==========================================================
``reader``      :class:`EvaluatorReader`: snapshots of the segment, and
                :class:`Interval`, what changed between two of them
``watch``       the live view (rich)
``prometheus``  the collector read at scrape time, :func:`start_exporter`
                and ``shmeval metrics``
``plot``        ``shmeval plot``: a self-play run's time series (matplotlib)
==============  ==========================================================
"""
