"""Delta updates: a bucket travels as the units that changed since the base version, applied in place on arrival.

``encoding``: the format, its apply, and the keyed sums that verify what a receiver holds; ``copies``: the versions
kept on the host; ``sender``: a sender's side (the version it keeps, and each bucket compared and encoded against
it); ``receiver``: a receiver's side across updates. The pipeline calls each in one place: ``pipeline.send`` where a
bucket is packed, ``pipeline.receive`` where a bucket arrives.
"""
