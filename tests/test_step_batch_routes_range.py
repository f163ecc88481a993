"""The step batch's routes in a narrower dtype than stored: ids the asked dtype cannot
hold are refused with a typed error, never wrapped."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_step_batch import E, K, L, group, verified

from tasks.errors import InvalidInput
from tasks.finalize.step_batch import step_batch


def _int16_routes(value: int):
    g = group(verified(13, n=2, routes=(L, K, E)), [0.0, 1.0])
    routes = torch.full(g.routed_experts.shape, value, dtype=torch.int16)
    return dataclasses.replace(g, routed_experts=routes, has_routes=torch.ones(2, dtype=torch.bool))


def test_negative_int16_ids_asked_as_uint8_are_refused_not_wrapped():
    neg = _int16_routes(-1)
    with pytest.raises(InvalidInput, match="uint8"):
        step_batch([neg], routes_dtype=torch.uint8)
    # Wider dtypes hold the stored values as they are.
    assert int(step_batch([neg], routes_dtype=torch.int64)["routed_experts"].min()) == -1


def test_ids_in_range_asked_as_uint8_keep_their_values():
    g = _int16_routes(255)
    b = step_batch([g], routes_dtype=torch.uint8)
    real = b["attention_mask"].bool()
    assert b["routed_experts"].dtype == torch.uint8 and bool((b["routed_experts"][real] == 255).all())
