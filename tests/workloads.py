"""Sources, sinks and transport hooks that tests run inside Ray actors and harness processes.

They live in an importable module (the test fixtures put the repository root on ``PYTHONPATH`` before starting
Ray) so that Ray and ``multiprocessing`` can rebuild them by reference in worker processes.
"""

from __future__ import annotations

import array
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.api.protocols import load_into
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.tensors import as_byte_view


def model_tensors(version: int, *, tensors: int = 12, numel: int = 50_000) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(version)
    out = []
    for index in range(tensors):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[index % 3]
        data = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8,
                             generator=generator)
        out.append((f"model.layers.{index}.weight", data.view(dtype)))
    return out


def weights_digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    digest = UpdateDigest()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        digest.update_bucket(name.encode(), as_byte_view(tensor))
    return digest.hexdigest()


class _Inspectable:
    """What tests ask a worker process about itself, from outside the engine."""

    def pid(self) -> int:
        return os.getpid()

    def thread_names(self) -> list[str]:
        import threading

        return sorted(thread.name for thread in threading.enumerate())


class ModelSource(_Inspectable):
    """An actor rank's model: deterministic tensors per version; ``set_mode`` injects faults in the stream."""

    def __init__(self, rank: int, world_size: int, *, tensors: int = 12, numel: int = 50_000) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.tensors = tensors
        self.numel = numel
        self.version = 1
        self.mode = "normal"
        self.delay = 0.0

    def set_version(self, version: int) -> str:
        self.version = version
        return weights_digest(model_tensors(version, tensors=self.tensors, numel=self.numel))

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        self.mode = mode
        self.delay = delay

    def named_weights(self) -> Iterator[Any]:
        for index, (name, tensor) in enumerate(model_tensors(self.version, tensors=self.tensors, numel=self.numel)):
            if self.delay:
                time.sleep(self.delay)
            if self.mode == "duplicate" and index == 3:
                yield model_tensors(self.version, tensors=1, numel=self.numel)[0]
                continue
            if self.mode == "non_tensor" and index == 3:
                yield name, [1.0, 2.0, 3.0]
                continue
            if self.mode == "raise_midway" and index == self.tensors // 2:
                raise RuntimeError("the trainer's weight gather failed half-way")
            yield name, tensor


    def pg_constructions(self) -> int:
        return counting_groups()


class RedrawnSource(ModelSource):
    """:class:`ModelSource` whose every tensor's size is a multiple of the bucket alignment (no bucket has padding
    a delta encoding could leave out); every version redraws every byte."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, tensors=6, numel=49_152)


class RecordingSink(_Inspectable):
    """A rollout worker's model: keeps a copy of every tensor and records the pause/resume hooks it sees."""

    def __init__(self, replica: int, worker: int) -> None:
        torch.set_num_threads(1)
        self.weights: dict[str, torch.Tensor] = {}
        self.hooks: list[str] = []
        self.hook_times: list[tuple[str, float]] = []
        self.version = 0
        self.loading = "views"

    def set_loading(self, loading: str) -> None:
        """How ``load_weights`` reads the stream: ``views`` (iterating it), ``copy_into`` (into the tensors this
        sink holds), ``refuse_all`` (``copy_into``, every destination of another shape: refused before any write)
        or ``refuse_last`` (``copy_into``, only the stream's last tensor's destination of another shape)."""
        self.loading = loading

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        if self.loading == "views":
            async for name, tensor in weights:
                self.weights[name] = tensor.clone()
        else:
            destinations = dict(self.weights)
            last = max(destinations, key=lambda name: int(name.split(".")[2]))  # model.layers.N.weight
            refused = {"refuse_all": list(destinations), "refuse_last": [last]}.get(self.loading, [])
            for name in refused:
                destinations[name] = torch.empty(1, dtype=destinations[name].dtype)
            await load_into(weights, destinations)
        self.version = version

    def digest(self) -> str:
        return weights_digest(list(self.weights.items()))

    def abort_all_requests(self) -> None:
        self._hook("abort_all_requests")

    def release_kv_cache(self) -> None:
        self._hook("release_kv_cache")

    def resume_kv_cache(self) -> None:
        self._hook("resume_kv_cache")

    def resume_generation(self) -> None:
        self._hook("resume_generation")

    def _hook(self, hook: str) -> None:
        self.hooks.append(hook)
        self.hook_times.append((hook, time.monotonic()))  # CLOCK_MONOTONIC: comparable across this host's workers

    def hook_log(self) -> list[str]:
        return list(self.hooks)

    def hook_clock(self) -> list[tuple[str, float]]:
        return list(self.hook_times)


    def pg_constructions(self) -> int:
        return counting_groups()


# -- counting process-group constructions from outside the engine ----------------------------------------------------

_constructions = 0


def counting_groups() -> int:
    """Install (once per process) a wrapper around ``torch.distributed.ProcessGroupGloo``; return constructions."""
    import torch.distributed as dist

    original: Any = dist.ProcessGroupGloo
    if not getattr(original, "_weightsync_counting", False):

        class Counting(original):  # type: ignore[misc]
            _weightsync_counting = True

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                global _constructions
                _constructions += 1
                super().__init__(*args, **kwargs)

        setattr(dist, "ProcessGroupGloo", Counting)
    return _constructions


class CountingModelSource(ModelSource):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        counting_groups()


class CountingSink(RecordingSink):
    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        counting_groups()


# -- transport hooks (engine option transport_hook="tests.workloads:NAME") -------------------------------------------


class _FlipAfterPack:
    """Corrupts a packed bucket on the sender before it is hashed: only a byte comparison can notice."""

    def after_pack(self, index: int, payload: torch.Tensor) -> None:
        if index == 0 and payload.numel():
            payload[0] ^= 0x01


class _WatchAfterPack:
    """Looks at every packed bucket and changes nothing; a sender with an ``after_pack`` hook keeps no version, so
    with ``delta=True`` it sends every update full (the conformance kit's delta test must notice)."""

    def after_pack(self, index: int, payload: torch.Tensor) -> None:
        pass


class _FlipAfterReceive:
    """Corrupts every first bucket a receiver gets, after transit and before hashing: the digest must notice."""

    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        if index == 0 and payload.numel():
            # Shared-memory receivers see each other's writes: add (never cancels out), do not XOR.
            payload[payload.numel() // 2] += 1


class _FlipOnce:
    """Like ``_FlipAfterReceive``, but only in the first update this process sees (the next one repairs)."""

    def __init__(self) -> None:
        self.done = False

    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        if not self.done and payload.numel():
            self.done = True
            payload[0] += 1


FLIP_AFTER_PACK = _FlipAfterPack()
WATCH_AFTER_PACK = _WatchAfterPack()
FLIP_AFTER_RECEIVE = _FlipAfterReceive()
FLIP_ONCE = _FlipOnce()


# -- accelerator tensors (the emulated device) ------------------------------------------------------------------------


def device_model(version: int, device: str, *, mixed: bool, large_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """A model as a trainer yields it on an accelerator: bf16, fp32, int8 and bool tensors, non-contiguous views, and
    one tensor larger than ``large_bytes`` (a bucket); with ``mixed``, every other tensor stays on the host."""
    from weightsync.api.testing import place

    generator = torch.Generator().manual_seed(1000 + version)

    def random(numel: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, (numel,), generator=generator).to(torch.bool)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).view(dtype)

    weights = [
        ("embed.weight", random(64 * 48, torch.bfloat16).reshape(64, 48)),
        ("layers.0.attn.weight", random(48 * 48, torch.float32).reshape(48, 48).t()),  # transposed view
        ("layers.0.attn.bias", random(48, torch.float32)),
        ("layers.0.quant.weight", random(96 * 32, torch.int8).reshape(96, 32)[:, ::2]),  # strided view
        ("layers.0.mask", random(333, torch.bool)),
        ("layers.0.norm.weight", random(48, torch.bfloat16)),
        ("lm_head.weight", random(large_bytes // 4 + 1000, torch.float32)),  # more than a bucket
    ]
    return place(weights, device, "mixed" if mixed else "device")


class DeviceModelSource(ModelSource):
    """An actor rank whose weights live on the emulated accelerator (``mixed``: every other one on the host)."""

    large_bytes = 256 * 1024
    mixed = False

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        from tests.devices import emulated_device

        self.device = emulated_device()

    def set_version(self, version: int) -> str:
        self.version = version
        weights = device_model(version, self.device, mixed=self.mixed, large_bytes=self.large_bytes)
        return weights_digest([(name, tensor.cpu()) for name, tensor in weights])

    def named_weights(self) -> Iterator[Any]:
        yield from device_model(self.version, self.device, mixed=self.mixed, large_bytes=self.large_bytes)


class MixedModelSource(DeviceModelSource):
    mixed = True


class DeviceSink(RecordingSink):
    """A rollout worker's model as parameters on the emulated accelerator, loaded in place with ``load_into``
    (``mixed``: the parameters alternate between the device and the host, crossing the source's pattern)."""

    mixed = False

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        from tests.devices import emulated_device

        self.device = emulated_device()
        shapes = device_model(0, "cpu", mixed=False, large_bytes=DeviceModelSource.large_bytes)
        self.parameters = {
            name: torch.nn.Parameter(torch.zeros(tensor.shape, dtype=tensor.dtype,
                                                 device="cpu" if self.mixed and index % 3 == 1 else self.device),
                                     requires_grad=tensor.dtype.is_floating_point)
            for index, (name, tensor) in enumerate(shapes)
        }

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        from weightsync.api.protocols import load_into

        await load_into(weights, self.parameters)
        self.version = version

    def digest(self) -> str:
        return weights_digest([(name, parameter.detach().cpu()) for name, parameter in self.parameters.items()])

    def devices(self) -> list[str]:
        return sorted({parameter.device.type for parameter in self.parameters.values()})


class MixedSink(DeviceSink):
    mixed = True


# -- delta updates: versions that differ in a few elements, and a model loaded in place --------------------------

_RAW_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def delta_model(version: int, *, dense: frozenset[int] = frozenset(), fraction: float = 0.01
                ) -> list[tuple[str, torch.Tensor]]:
    """bf16, fp32 and fp8 weights (one split across several 256 KiB buckets) whose version ``version`` changes
    the bits of about ``fraction`` of the base model's elements, a different set each version (every element when
    ``version`` is in ``dense``): consecutive versions differ in about twice ``fraction``."""
    base = torch.Generator().manual_seed(0)
    changes = torch.Generator().manual_seed(1000 + version)
    out = []
    shapes = [((300, 1000), torch.bfloat16), ((64, 256), torch.float32), ((128, 512), torch.float8_e4m3fn),
              ((4096,), torch.bfloat16), ((7,), torch.float32), ((50, 50), torch.bfloat16)]
    for index, (shape, dtype) in enumerate(shapes):
        tensor = (torch.randn(shape, generator=base) * 0.02).to(dtype)
        bits = as_byte_view(tensor).view(_RAW_INTS[tensor.element_size()])
        mask = torch.rand(bits.numel(), generator=changes) < fraction
        if version in dense:
            mask[:] = True
        bits[mask] += version
        out.append((f"model.layers.{index}.weight", tensor))
    return out


class DeltaModelSource(ModelSource):
    """An actor rank whose versions differ in a few elements (:func:`delta_model`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.dense: frozenset[int] = frozenset()

    def set_version(self, version: int) -> str:
        self.version = version
        return weights_digest(delta_model(version, dense=self.dense))

    def set_dense(self, versions: list[int]) -> None:
        self.dense = frozenset(versions)

    def named_weights(self) -> Iterator[Any]:
        for index, item in enumerate(delta_model(self.version, dense=self.dense)):
            if self.mode == "raise_midway" and index == 3:
                raise RuntimeError("the trainer's weight gather failed half-way")
            yield item


class InPlaceSink(RecordingSink):
    """A rollout worker whose model lives in tensors of its own, loaded in place (``copy_into``), as an inference
    engine's parameters are; ``scribble`` changes one of them behind the engine's back."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.weights = {name: torch.zeros_like(tensor) for name, tensor in delta_model(0)}

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        await weights.copy_into(self.weights)  # type: ignore[attr-defined]
        self.version = version

    def scribble(self) -> None:
        tensor = self.weights["model.layers.1.weight"]
        as_byte_view(tensor).view(torch.int32)[5] += 1


class _FailingAfter(Mapping[str, torch.Tensor]):
    """Destinations that fail at the lookup after the first ``count`` (those tensors are written by then)."""

    def __init__(self, inner: dict[str, torch.Tensor], count: int) -> None:
        self._inner, self._left = inner, count

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._left == 0:
            raise RuntimeError("the inference engine failed part-way through its load")
        self._left -= 1
        return self._inner[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class StagedSink(InPlaceSink):
    """``InPlaceSink`` that can fail its next load part-way, after its first tensor was written (``fail_next``), and
    says which staging areas its process maps (``mapped_areas``, read from ``/proc/self/maps``)."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.failing = False

    def fail_next(self) -> None:
        self.failing = True

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        if self.failing:
            self.failing = False
            await weights.copy_into(_FailingAfter(self.weights, 2))  # type: ignore[attr-defined]
        await super().load_weights(weights, version=version)

    def mapped_areas(self) -> list[str]:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/dev/shm/weightsync-" in line})


ADDED = "model.added.weight"


def growing_model(version: int) -> list[tuple[str, torch.Tensor]]:
    """:func:`delta_model`, and from version 2 on one tensor more (``ADDED``), a few of its elements changed each
    version."""
    weights = delta_model(version)
    if version >= 2:
        added = torch.arange(3000, dtype=torch.float32) + version * (torch.arange(3000) % 97 == version % 97)
        weights.append((ADDED, added))
    return weights


class GrowingDeltaSource(DeltaModelSource):
    """An actor rank whose model gains a tensor between versions 1 and 2 (:func:`growing_model`)."""

    def set_version(self, version: int) -> str:
        self.version = version
        return weights_digest(growing_model(version))

    def named_weights(self) -> Iterator[Any]:
        yield from growing_model(self.version)


class FallbackSink(RecordingSink):
    """Loads in place (``copy_into``) into tensors of its own, but has none for the names in ``without`` (one of
    them split across buckets) nor for any name it does not know: its fallback keeps a copy of each of those
    (``kept``), and records the names it was given, update by update."""

    without = frozenset({"model.layers.0.weight", "model.layers.4.weight"})

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.params = {name: torch.zeros_like(tensor) for name, tensor in delta_model(0) if name not in self.without}
        self.kept: dict[str, torch.Tensor] = {}
        self.fallback_names: list[list[str]] = []

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        self.fallback_names.append([])
        await weights.copy_into(self.params, fallback=self.fallback)  # type: ignore[attr-defined]
        self.version = version

    def fallback(self, name: str, tensor: torch.Tensor) -> None:
        self.fallback_names[-1].append(name)
        self.kept[name] = tensor.clone()

    def digest(self) -> str:
        return weights_digest([*self.params.items(), *self.kept.items()])

    def fallback_log(self) -> list[list[str]]:
        return self.fallback_names


class AddedByFallbackSink(FallbackSink):
    """:class:`FallbackSink` with a tensor for every name of :func:`delta_model`: only a tensor added later reaches
    its fallback."""

    without = frozenset()


class OnDemandSink(FallbackSink):
    """Starts with no tensors; its fallback creates each destination on demand, in the mapping it passes to
    ``copy_into`` (so the next update finds it there)."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.params = {}

    def fallback(self, name: str, tensor: torch.Tensor) -> None:
        self.fallback_names[-1].append(name)
        self.params[name] = tensor.clone()


class DeviceDeltaSource(DeltaModelSource):
    """:class:`DeltaModelSource` with its weights on the emulated accelerator (every other one with ``mixed``)."""

    mixed = False

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        from tests.devices import emulated_device

        self.device = emulated_device()

    def named_weights(self) -> Iterator[Any]:
        from weightsync.api.testing import place

        yield from place(list(super().named_weights()), self.device, "mixed" if self.mixed else "device")


class MixedDeltaSource(DeviceDeltaSource):
    mixed = True


class DeviceInPlaceSink(InPlaceSink):
    """:class:`InPlaceSink` whose tensors live on the emulated accelerator; counts the bytes this process reads
    back from the accelerator through ``Tensor.cpu`` (how the engine reads device tensors)."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        from tests.devices import emulated_device

        device = emulated_device()
        self.weights = {name: tensor.to(device) for name, tensor in self.weights.items()}
        self.read = 0
        original = torch.Tensor.cpu

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not tensor.is_cpu:
                self.read += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        torch.Tensor.cpu = counting  # type: ignore[method-assign,assignment]

    def read_back(self) -> int:
        """The bytes read back since the last call."""
        read, self.read = self.read, 0
        return read

    def digest(self) -> str:
        return weights_digest([(name, tensor.to("cpu")) for name, tensor in self.weights.items()])

    def devices(self) -> list[str]:
        return sorted({tensor.device.type for tensor in self.weights.values()})


# -- a tensor-parallel model: each rollout worker holds its part (weightsync.api.parts) ------------------------------

TP_LAYERS = 3
TP_HIDDEN = 256


def tp_shapes() -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes of a small decoder: column-parallel ``qkv`` and ``up`` (split along rows), row-parallel
    ``o`` and ``down`` (split along columns), a vocabulary-parallel embedding, replicated norms and a two-row
    ``gate``."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (512, TP_HIDDEN)}
    for layer in range(TP_LAYERS):
        shapes |= {f"layers.{layer}.qkv.weight": (3 * TP_HIDDEN, TP_HIDDEN),
                   f"layers.{layer}.o.weight": (TP_HIDDEN, TP_HIDDEN),
                   f"layers.{layer}.up.weight": (4 * TP_HIDDEN, TP_HIDDEN),
                   f"layers.{layer}.down.weight": (TP_HIDDEN, 4 * TP_HIDDEN),
                   f"layers.{layer}.norm.weight": (TP_HIDDEN,)}
    return shapes | {"gate.weight": (2, TP_HIDDEN)}  # two rows: over three ranks, one shard is empty


def tp_dims() -> dict[str, int]:
    """The dimension each split tensor of :func:`tp_shapes` is split along (the norms are whole on every worker)."""
    return {name: (1 if name.endswith(("o.weight", "down.weight")) else 0)
            for name in tp_shapes() if not name.endswith("norm.weight")}


def tp_part(rank: int, parts: int = 2) -> Any:
    from weightsync.api.parts import Part

    return Part.split(tp_shapes(), dims=tp_dims(), rank=rank, parts=parts)


NUDGED = 1000
"""Versions from this one on are :data:`NUDGED` itself with a few elements changed (what a delta update sends as
changes); the versions below it are random, each wholly unlike the others."""


def tp_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7000 + min(version, NUDGED))
    tensors = [(name, torch.randint(0, 1 << 16, shape, dtype=torch.int32, generator=generator).to(torch.int16)
                .view(torch.bfloat16)) for name, shape in tp_shapes().items()]
    if version > NUDGED:
        for _, tensor in tensors:
            flat = tensor.view(-1)
            flat[(version * 7919) % flat.numel()] = float(version % 256)
    return tensors


UNTOUCHED = -7.0
"""What a ``TpSink``'s full-shape destinations hold outside the worker's slice, update after update."""


def filled(shape: tuple[int, ...], value: float, dtype: torch.dtype, *, transposed: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` holding ``value``; with ``transposed``, a matrix is transposed in memory (not contiguous:
    no compiled copy fills it)."""
    if transposed and len(shape) == 2:
        return torch.full(shape[::-1], value, dtype=dtype).t()
    return torch.full(shape, value, dtype=dtype)


def tp_slice(name: str, tensor: torch.Tensor, rank: int, parts: int = 2) -> torch.Tensor:
    """Rank ``rank``'s slice of checkpoint tensor ``name`` (what its part keeps)."""
    dim = tp_dims().get(name)
    return tensor if dim is None else tensor.chunk(parts, dim)[rank]


class CallCounter:
    """Counts what this process hands one library call: ``measure`` of its arguments, added up until
    :meth:`take` (:func:`counting` wraps the call)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def take(self) -> int:
        """What it counted since the last call."""
        nbytes, self.nbytes = self.nbytes, 0
        return nbytes


def counting(owner: Any, name: str, measure: Callable[..., int]) -> CallCounter:
    """The counter of ``owner.name`` in this process, which wraps it where it is looked up (once per process)."""
    original = getattr(owner, name)
    known: CallCounter | None = getattr(original, "_counter", None)
    if known is not None:
        return known
    counter = CallCounter()

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.nbytes += measure(*args, **kwargs)
        return original(*args, **kwargs)

    counted._counter = counter  # type: ignore[attr-defined]
    setattr(owner, name, counted)
    return counter


def _summed_bytes(rows: Any) -> int:
    return int(sum(rows[1::3]))


def _copied_bytes(destination: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return destination.nbytes


class TpSource(ModelSource):
    """An actor rank's copy of :func:`tp_tensors` (every rank holds the whole model; rank 0 sends it); counts the
    bytes its process sums with the compiled helper's keyed sum (``native.delta_sum``): what a delta sender reads
    again to fold its model and part digests."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        from weightsync.core import native

        self.sums = counting(native, "delta_sum", _summed_bytes)

    def summed(self) -> int:
        """Bytes this process summed since the last call."""
        return self.sums.take()

    def named_weights(self) -> Iterator[Any]:
        yield from tp_tensors(self.version)

    def set_version(self, version: int) -> str:
        self.version = version
        return ""


class _TpLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden = TP_HIDDEN
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)
        self.norm = torch.nn.RMSNorm(hidden)


class _TpModel(torch.nn.Module):
    """A module whose parameters are :func:`tp_shapes` by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, TP_HIDDEN)
        self.layers = torch.nn.ModuleList(_TpLayer() for _ in range(TP_LAYERS))
        self.gate = torch.nn.Linear(TP_HIDDEN, 2, bias=False)


class _FsdpTp(_Inspectable):
    """An actor rank holding the model of :func:`tp_tensors` in bf16 under FSDP2 over gloo (``fully_shard`` on each
    layer and on the model; each rank holds its ``Shard(0)`` block of every parameter): ``join`` first, on every rank
    at once."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world_size, self.version = rank, world_size, 0
        self.module: torch.nn.Module | None = None

    def rail_address(self, rail: int) -> str:
        """This host's address on rail ``rail`` (the testbed's environment), where a gloo group may listen."""
        from weightsync.core.transports.place import RAIL_ADDRS_ENV

        return os.environ[RAIL_ADDRS_ENV].split(",")[rail]

    def join(self, init_method: str, interface: str | None = None) -> None:
        """Join the ranks' gloo group (over ``interface``, a network interface of this host's, where given: the
        trainer's own fabric) and shard the model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world_size)
        mesh = init_device_mesh("cpu", (self.world_size,))
        module = _TpModel().to(torch.bfloat16)
        for layer in module.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        self.module = module

    def set_version(self, version: int) -> str:
        full = dict(tp_tensors(version))
        with torch.no_grad():
            for name, parameter in self._module().named_parameters():
                local = parameter.to_local()  # type: ignore[attr-defined]
                offsets = parameter.__create_chunk_list__()[0].offsets  # type: ignore[attr-defined]
                local.copy_(full[name][tuple(slice(at, at + size) for at, size in zip(offsets, local.shape))])
        self.version = version
        return weights_digest(list(full.items()))

    def _module(self) -> torch.nn.Module:
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__}: join() first")
        return self.module


class FsdpTpSource(_FsdpTp):
    """A rank of a sharded ``actor_wg``: streams its own blocks (``weightsync.core.ModuleShards``), its layout
    declared."""

    def named_weights(self) -> Iterator[Any]:
        from weightsync.core import ModuleShards

        return iter(ModuleShards(self._module()).named_weights())

    def source_layout(self) -> Any:
        from weightsync.core import ModuleShards

        return ModuleShards(self._module()).source_layout()


class FsdpTpGathered(_FsdpTp):
    """The baseline a sharded source replaces: every rank streams whole tensors, each gathered over the ranks' gloo
    group (``full_tensor()``, collective: every rank drains its stream), and no layout; rank 0 sends."""

    def named_weights(self) -> Iterator[Any]:
        return ((name, parameter.full_tensor()) for name, parameter  # type: ignore[attr-defined]
                in self._module().named_parameters())


class WholeSink(RecordingSink):
    """A rollout worker that holds the whole model (``held``: what it holds)."""

    def held(self) -> dict[str, torch.Tensor]:
        return dict(self.weights)


class HashCounter:
    """Counts the bytes this process hashes with XXH3 (both widths weightsync uses), by wrapping the library's
    classes: what a worker reads to verify an update, seen from outside the engine."""

    nbytes = 0

    @classmethod
    def install(cls) -> None:
        import xxhash

        if getattr(xxhash, "_counted", False):
            return
        for name in ("xxh3_64", "xxh3_128"):
            original = getattr(xxhash, name)

            class Counted:
                def __init__(self, *args: Any, _original: Any = original, **kwargs: Any) -> None:
                    self._inner = _original(*args, **kwargs)

                def update(self, data: Any) -> None:
                    HashCounter.nbytes += memoryview(data).nbytes
                    self._inner.update(data)

                def __getattr__(self, attribute: str) -> Any:
                    return getattr(self._inner, attribute)

            setattr(xxhash, name, Counted)
        xxhash._counted = True  # type: ignore[attr-defined]


class TpSink(RecordingSink):
    """A rollout worker of a tensor-parallel replica: keeps only its slice of each tensor (``tp_slice``), as an
    inference engine's loader does; counts the bytes this process hashes (:class:`HashCounter`) and copies into
    tensors through torch's ``Tensor.copy_`` rather than in place with the compiled helper."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.rank = worker
        self.shards: dict[str, torch.Tensor] = {}
        self.shards_kind = ""
        """The ``set_loading`` that ``shards`` were allocated for."""
        self.storages: dict[int, int] = {}
        """The memory the last update's views lay in: address → bytes."""
        self.views: dict[str, torch.Tensor] = {}
        HashCounter.install()
        self.copies = counting(torch.Tensor, "copy_", _copied_bytes)

    async def load_weights(self, weights: Any, *, version: int) -> None:
        """``views`` (``set_loading``): each slice cloned from the stream's views; ``shards``: ``copy_into`` shards
        of the slices' shapes, allocated once; ``full``: ``copy_into`` destinations of the tensors' whole shapes,
        allocated once and filled with :data:`UNTOUCHED`, of which the worker keeps its slices (a matrix transposed
        in memory, as no compiled copy fills: each of its pieces goes through its view)."""
        if self.loading in ("shards", "full"):
            if self.loading != self.shards_kind:
                self.shards_kind = self.loading
                full = self.loading == "full"
                self.shards = {name: filled(tensor.shape if full else tp_slice(name, tensor, self.rank).shape,
                                            UNTOUCHED if full else 0.0, tensor.dtype, transposed=full)
                               for name, tensor in tp_tensors(0)}
            await weights.copy_into(self.shards)
            self.weights = {name: tp_slice(name, tensor, self.rank) if self.loading == "full" else tensor
                            for name, tensor in self.shards.items()}
        else:
            self.storages, self.views = {}, {}
            async for name, tensor in weights:
                self.weights[name] = tp_slice(name, tensor, self.rank).clone()
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
                self.views[name] = tensor
        self.version = version

    def scribble(self, name: str, element: int) -> None:
        """Change one element of the last update's view of ``name`` (of a delta update: the engine's kept copy),
        behind the engine's back."""
        with torch.no_grad():
            self.views[name].view(-1)[element] += 1

    def held(self) -> dict[str, torch.Tensor]:
        return dict(self.weights)

    def touched_outside(self) -> list[str]:
        """With ``full`` destinations: the tensors with an element outside this worker's slice that is no longer
        :data:`UNTOUCHED` (the engine wrote where the worker holds nothing)."""
        touched = []
        for name, tensor in self.shards.items():
            outside = torch.ones(tensor.shape, dtype=torch.bool)
            tp_slice(name, outside, self.rank).fill_(False)
            if not (tensor[outside] == UNTOUCHED).all():
                touched.append(name)
        return touched

    def views_resident(self) -> tuple[int, int]:
        """Of the memory the last update's views lay in: the bytes of its pages that are in memory, as this
        process's page table says (``/proc/self/pagemap``: present and mapped by this process alone, so not the
        shared zero page a read of an unwritten page maps), and its bytes."""
        page = os.sysconf("SC_PAGE_SIZE")
        resident = 0
        with open("/proc/self/pagemap", "rb") as pagemap:
            for address, nbytes in self.storages.items():
                first, last = address // page, (address + nbytes - 1) // page
                pagemap.seek(first * 8)
                entries = array.array("Q", pagemap.read((last - first + 1) * 8))
                resident += page * sum(1 for entry in entries if entry >> 63 & 1 and entry >> 56 & 1)
        return resident, sum(self.storages.values())

    def hashed(self) -> int:
        """Bytes hashed in this process so far (then reset)."""
        nbytes, HashCounter.nbytes = HashCounter.nbytes, 0
        return nbytes

    def copied(self) -> int:
        """Bytes copied into tensors with ``Tensor.copy_`` in this process so far (then reset)."""
        return self.copies.take()


class _FlipSecondHalf:
    """Corrupts, after transit and before hashing, one byte of the first bucket that only rank 1 of a two-way split
    of the first tensor of :func:`tp_tensors` holds (its first tensor is split along rows: rank 1 holds the second
    half of its bytes); every update (shared-memory receivers see each other's writes: add, never XOR)."""

    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        if index == 0 and payload.numel() > 200_000:
            payload[200_000] += 1  # embed.weight: 512 x 256 bf16 = 262,144 bytes; rank 1 holds 131,072 onwards


FLIP_SECOND_HALF = _FlipSecondHalf()
