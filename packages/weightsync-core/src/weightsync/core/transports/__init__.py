"""The transports: the seam the pipeline asks of every transport and its rules (``seam``, ``rules``), the
``Transport`` a backend implements (``transport``), what transports read — the engine's settings, the device
policy, where this worker runs, deadlines and tokens (``settings``, ``device``, ``place``, ``waiting``) — shared
memory and a host's staging area (``sharedmem``, ``stagearea``), and the two families of ways buckets move: a chain
of one-sided reads (``chain``) and a broadcast over a process group (``collective``)."""
