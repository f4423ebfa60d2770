"""`can_overlap`: which steps may launch before the previous step's tokens are read back."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.step.overlap import can_overlap

SAMPLER = Sampler(torch.device("cpu"), 0, [0])


def request(num_tokens: int = 4, pages: int = 1, **params) -> Request:
    r = Request("r", list(range(1, num_tokens + 1)), SamplingParams(**params), IncrementalDetokenizer(None))
    r.pages = list(range(1, pages + 1))
    return r


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 0},
        {"prompt_logprobs": 0},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"min_tokens": 2},
    ],
)
def test_host_data_before_sampling_keeps_a_step_from_overlapping(params) -> None:
    reqs = [request(), request(**params)]
    assert can_overlap(SAMPLER, [reqs[0]], reqs, page_size=16, free_pages=0, in_flight=True)
    assert not can_overlap(SAMPLER, reqs, reqs, page_size=16, free_pages=100, in_flight=False)


def test_with_a_step_in_flight_every_decode_needs_a_page_without_preempting() -> None:
    # 17 tokens in pages of 16: each request needs a second page
    running = [request(num_tokens=17, pages=1), request(num_tokens=17, pages=1), request(num_tokens=5)]
    assert can_overlap(SAMPLER, running, running, page_size=16, free_pages=2, in_flight=True)
    assert not can_overlap(SAMPLER, running, running, page_size=16, free_pages=1, in_flight=True)
    # nothing in flight: the scheduler may still preempt, so pages do not decide
    assert can_overlap(SAMPLER, running, running, page_size=16, free_pages=0, in_flight=False)
