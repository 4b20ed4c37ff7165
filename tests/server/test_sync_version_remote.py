"""sync_weights(version=...) over HTTP: the tag travels, samples echo it, a bad tag is the
same InvalidInput naming `version` as in process."""

from __future__ import annotations

import pytest

import floe


def test_version_tag_over_http(start_server):
    client = start_server().client(timeout=60)
    try:
        assert client.sync_weights(version=4).version == 4
        out = client.sample([[3, 4, 5]], n=2, params=floe.SamplingParams(max_tokens=3, seed=0))
        assert [s.weights_version for s in out.groups[0].samples] == [4, 4]
        with pytest.raises(floe.InvalidInput) as info:
            client.sync_weights(version=4)
        assert info.value.field == "version"
        assert client.sync_weights().version == 5
    finally:
        client.close()


def test_a_version_beyond_int64_is_refused_and_sampling_keeps_working(start_server):
    """The attack of a security review: `version = 2**63` was accepted, and from then on every
    sample reply failed to encode (its version is an int64 on the wire) and a saved state kept it."""
    server = start_server()
    client = server.client(timeout=60)
    try:
        with pytest.raises(floe.InvalidInput) as info:
            client.sync_weights(version=2**63)
        assert info.value.field == "version" and "2**63 - 1" in str(info.value)
        assert client.info().sampler_version == 0
        # The largest version is taken; a plain sync after it would overflow, so it is refused.
        assert client.sync_weights(version=2**63 - 1).version == 2**63 - 1
        out = client.sample([[3, 4, 5]], params=floe.SamplingParams(max_tokens=2, seed=0))
        assert out.groups[0].samples[0].weights_version == 2**63 - 1
        with pytest.raises(floe.InvalidInput) as info:
            client.sync_weights()
        assert info.value.field == "version" and "largest" in str(info.value)
        assert client.info().sampler_version == 2**63 - 1
        client.save_state("at-limit")
        assert client.load_state("at-limit").version == 2**63 - 1
    finally:
        client.close()
