"""The bucket pipeline: a weight stream planned into buckets (``planner``), packed and staged (``send``,
``staging``), and on the receiver pulled off the transport (``receive``) and read into views or destinations
(``unpack``); ``handover`` holds the engine for one update at a time, ``trace`` times the stages."""
