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
