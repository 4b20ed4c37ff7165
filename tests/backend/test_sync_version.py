"""sync_weights(version=...): a caller's version tag becomes the sampler's version and every
sample echoes it; a tag that does not move the version forward is refused, changing nothing."""

from __future__ import annotations

import pickle

import pytest

import floe
from tests.conftest import assert_same_state, state_snapshot


def _train_one_step(client: floe.Client) -> None:
    tok = client.tokenizer()
    client.forward_backward(floe.Batch([floe.Group(tok.encode("q"), [floe.Sample(tok.encode("ab"))])]), "cross_entropy")
    client.optim_step()


def test_a_caller_tag_becomes_the_version_that_samples_echo(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    _train_one_step(client)
    result = client.sync_weights(version=7)
    assert result.version == 7 and result.bytes > 0
    assert client.info().sampler_version == 7
    out = client.sample([[3, 4, 5], [6, 7]], n=2, params=floe.SamplingParams(max_tokens=3, seed=0))
    assert out.weights_version == 7
    assert [s.weights_version for g in out.groups for s in g.samples] == [7, 7, 7, 7]
    # A plain sync still moves on by one from the caller's tag.
    assert client.sync_weights().version == 8
    assert client.sync_weights(version=20).version == 20


def test_the_tag_survives_save_and_load(make_client):
    client = make_client()
    client.sync_weights(version=5)
    client.save_state("tagged")
    client.sync_weights(version=9)
    assert client.load_state("tagged").version == 5
    assert client.sample([[3, 4]], params=floe.SamplingParams(max_tokens=2, seed=1)).weights_version == 5


@pytest.mark.parametrize("bad", [0, 3, -1, 2.0, "4", True])
def test_a_tag_that_is_not_a_larger_int_is_refused_and_changes_nothing(make_client, bad):
    client = make_client(optimizer={"lr": 1e-2})
    client.sync_weights(version=3)
    _train_one_step(client)
    before = state_snapshot(client)
    with pytest.raises(floe.InvalidInput) as info:
        client.sync_weights(version=bad)
    assert info.value.field == "version"
    assert_same_state(before, state_snapshot(client))
    assert client.info().sampler_version == 3
    err = pickle.loads(pickle.dumps(info.value))
    assert (type(err), str(err), err.field) == (type(info.value), str(info.value), "version")
