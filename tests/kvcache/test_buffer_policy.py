"""``BufferPolicy``: the GPU buffer's mechanisms outside the config, at the defaults the config's
cache section had for them (the cache builder applies them: tests/engine/test_cache_builder.py)."""

import pytest

from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy


def test_the_defaults_are_the_ones_the_cache_section_had():
    # cache.buffer_pages_per_head 0, per_head_shares, elastic_shares and buffer_reuse true,
    # segment_pages 64
    assert DEFAULT_POLICY == BufferPolicy(pages_per_head=0, per_head_shares=True, elastic_shares=True, reuse=True,
                                          segment_pages=64)


@pytest.mark.parametrize("fields, message", [
    ({"pages_per_head": -1}, "BufferPolicy.pages_per_head=-1: must be >= 0"),
    ({"segment_pages": 48}, "BufferPolicy.segment_pages=48: use a power of two in 1..1024"),
    ({"segment_pages": 2048}, "BufferPolicy.segment_pages=2048: use a power of two in 1..1024"),
])
def test_a_value_out_of_range_is_refused(fields, message):
    with pytest.raises(ValueError) as e:
        BufferPolicy(**fields)
    assert str(e.value) == message
