"""The transformers releases the peers rely on (engines/peers/transformers_api.py): the bound in pyproject.toml is
the oldest release the rest runs on (5.17, tested with the suite's hf tests under it), and hf-cb, which needs a
newer one, refuses when chosen."""

from __future__ import annotations

import pytest

import engines.peers.transformers_api as api
from engines.factory import EngineConfigError, EngineSpec, make_engine
from tests.conftest import ROOT


def test_a_version_reads_as_its_release():
    assert api.release("5.17.0") == (5, 17) and api.release("5.25.0.dev0") == (5, 25)
    with pytest.raises(ValueError, match="no major.minor"):
        api.release("nightly")


def test_the_naive_engine_passes_its_cache_under_the_name_the_release_reads():
    assert api.generate_cache_argument((5, 17)) == api.generate_cache_argument((5, 23)) == "past_key_values"
    assert api.generate_cache_argument((5, 24)) == api.generate_cache_argument((6, 0)) == "cache"


def test_hf_cb_on_an_older_transformers_is_refused_when_chosen_before_the_model_loads(tiny_model, monkeypatch):
    assert api.continuous_batching_refusal((5, 19)) is None
    monkeypatch.setattr(api, "release", lambda text=None: (5, 17))
    monkeypatch.setattr("engines.scheduled.model.load_hf_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(EngineConfigError, match=r"hf-cb needs transformers>=5\.19"):
        make_engine(EngineSpec("hf-cb", str(tiny_model), 16 * 2**20, max_seq_len=512))


def test_the_declared_bounds_admit_a_gpu_images_transformers_and_torch():
    """A typical GPU box holds torch 2.11 and transformers 5.17: pyproject.toml must accept both."""
    import tomllib
    from packaging.requirements import Requirement

    declared = {r.name: r.specifier for r in map(Requirement, tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"])}
    assert declared["torch"].contains("2.11.0") and declared["transformers"].contains("5.17.0")
    assert not declared["transformers"].contains("5.16.1")  # older than any release the suite ran on
