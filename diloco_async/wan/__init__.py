"""Emulated regions on one machine: Linux network namespaces joined to a hub by shaped veth links.

* :mod:`diloco_async.wan.netns`: :class:`~diloco_async.wan.netns.WanNet` builds the hub and
  region namespaces, the veth pairs and their ``tc tbf`` shaping, verifies each link's rate with a
  timed TCP transfer and tears everything down; :func:`~diloco_async.wan.netns.cleanup` removes
  leftovers after a crash.
* :mod:`diloco_async.wan.probe`: the timed transfer behind the verification.
* :mod:`diloco_async.wan.launch`: :class:`~diloco_async.wan.launch.NetnsLauncher` starts a run's
  processes inside namespaces; :func:`~diloco_async.wan.launch.start_moto_server` puts moto's S3
  server in the hub.
* ``python -m diloco_async.wan.cleanup [--prefix dlw]``: the cleanup command.

Needs root, ``ip`` and ``tc`` with the ``tbf`` qdisc (:func:`~diloco_async.wan.netns.root_reason`
says why not). See docs/wan.md.
"""
