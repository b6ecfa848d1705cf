"""Shared test helpers, importable from any test room as ``helpers.*``.

``tests/`` is on ``sys.path`` under pytest (``pythonpath`` in pyproject.toml), so
``from helpers.procs import start_broker`` works from every directory.

- :mod:`helpers.brokers`: :class:`~helpers.brokers.BrokerFactory`, the one way a test
  starts brokers (in process or as subprocesses) and stops them all, behind the
  ``broker_factory`` fixture;
- :mod:`helpers.procs`: broker subprocesses (``metaq broker start``) and reading a
  partition back;
- :mod:`helpers.inproc`: an in-process broker and a pipelined ``produce``;
- :mod:`helpers.audit`: ``OwnerAudit``, a group's owner nodes watched from outside;
- :mod:`helpers.consumer_script`: a consumer process for kill -9 tests, run as a
  script (``python tests/helpers/consumer_script.py ...``);
- :mod:`helpers.zk_docker`: ZooKeeper in Docker containers (one server, an ensemble).
"""
