"""``ReceivedWeights.copy_into`` into destinations whose memory does not hold the values they show.

A lazily negated view (a complex tensor's conjugate's ``imag`` — a real tensor, and contiguous when it has one
element) or a lazily conjugated complex tensor must be filled through ``Tensor.copy_``, which honours the bit; a
raw ``memmove`` into its memory would make it show the negated (conjugated) values.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

import pytest
import torch

from weightsync.core.native import copy_columns
import weightsync.core.pipeline.unpack as unpack_module

from tests.reliability.test_bad_inputs import Pair, pair  # noqa: F401  (the fixture)


def receive_into(pair: Pair, sent: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor]) -> int:  # noqa: F811
    async def both() -> int:
        sending = asyncio.ensure_future(pair.sender.send_weights(list(sent.items())))
        count = await pair.receiver.receive_weights().copy_into(destinations)
        await sending
        return count

    return asyncio.run(both())


def test_lazily_negated_and_conjugated_destinations_show_the_sent_values(pair: Pair) -> None:  # noqa: F811
    negated = torch.tensor([0j]).conj().imag
    conjugated = torch.zeros(3, dtype=torch.complex64).conj()
    plain = torch.zeros(4)
    assert negated.is_neg() and negated.is_contiguous() and conjugated.is_conj() and conjugated.is_contiguous()
    sent = {"negated": torch.tensor([2.5]), "conjugated": torch.tensor([1 + 2j, 3 - 4j, -5j], dtype=torch.complex64),
            "plain": torch.arange(4.0)}
    count = receive_into(pair, sent, {"negated": negated, "conjugated": conjugated, "plain": plain})
    assert count == 3
    for name, destination in (("negated", negated), ("conjugated", conjugated), ("plain", plain)):
        assert torch.equal(destination.resolve_neg().resolve_conj(), sent[name]), name


def test_the_check_sees_a_raw_write_into_a_negated_view() -> None:
    # Negative control: a raw memmove into the view's memory (what copy_into must not do) fails the comparison.
    negated = torch.tensor([0j]).conj().imag
    sent = torch.tensor([2.5])
    ctypes.memmove(negated.data_ptr(), sent.data_ptr(), sent.nbytes)
    assert not torch.equal(negated.resolve_neg(), sent)


def counting(monkeypatch: pytest.MonkeyPatch, attribute: str) -> list[int]:
    """Wrap the receiver's ``attribute`` copy function; the list grows by one per call (seen from outside)."""
    calls: list[int] = []
    inner = getattr(unpack_module, attribute)

    def wrapper(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        inner(*args, **kwargs)

    monkeypatch.setattr(unpack_module, attribute, wrapper)
    return calls


def small_model() -> dict[str, torch.Tensor]:
    # 64 KiB buckets (the pair fixture): many small tensors, and one of 150 KB split across three buckets whose
    # tail (an offset inside its tensor) lands in a bucket of small pieces only.
    sent = {f"v{i}": torch.arange(i, i + 300, dtype=torch.float32) for i in range(40)}
    sent["split"] = torch.arange(37_500, dtype=torch.float32)
    sent.update({f"w{i}": torch.full((77,), float(i), dtype=torch.bfloat16) for i in range(40)})
    return sent


def test_buckets_of_small_pieces_are_copied_column_wise(pair: Pair,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sent = small_model()
    columns = counting(monkeypatch, "copy_columns")
    destinations = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    assert receive_into(pair, sent, destinations) == len(sent)
    assert columns  # the bulk path ran
    assert all(torch.equal(destinations[name], sent[name]) for name in sent)
    # The next update repeats every table (the plans are cached): still exact.
    destinations = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    assert receive_into(pair, sent, destinations) == len(sent)
    assert all(torch.equal(destinations[name], sent[name]) for name in sent)


def test_a_bucket_with_one_unusual_destination_goes_tensor_by_tensor(pair: Pair,  # noqa: F811
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sent = small_model()
    batches = counting(monkeypatch, "copy_batch")
    destinations = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    destinations["v3"] = torch.zeros(600)[::2]  # not contiguous: filled through Tensor.copy_
    del destinations["w5"]
    caught: dict[str, torch.Tensor] = {}
    count = asyncio.run(_receive_with_fallback(pair, sent, destinations, caught))
    assert count == len(sent) and set(caught) == {"w5"} and torch.equal(caught["w5"], sent["w5"])
    assert batches  # those buckets went through the per-tensor loop
    assert all(torch.equal(destinations[name], sent[name]) for name in destinations)


async def _receive_with_fallback(pair: Pair, sent: dict[str, torch.Tensor],  # noqa: F811
                                 destinations: dict[str, torch.Tensor], caught: dict[str, torch.Tensor]) -> int:
    sending = asyncio.ensure_future(pair.sender.send_weights(list(sent.items())))
    count = await pair.receiver.receive_weights().copy_into(
        destinations, fallback=lambda name, tensor: caught.__setitem__(name, tensor.clone()))
    await sending
    return count


def test_the_comparison_sees_a_skipped_column_entry(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Negative control: a column copy that drops its last entry leaves a destination unwritten, and the byte
    # comparison of the tests above sees it.
    def drops_one(destinations: Any, sources: Any, sizes: Any, start: int, stop: int, base: int) -> None:
        copy_columns(destinations, sources, sizes, start, max(start, stop - 1), base)

    monkeypatch.setattr(unpack_module, "copy_columns", drops_one)
    sent = small_model()
    destinations = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    receive_into(pair, sent, destinations)
    assert not all(torch.equal(destinations[name], sent[name]) for name in sent)


def test_the_reference_path_lands_the_same_bytes_as_the_fast_ones(pair: Pair,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sent = small_model()
    fast = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    assert receive_into(pair, sent, fast) == len(sent)
    # Every bucket through the view and Tensor.copy_ (no raw copy at all), the digest still checked at the end.
    original = unpack_module.BucketReader.copy_out

    def reference(self: Any, destinations: Any, fallback: Any, *, reference: bool = False) -> int:
        return original(self, destinations, fallback, reference=True)

    monkeypatch.setattr(unpack_module.BucketReader, "copy_out", reference)
    columns, batches = counting(monkeypatch, "copy_columns"), counting(monkeypatch, "copy_batch")
    slow = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}
    assert receive_into(pair, sent, slow) == len(sent)
    assert not columns and not batches
    assert all(torch.equal(slow[name], sent[name]) and torch.equal(fast[name], slow[name]) for name in sent)
