"""The names under which a zone's module holds a tied parameter: each traced zone re-ties them."""

from __future__ import annotations

import torch

from sharded_tensor._model.engine.zone import ties as _ties


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.body.register_buffer("scale", self.scale)


def test_ties_lists_every_name_of_a_shared_tensor_first_name_first() -> None:
    assert _ties(_Tied()) == (("embed.weight", "head.weight"), ("scale", "body.scale"))


def test_untied_module_has_no_ties() -> None:
    assert _ties(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == ()
