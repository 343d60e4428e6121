"""Models built on the meta device for validation skip their weights' initialisation
(paratrain/models/meta.py): the same parameters, shapes and dtypes as a real build, and nothing
skipped on a tensor that is not on the meta device."""

from __future__ import annotations

import threading

import pytest
import torch

from paratrain.models import build_model
from paratrain.models.meta import on_meta
from paratrain.models.user_model import file_model_config

OWN_MODEL = "examples/own_model/model.py:build"


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt-tiny", "llama-tiny", OWN_MODEL])
def test_a_model_built_on_meta_has_the_real_models_parameters(name):
    real = build_model(name)
    with on_meta():
        meta = build_model(name)
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == \
           [(n, p.shape, p.dtype) for n, p in real.named_parameters()]
    assert all(p.is_meta for p in meta.parameters())


def test_initialisation_off_the_meta_device_still_runs_in_the_block_and_in_other_threads():
    seen = {}

    def elsewhere():
        seen["thread"] = torch.nn.init.normal_(torch.zeros(1000)).std().item()

    with on_meta():
        here = torch.nn.init.uniform_(torch.zeros(1000, device="cpu"), 1.0, 2.0)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert here.min().item() >= 1.0 and seen["thread"] > 0.5


def test_a_user_models_meta_build_reads_its_sizes():
    config = file_model_config(OWN_MODEL, {})
    assert config.vocab_size and config.block_size
