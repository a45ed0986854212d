"""What crosses between workers: bucket headers and tables (``codec``), framed messages (``framing``), the update's
digest (``digest``), a bucket's planned layout (``layout``), tensors as bytes (``tensors``) and the checks a
destination passes before it is written (``destinations``)."""
