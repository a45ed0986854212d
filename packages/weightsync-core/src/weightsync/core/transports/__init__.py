"""The transports: the seam the pipeline asks of every transport (``transport``), the engine's settings and the
device policy they read (``settings``, ``device``), deadlines and tokens (``waiting``), and the shared ways buckets
move — a chain of one-sided reads (``chain``, ``chainends``, ``chaintopology``, ``hostring``, ``rings``,
``sharedmem``) and a broadcast over a process group (``collective``, ``devicecollective``)."""
