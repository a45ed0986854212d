"""The worker layer: what runs in each worker process — the engine over a transport (``engine``) and the host an
adapter keeps it in (``host``) — between the driver (``control``) and the bucket pipeline (``pipeline``)."""
