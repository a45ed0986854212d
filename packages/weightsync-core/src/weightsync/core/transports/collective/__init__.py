"""The collective family: a bucket broadcast in a private process group — over host buffers (``host``: gloo) and
over device buffers ordered by the accelerator's streams (``device``: what nccl and hccl instantiate)."""
