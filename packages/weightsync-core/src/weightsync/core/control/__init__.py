"""Control: the manager that drives an update across every worker (``manager``, its ``steps``, ``auto``'s backend
choice), and in each worker the host that runs the engine (``host``) and the engine itself (``engine``: settings,
transport and the two pipelines of one worker)."""
