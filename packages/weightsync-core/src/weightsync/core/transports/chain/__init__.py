"""The chain family: buckets moved by one-sided reads along a chain or tree of workers — the transport
(``transport``), its sender and receiver positions (``ends``), who reads from whom (``topology``), the rings a
library registers (``rings``) and the host ring a host's other workers read in place (``hostring``), an update
dealt into stripes over several rails (``stripes``), and the typed plan each rank is handed (``plan``)."""
