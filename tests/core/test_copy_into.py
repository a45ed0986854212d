"""``ReceivedWeights.copy_into`` into destinations whose memory does not hold the values they show.

A lazily negated view (a complex tensor's conjugate's ``imag`` — a real tensor, and contiguous when it has one
element) or a lazily conjugated complex tensor must be filled through ``Tensor.copy_``, which honours the bit; a
raw ``memmove`` into its memory would make it show the negated (conjugated) values.
"""

from __future__ import annotations

import asyncio
import ctypes

import torch

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
