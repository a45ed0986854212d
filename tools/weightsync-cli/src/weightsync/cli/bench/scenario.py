"""What one ``weightsync bench`` run measures: its options, the model's layout, and the cases it times."""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.api.config import MiB
from weightsync.api.parts import Part
from weightsync.cli.bench.rl import DEFAULT_LR, RLVersions
from weightsync.cli.bench.worker import Layout

__all__ = ["BASELINES", "DELTA", "GATHERED", "HOSTS_MODEL_MB", "PARTS", "SHARDED", "STAGED", "BenchOptions", "Case",
           "bench_part", "make_case", "model_bytes", "model_layout"]

BASELINES = ("naive", "bucketed")
DELTA = "+delta"
"""The suffix of a backend's entry measured with delta updates (``--delta``)."""
STAGED = "+staged"
"""The suffix of an entry measured with staged updates (``--staged``): ``B+staged``, ``B+delta+staged``."""
SHARDED = "+sharded"
"""``--sharded``: the entry whose actor ranks hold an FSDP2-sharded model and each send their shards
(``weightsync.cli.bench.sharded``)."""
GATHERED = "+gathered"
"""``--sharded``'s baseline, ``B+gathered``: the same ranks all-gather every parameter, rank 0 sends it whole."""
PARTS = ("tp2", "layers2")
"""``--parts``: replicas of two workers, each holding half of every split layer (``tp2``: tensor parallelism's
column- and row-parallel halves, norms whole on both) or half the layers (``layers2``: the tensors in the first
half of the model's bytes in stream order, or the rest); the entry ``B+tp2`` (``B+layers2``) beside ``B``."""
MATRIX_COLUMNS = 4096
MATRIX_ELEMENTS = 2048 * MATRIX_COLUMNS
"""The realistic mix's matrices: 16 MiB each in bf16 (fine enough that ``layers2``'s halves are within 3 % of the
model of each other at 256 MiB)."""
SMALL_TENSOR_BYTES = 4096
SMALL_DEFAULT_TENSORS = 10_000
# ``--hosts``'s and ``--mix rl``'s model (its other defaults are the CLI's): small enough that a run across 2 Gb/s
# links stays under 5 minutes.
HOSTS_MODEL_MB = 256


@dataclass(frozen=True)
class BenchOptions:
    backends: tuple[str, ...] = ()
    model_mb: float | None = None
    """None: 1024 MiB for ``realistic``, 10,000 tensors of 4 KiB (39 MiB) for ``small``."""
    receivers: int = 2
    bucket_mb: int = 64
    mix: str = "realistic"
    repeat: int = 5
    json_path: str | None = None
    plot_path: str | None = None
    trace_path: str | None = None
    ray: bool = True
    """Also measure the Ray end-to-end update against a gathered no-op (``--no-ray`` turns it off)."""
    ray_backend: str | None = None
    """Backend of the Ray end-to-end update; None: shm where it can run, else the first measured backend."""
    hosts: int = 0
    """0: every process on this machine. H >= 2: an emulated testbed of H hosts (see ``hosts``), the sender on host
    0 and ``receivers`` rollout workers on each of hosts 1..H-1."""
    link_gbps: float = 2.0
    """With ``hosts``: every host's link rate, Gb/s each way."""
    rtt_ms: float = 0.0
    """With ``hosts``: round-trip delay between any two hosts (needs sch_netem)."""
    rails: int = 1
    """With ``hosts``: links per host (``Testbed(rails=...)``), each shaped to ``link_gbps``."""
    actor_ranks: int = 0
    """Actor ranks on the sender's host (local ranks 0..A-1, so rank a on rail a mod ``rails``), each draining the
    whole stream; 0: ``rails``. Striped entries send from as many of them as there are stripes; the baselines from
    rank 0 only."""
    lr: float = DEFAULT_LR
    """With ``mix="rl"``: the learning rate of the Adam step between two versions."""
    delta: bool = False
    """Also measure every backend B with delta updates (``SyncConfig.delta``), as the entry ``B+delta``."""
    verify_every: int = 1
    """With ``delta``: ``SyncConfig.verify_every`` of the delta entries."""
    staged: bool = False
    """Also measure every entry B with staged updates (``SyncConfig.staged``), as ``B+staged``; every receiver of
    every entry then serves while not paused (``weightsync.cli.bench.serving``)."""
    parts: str = ""
    """One of ``PARTS``: also measure every entry B with the receivers in replicas of two workers that each hold a
    part, as ``B+tp2`` (``B+layers2``)."""
    sharded: bool = False
    """Measure every backend B (shm or auto) as ``B+sharded`` and ``B+gathered`` instead of B: ``actor_ranks`` (M >= 2)
    ranks on this host hold the model under FSDP2 (``weightsync.cli.bench.sharded``). With ``hosts`` (auto only) the
    ranks are on host 0 and the entries are ``B`` (the whole model, striped over the ranks) and ``B+sharded``."""


@dataclass
class Case:
    """One set of spawned processes: a backend or baseline, its model and buckets, R receivers, timed updates.

    ``receivers`` counts every receiving process; with ``hosts`` (H >= 2) they are spread evenly over hosts 1..H-1.
    """

    name: str
    total_bytes: int
    layout: Layout
    bucket_bytes: int
    receivers: int
    repeat: int
    hosts: int = 0
    versions: str = ""
    """With ``--mix rl``: the directory of the versions the sender loads before each update (``rl``)."""
    verify_every: int = 1
    serving: bool = False
    """The receivers serve while not paused (``--staged``: in every entry, staged or not)."""
    actors: int = 1
    """Actor ranks (group ranks 0..A-1, on the sender's host); the receivers are group ranks A..A+R-1."""
    parts: str = ""
    """One of ``PARTS`` (the entry's name says so: ``B+tp2``): receivers in replicas of two, each its part
    (:func:`bench_part`)."""

    @property
    def backend(self) -> str:
        """The backend or baseline measured (an entry ``B+tp2+delta+staged`` measures B, ``B+sharded`` too)."""
        name = self.name.removesuffix(SHARDED).removesuffix(GATHERED)
        return name.removesuffix(STAGED).removesuffix(DELTA).removesuffix(f"+{self.parts}")

    @property
    def source(self) -> str:
        """``--sharded``: how the actor ranks' FSDP2 model is sent, ``sharded`` or ``gathered``; '' otherwise."""
        return next((suffix[1:] for suffix in (SHARDED, GATHERED) if self.name.endswith(suffix)), "")

    @property
    def delta(self) -> bool:
        return self.name.removesuffix(STAGED).endswith(DELTA)

    @property
    def staged(self) -> bool:
        return self.name.endswith(STAGED)

    @property
    def receiving(self) -> range:
        """The receivers' group ranks."""
        return range(self.actors, self.actors + self.receivers)

    def host_of(self, group_rank: int) -> int:
        """The testbed host of group rank ``group_rank`` (actor ranks: the sender's, 0; rollout ranks host by
        host)."""
        if self.hosts < 2 or group_rank < self.actors:
            return 0
        return 1 + (group_rank - self.actors) // (self.receivers // (self.hosts - 1))

    def replicas(self) -> list[list[int]]:
        """The receivers' group ranks, replica by replica: one each; with ``parts`` two, worker k holding part k —
        on two hosts where there is an even number of receiving hosts (the j-th receiver of host 2i + 1 with the
        j-th of host 2i + 2: a host then holds one part), else two neighbours on one host."""
        ranks = list(self.receiving)
        if not self.parts:
            return [[rank] for rank in ranks]
        hosts = max(1, self.hosts - 1)
        if hosts % 2:
            return [ranks[at:at + 2] for at in range(0, len(ranks), 2)]
        per_host = len(ranks) // hosts
        return [[ranks[pair * 2 * per_host + j], ranks[(pair * 2 + 1) * per_host + j]]
                for pair in range(hosts // 2) for j in range(per_host)]

    def local_rank(self, group_rank: int) -> int:
        """Its rank among the workers of its host (its rail on a host of rails: local rank mod rails)."""
        host = self.host_of(group_rank)
        return sum(self.host_of(rank) == host for rank in range(group_rank))


def model_bytes(options: BenchOptions) -> int:
    if options.model_mb is not None:
        return int(options.model_mb * MiB)
    if options.hosts or options.mix == "rl":
        return HOSTS_MODEL_MB * MiB
    return SMALL_DEFAULT_TENSORS * SMALL_TENSOR_BYTES if options.mix == "small" else 1024 * MiB


def model_layout(total_bytes: int, bucket_bytes: int, mix: str) -> Layout:
    """Names and bf16 shapes adding up to about ``total_bytes``."""
    if mix == "small":
        count = max(1, total_bytes // SMALL_TENSOR_BYTES)
        return [(f"layers.{i}.bias", (SMALL_TENSOR_BYTES // 2,)) for i in range(count)]
    elements = total_bytes // 2
    # One tensor larger than a bucket (split across buckets), many small vectors, large matrices for the rest:
    # rows of 4096 columns where there are two rows or more (the MLP's up and down projections in turn).
    shapes: Layout = [("lm_head.weight", _matrix(min(elements, int(1.5 * bucket_bytes) // 2)))]
    remaining = elements - math.prod(shapes[0][1])
    for i in range(200):
        if remaining < 2048:
            break
        shapes.append((f"model.layers.{i}.input_layernorm.weight", (2048,)))
        remaining -= 2048
    layer = 0
    while remaining > 0:
        shape = _matrix(min(remaining, MATRIX_ELEMENTS))
        shapes.append((f"model.layers.{layer}.mlp.{'down' if layer % 2 else 'up'}_proj.weight", shape))
        remaining -= math.prod(shape)
        layer += 1
    return shapes


def _matrix(elements: int) -> tuple[int, ...]:
    """Whole rows of ``MATRIX_COLUMNS`` where ``elements`` make two or more, else a vector of them all."""
    rows = elements // MATRIX_COLUMNS
    return (rows, MATRIX_COLUMNS) if rows >= 2 else (elements,)


def bench_part(layout: Layout, parts: str, rank: int) -> Part:
    """Worker ``rank``'s part of a replica of two (``PARTS``): ``tp2`` splits every matrix in two, the down
    projections along their columns (row-parallel) and the others along their rows, an odd extent and the vectors
    whole on both; ``layers2`` gives worker 0 every tensor whose middle lies in the first half of the model's bytes
    in stream order, worker 1 the rest."""
    shapes = dict(layout)
    if parts == "tp2":
        dims = {name: 1 if "down_proj" in name else 0 for name, shape in layout if len(shape) == 2}
        return Part.split(shapes, dims={name: dim for name, dim in dims.items() if shapes[name][dim] % 2 == 0},
                          rank=rank, parts=2)
    if parts != "layers2":
        raise ValueError(f"--parts is one of {', '.join(PARTS)}, got {parts!r}")
    half, start = sum(math.prod(shape) for shape in shapes.values()) / 2, 0
    others: dict[str, tuple[()]] = {}
    for name, shape in layout:
        if (start + math.prod(shape) / 2 < half) != (rank == 0):  # by where its middle lies
            others[name] = ()
        start += math.prod(shape)
    if len(others) == len(layout):
        raise ValueError(f"--parts layers2: worker {rank} would hold nothing of a model of {len(layout)} tensors")
    return Part(tensors=others)


def make_case(name: str, options: BenchOptions, receivers: int | None = None, bucket_mb: int | None = None,
              total_bytes: int | None = None, repeat: int | None = None, rl: RLVersions | None = None) -> Case:
    """The case ``name`` as ``options`` describe it, each given argument overriding its option (``receivers``: per
    receiving host with ``options.hosts``); with ``rl``, the model is its versions'."""
    bucket_bytes = (bucket_mb or options.bucket_mb) * MiB
    if rl is not None:
        layout = list(rl.layout)
    else:
        layout = model_layout(total_bytes or model_bytes(options), bucket_bytes, options.mix)
    receiving_hosts = max(1, options.hosts - 1)
    parts = next((kind for kind in PARTS if f"+{kind}" in name), "")
    return Case(name=name, total_bytes=sum(2 * math.prod(shape) for _, shape in layout), layout=layout,
                bucket_bytes=bucket_bytes, receivers=(receivers or options.receivers) * receiving_hosts,
                repeat=repeat or options.repeat, hosts=options.hosts, versions=rl.directory if rl else "",
                verify_every=options.verify_every, serving=options.staged,
                actors=1 if name in BASELINES else options.actor_ranks or options.rails, parts=parts)
