"""Fixtures the framework plug-in tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory):
    """A one-process gloo group, as the frameworks' engines expect one (verl all-reduces the batch's token
    count over its data-parallel group; AReaL's FSDP actor reads its ranks). Left alone if one exists."""
    if torch.distributed.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
